"""The names a server answers to: the model's served names, and its LoRA adapters (issue 14).

A request whose `model` is an adapter's name runs on that adapter: `check_served_model` answers
with that name and notes it for the request (`REQUEST_LORA`, read when the engine requests are
added, in the same request task); the engine process resolves the name (core/engine_process.py).
The adapter names live in the engine's EngineInfo (`lora_adapters`: name -> path), refreshed by
every load/unload (serving_lora.py).
"""
from __future__ import annotations

import contextvars
import re
from typing import Any, Optional

from . import errors as E

# A GGUF file's quantization suffix: SmolLM2-135M-Instruct.Q4_1, Llama-3.2-1B-Q4_K_M, x-f16, x.BF16, x-IQ3_XXS.
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[0-9A-Z]+)*|TQ\d_\d|B?F16|F32|MXFP4)$", re.IGNORECASE)

# The adapter the request being served runs on (None: the base model); set by check_served_model.
REQUEST_LORA: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("tokenmill_lora", default=None)


def default_served_name(model_name: str) -> str:
    """The name a model is served as without --served-model-name: its stem, less a quantization suffix."""
    return _QUANT_SUFFIX.sub("", model_name) or model_name


def lora_adapters(info: Any) -> dict[str, str]:
    """The engine's LoRA adapters, name -> path (empty without --enable-lora)."""
    return getattr(info, "lora_adapters", None) or {}


def check_served_model(state: Any, model: Optional[str]) -> str:
    """The name to answer with: the served name for the base model (or no `model`), the adapter's
    own name for an adapter; 404 model_not_found for anything else."""
    if model is None or model == "" or model in state.model_names:
        REQUEST_LORA.set(None)
        return state.model_name
    if model in lora_adapters(state.info):
        REQUEST_LORA.set(model)
        return model
    raise E.model_not_found(model)


def engine_prompt(token_ids: list[int]) -> dict[str, Any]:
    """The prompt dict sent to the engine, naming the request's adapter when it has one."""
    lora = REQUEST_LORA.get()
    return {"prompt_token_ids": token_ids} if lora is None else {"prompt_token_ids": token_ids, "lora_request": lora}
