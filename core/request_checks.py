"""A request's validation, written once: what LLMEngine.add_request refuses (and the server's test
engine, entrypoints/openai/testing.py, refuses alike) — each a RequestError naming the parameter."""
from __future__ import annotations

from typing import Any, Callable, Optional

from .errors import RequestError


def prompt_token_ids(prompt: Any, encode: Callable[[str], list[int]],
                     vocab_size: int) -> tuple[Optional[str], list[int]]:
    """(text or None, token ids) of a prompt: a string, a list of token ids, or a dict with
    `prompt` or `prompt_token_ids`."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), check_token_ids(prompt["prompt_token_ids"], vocab_size)
        if "prompt" not in prompt:
            raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt", "invalid_value")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, list(encode(prompt))
    if isinstance(prompt, (list, tuple)):
        return None, check_token_ids(prompt, vocab_size)
    raise RequestError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
                       "prompt", "invalid_type")


def check_token_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("prompt_token_ids must be a list of integers", "prompt", "invalid_type")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is out of vocabulary (0..{vocab_size - 1}).",
                           "prompt", "invalid_value")
    return list(ids)


def check_length(num_prompt: int, params: Any, limit: int, max_tokens_must_fit: bool,
                 fits_in_pool: Callable[[int], Optional[str]]) -> None:
    """The prompt against max_model_len (`limit`) and the KV pool; with `max_tokens_must_fit` (the
    OpenAI server) an explicit max_tokens that cannot fit is refused as OpenAI does. Offline callers
    get generation capped at max_model_len (finish_reason "length"); a default max_tokens (not set
    by the caller) is always just capped."""
    if num_prompt == 0:
        raise RequestError("The prompt is empty.", "prompt", "invalid_value")
    if num_prompt + 1 > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{num_prompt} tokens, leaving no room for any output. Please reduce the length of the prompt.",
            "prompt", "context_length_exceeded")
    if (max_tokens_must_fit and params.max_tokens is not None and params.is_explicit("max_tokens")
            and num_prompt + params.max_tokens > limit):
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, {params.max_tokens} in "
            f"the completion). Please reduce the length of the prompt or of max_tokens.",
            "max_tokens", "context_length_exceeded")
    problem = fits_in_pool(num_prompt + 1)
    if problem:
        raise RequestError(problem, "prompt", "invalid_value")


def pool_problem(needed: int, num_blocks: int) -> Optional[str]:
    """None when a sequence that holds at most `needed` blocks can ever be held by a pool of
    `num_blocks`, else why not."""
    if needed > num_blocks:
        return f"the prompt needs {needed} KV blocks but the pool has only {num_blocks} (raise kv_cache_memory)"
    return None
