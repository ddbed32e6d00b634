"""What the engine hands back.

Each step the engine emits one `RequestDelta` per request that progressed: only what is new
(token ids, text, logprobs, finish reason), so the cost per step is proportional to the
tokens produced, never to the length of the output so far. Consumers that want the whole
output (the offline `LLM`) fold the deltas with `OutputAccumulator` into a `RequestOutput`;
the server streams them as they come.
"""
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


@dataclass
class EngineStats:
    """The engine's load and counters, as `LLMEngine.stats()` reports them (and the server's metrics read)."""
    num_running: int = 0                # requests
    num_waiting: int = 0                # requests
    kv_cache_usage: float = 0.0           # 0..1
    prefix_cache_queries: int = 0       # tokens, cumulative
    prefix_cache_hits: int = 0          # tokens, cumulative
    num_preemptions: int = 0            # cumulative
    prompt_tokens: int = 0              # cumulative computed prompt tokens
    generation_tokens: int = 0          # cumulative generated tokens
    num_constrained_requests: int = 0   # cumulative requests with structured outputs
    grammar_compile_seconds: float = 0.0  # cumulative time compiling their grammars
    # Speculative decoding (cumulative): verifications, draft tokens proposed / accepted, and per
    # draft position how often it was accepted (acceptance rate at j = that / spec_num_drafts).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list = field(default_factory=list)
    # LoRA (core/lora/manager.py): requests running / waiting per adapter name, adapters loaded
    # into a device slot (cumulative swaps) and of those, ones that replaced another; the slot count.
    lora_running: dict = field(default_factory=dict)
    lora_waiting: dict = field(default_factory=dict)
    lora_swaps: int = 0
    lora_evictions: int = 0
    max_loras: int = 0
    # Mixture-of-experts models (cumulative): {decoder layer index: tokens routed to each expert}, the
    # router's top-k picks (a token counts once per expert it picked), for the layers that saw tokens.
    moe_expert_tokens: dict = field(default_factory=dict)


@dataclass
class CompletionDelta:
    """What one sequence (choice `index`) produced in one step."""
    index: int
    token_ids: list[int]                               # new token ids
    text: str                                          # new text (a possible partial stop string held back)
    logprobs: Optional[list[LogprobsEntry]] = None     # new entries, one per new token (when requested)
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None                # set on the sequence's last delta
    stop_reason: Optional[object] = None


@dataclass
class RequestDelta:
    """One request's progress in one step: the only message the engine emits."""
    request_id: str
    outputs: list[CompletionDelta]                     # the choices that progressed this step
    finished: bool = False                             # every choice has finished
    num_cached_tokens: int = 0                         # prompt tokens found in the prefix cache
    prompt_logprobs: Optional[list[Optional[LogprobsEntry]]] = None   # new prompt positions (when requested)
    metrics: Optional[RequestMetrics] = None           # on the finishing delta
    # A request refused after add_request accepted it (its grammar failed to compile): it ends
    # here, finished, with no outputs; the error is what add_request would have raised.
    error: Optional[Exception] = None
    pooled: Optional[list[float]] = None               # a pooling request's vector, on its finishing delta


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One input's result from `LLM.embed` (vLLM's shape: `.outputs.embedding`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class OutputAccumulator:
    """Folds a request's deltas into the cumulative `RequestOutput` (vLLM's offline shape)."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], n: int,
                 want_logprobs: bool = False, want_prompt_logprobs: bool = False) -> None:
        self.output = RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
            outputs=[CompletionOutput(index=i, text="", token_ids=[],
                                      logprobs=[] if want_logprobs else None) for i in range(n)],
            finished=False, metrics=RequestMetrics(arrival_time=0.0),
            prompt_logprobs=[] if want_prompt_logprobs else None)   # the first delta brings the leading None
        self._texts: list[list[str]] = [[] for _ in range(n)]

    def add(self, delta: RequestDelta) -> RequestOutput:
        out = self.output
        for d in delta.outputs:
            choice = out.outputs[d.index]
            choice.token_ids.extend(d.token_ids)
            if d.text:
                self._texts[d.index].append(d.text)
            if d.logprobs is not None and choice.logprobs is not None:
                choice.logprobs.extend(d.logprobs)
            choice.cumulative_logprob = d.cumulative_logprob
            if d.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
        if delta.prompt_logprobs and out.prompt_logprobs is not None:
            out.prompt_logprobs.extend(delta.prompt_logprobs)
        out.num_cached_tokens = delta.num_cached_tokens
        if delta.metrics is not None:
            out.metrics = delta.metrics
        out.finished = delta.finished
        if delta.finished:
            for i, choice in enumerate(out.outputs):
                choice.text = "".join(self._texts[i])
        return out
