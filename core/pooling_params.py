"""What a pooling (embedding) request asks for, and the engine's checks of it.

A pooling request is the vLLM v1 kind: prefill only. Its sequence is scheduled like any other
(same token budget, same paged KV blocks), the model runner pools its hidden states instead of
sampling, and it finishes the step its last prompt token is computed, with its vector in the
finishing RequestDelta (`pooled`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from .errors import RequestError
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .pooler_config import PoolerConfig


@dataclass
class PoolingParams:
    """`dimensions`: keep the first k values (Matryoshka models only), re-normalized when the model
    normalizes. `normalize`: None = as the model's pooler config says."""
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise RequestError(f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions",
                               "invalid_value")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise RequestError("normalize must be a boolean", "normalize", "invalid_type")


# The sequence of a pooling request carries these: one "step" of output, no detokenizer, no logprobs.
_PREFILL_ONLY = SamplingParams(max_tokens=1, detokenize=False)


def pooling_request(params: Any, pooler: Optional["PoolerConfig"], num_prompt_tokens: int, max_model_len: int,
                    fits_in_pool: Callable[[int], Optional[str]]) -> tuple[SamplingParams, Optional[PoolingParams]]:
    """(the SamplingParams the request's sequence carries, its PoolingParams or None for generation).
    RequestError when the request does not fit the model: an embedding request to a generating model,
    a generation request to a pooling model, `dimensions` the model does not allow, a long input."""
    if pooler is None:
        if isinstance(params, PoolingParams):
            raise RequestError("The model does not support Embeddings API (it runs as a generating model; "
                               "serve it with --runner pooling to embed).", "model", "model_not_supported")
        return params or SamplingParams(), None
    if params is not None and not isinstance(params, PoolingParams):
        raise RequestError("This model runs as a pooling (embedding) model and does not generate text: use "
                           "/v1/embeddings (LLM.embed), or run it with --runner generate.", "model",
                           "model_not_supported")
    params = params or PoolingParams()
    if params.dimensions is not None:
        problem = pooler.dimensions_problem(params.dimensions)
        if problem:
            raise RequestError(problem, "dimensions", "invalid_value")
    if num_prompt_tokens == 0:
        raise RequestError("The input is empty.", "prompt", "invalid_value")
    if num_prompt_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens} tokens in the input. Please reduce the length of the input "
            "(or set truncate_prompt_tokens).", "prompt", "context_length_exceeded")
    problem = fits_in_pool(num_prompt_tokens)
    if problem:
        raise RequestError(problem, "prompt", "invalid_value")
    return _PREFILL_ONLY, params
