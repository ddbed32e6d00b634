from .prompt_logprobs import compute_prompt_logprobs
from .sampler import Sampler, SamplerOutput, SamplingRow

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "compute_prompt_logprobs"]
