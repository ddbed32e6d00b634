"""Which runner a checkpoint gets (generate or pooling) and, for pooling, how its vectors are made.

Read as vLLM reads them, most specific first:
  1. `pooler_config` given by the caller (`--pooler-config '{"pooling_type": "MEAN", "normalize": true}'`);
  2. the sentence-transformers files the checkpoint ships: modules.json, the Pooling module's
     config.json (pooling_mode_cls_token / pooling_mode_mean_tokens / pooling_mode_lasttoken) and a
     Normalize module;
  3. the architecture's default: encoders (BertModel, XLMRobertaModel) CLS, decoders last token;
     both normalized.
`runner="auto"` picks pooling for an encoder or decoder checkpoint without an LM head (BertModel,
Qwen3Model, ...) and for a checkpoint with a sentence-transformers Pooling module; else generate.
Matryoshka truncation (`dimensions`) is allowed when config.json says `is_matryoshka` or lists
`matryoshka_dimensions`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

POOLING_TYPES = ("CLS", "MEAN", "LAST")
RUNNERS = ("auto", "generate", "pooling")
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
# Decoders saved without their LM head (sentence-transformers saves the AutoModel it wraps).
HEADLESS_DECODER_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
# sentence-transformers' Pooling config: boolean pooling_mode_* keys (v2-v5) or one pooling_mode string (v6).
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str                     # CLS | MEAN | LAST
    normalize: bool
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[tuple[int, ...]] = None
    source: str = "default"               # where pooling_type/normalize came from (logged)

    def dimensions_problem(self, dimensions: int) -> Optional[str]:
        """None when `dimensions` may be asked for, else why not (vLLM's wording)."""
        if not self.is_matryoshka:
            return (f"Model does not support matryoshka representation, changing output dimensions will lead "
                    f"to poor results (dimensions={dimensions}).")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return (f"dimensions {dimensions} is not one of the model's matryoshka_dimensions "
                    f"{list(self.matryoshka_dimensions)}")
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be in 1..{self.hidden_size}, got {dimensions}"
        return None


def parse_pooler_override(value: Any) -> Optional[dict]:
    """`pooler_config` from a dict or its JSON text; ValueError naming pooler_config."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"pooler_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"pooler_config must be an object, got {type(value).__name__}")
    unknown = sorted(set(value) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config has unknown keys {unknown}; known: ['normalize', 'pooling_type']")
    out = dict(value)
    if "pooling_type" in out:
        kind = str(out["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooler_config pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                             f"got {out['pooling_type']!r}")
        out["pooling_type"] = kind
    if "normalize" in out and not isinstance(out["normalize"], bool):
        raise ValueError("pooler_config normalize must be true or false")
    return out


def _read_json(path: str) -> Optional[Any]:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def sentence_transformers_pooling(model_dir: Optional[str]) -> Optional[dict]:
    """{"pooling_type", "normalize"} from a checkpoint's sentence-transformers files, or None without
    a Pooling module. ValueError for modules whose output tokenmill would not reproduce (Dense, ...)."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if not isinstance(modules, list):
        return None
    found: dict[str, Any] = {}
    for module in modules:
        kind = str(module.get("type", "")).rpartition(".")[2]     # the module path moved between versions
        if kind == "Pooling":
            cfg = _read_json(os.path.join(model_dir, module.get("path", ""), "config.json")) or {}
            if isinstance(cfg.get("pooling_mode"), str):
                modes = [cfg["pooling_mode"]]
            else:
                modes = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
            names = {**_ST_MODES, **_ST_MODE_NAMES}
            if len(modes) != 1 or modes[0] not in names:
                raise ValueError(f"sentence-transformers pooling {modes or 'none'} is not supported (cls, mean "
                                 "or lasttoken); override it with pooler_config")
            found["pooling_type"] = names[modes[0]]
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind and kind != "Transformer":
            raise ValueError(f"sentence-transformers module {module.get('type')} ({module.get('path')}) "
                             "is not supported")
    if "pooling_type" not in found:
        return None
    found.setdefault("normalize", False)
    return found


def resolve_pooler_config(runner: str, architecture: str, hf_config: Any, model_dir: Optional[str],
                          override: Any = None) -> Optional[PoolerConfig]:
    """The PoolerConfig of a pooling run, or None for a generating one. ValueError naming `runner`
    when the checkpoint cannot run as asked."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    headless = architecture in ENCODER_ARCHITECTURES or architecture in HEADLESS_DECODER_ARCHITECTURES
    st = sentence_transformers_pooling(model_dir)
    if runner == "generate" and headless:
        raise ValueError(f"{architecture} has no LM head: it can only run with runner='pooling'")
    if runner == "generate" or (runner == "auto" and not headless and st is None):
        return None
    settings = {"pooling_type": "CLS" if architecture in ENCODER_ARCHITECTURES else "LAST", "normalize": True}
    source = "default"
    if st is not None:
        settings.update(st)
        source = "sentence-transformers"
    custom = parse_pooler_override(override)
    if custom:
        settings.update(custom)
        source = "pooler_config"
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolerConfig(
        pooling_type=settings["pooling_type"], normalize=bool(settings["normalize"]),
        hidden_size=int(hf_config.hidden_size),
        is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None, source=source)
