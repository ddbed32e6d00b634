"""Token sampling: the batched Sampler and prompt logprobs."""
from .sampler import Sampler, SamplerOutput, SamplingRow, compute_prompt_logprobs

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "compute_prompt_logprobs"]
