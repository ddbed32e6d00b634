"""What the engine hands back: per-request outputs with text, tokens, logprobs and timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One generated position's logprobs: token id -> logprob, the sampled token always included.
LogprobsEntry = dict[int, float]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> Optional[float]:
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[LogprobsEntry]] = None
    finish_reason: Optional[str] = None     # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None    # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[LogprobsEntry]]] = None
    num_cached_tokens: int = 0
