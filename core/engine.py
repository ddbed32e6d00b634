"""The engine loop: schedule → forward (one flattened batch) → sample → update_from_output.

`LLMEngine` is synchronous and single-process; the offline `LLM` drives it directly and the
server runs it in its own process (core/engine_process.py). Each `step()` returns one
`RequestDelta` per request that progressed — only what is new — and requests are refused once,
at `add_request`, with a `RequestError` naming the parameter.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

import torch

from tokenmill.plugins import discovery, hooks
from tokenmill.plugins.hookspecs import RequestEvent

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from . import request_checks
from .errors import RequestError
from .loaders.loader import load_model
from .executor import make_executor
from .layers.expert_tokens import counts_by_layer
from .outputs import EngineStats, RequestDelta, RequestMetrics
from .lora.manager import attach_lora, cache_salt, enabled
from .lora.request import LoRARequest
from .pooling_params import PoolingParams, pooling_request
from .reasoning_gate import make_reasoning_parser, reasoning_gate
from .sampling.sampler import Sampler, SamplingRow
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SequenceUpdate
from .sequence import Sequence
from .spec_decode import make_speculator
from .structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from tokenmill.platforms.interface import Platform

logger = logging.getLogger("tokenmill.engine")

PromptType = Union[str, list[int], dict]


class Request:
    """One request in flight: its sequences (n of them) and its timings."""
    __slots__ = ("request_id", "seqs", "metrics", "num_unfinished")

    def __init__(self, request_id: str, seqs: list[Sequence], metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.metrics = metrics
        self.num_unfinished = len(seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform: Platform = discovery.resolve_platform(config.device.device)
        self.platform.check_and_update_config(config)
        self.platform.set_seed(config.model.seed)
        start = time.perf_counter()
        # With tp/pp > 1 the workers build their shards: here only the metadata (tokenizer, config).
        bundle = load_model(config, self.platform, self._choose_backend, build=config.parallel.world_size == 1)
        family_check = getattr(discovery.model_architectures().get(bundle.architecture), "check_engine_config", None)
        if family_check is not None:    # what a family refuses or turns off (hybrid models: core/models/qwen3_next.py)
            family_check(config)
        self.bundle, self.tokenizer = bundle, bundle.tokenizer
        self.weight_dtype, self.dtype = bundle.weight_dtype, bundle.dtype
        self.pooler_config = pooler = bundle.pooler_config     # set: a pooling run (embeddings), no sampling
        config.finalize(bundle.max_model_len, pooler is not None, getattr(bundle.model, "is_causal", True))
        hooks.validate_config(config)      # plugins' checks see the final config (max_model_len known)
        self.max_model_len = config.model.max_model_len
        self.model_name = config.model.served_model_name or _stem(bundle.source.path)
        self.attention_backend_name = bundle.attention_backend.name

        self.lora = attach_lora(config, bundle.model, self.platform, self.dtype)   # slots sized before the KV pool
        self.executor = make_executor(config, self.platform, bundle)    # core/executor.py: in process, mp or ray
        self._expert_tokens: Optional[torch.Tensor] = None     # the last step's cumulative tokens per expert
        self.runner, self.num_kv_blocks = self.executor.runner, self.executor.num_blocks   # runner: None at tp/pp > 1
        margin = config.speculative.num_speculative_tokens if config.speculative.method else 0
        block_manager = BlockManager(self.num_kv_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                     self.executor.kv_layout, window_margin=margin,
                                     state_slots=getattr(self.executor, "state_slots", 0),
                                     state_checkpoints=getattr(self.executor, "state_checkpoints", 0))
        self.eos_token_ids = tuple(bundle.eos_token_ids)
        self.scheduler = Scheduler(config.scheduler, block_manager, self.max_model_len, self.eos_token_ids)
        self.executor.lora = self.scheduler.lora = self.lora   # slots taken at admission; a row mapping per step
        self.sampler = Sampler()
        self.vocab_size = int(getattr(bundle.hf_config, "vocab_size", 0) or len(self.tokenizer))
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                            config.model.structured_outputs_backend)
        self.reasoning_parser = make_reasoning_parser(config.model.reasoning_parser, self.tokenizer)
        self.speculator = make_speculator(
            config, self.max_model_len, self.vocab_size, platform=self.platform, choose_backend=self._choose_backend,
            tokenizer=self.tokenizer, tokenizer_path=config.model.tokenizer or bundle.source.path,
            num_blocks=self.num_kv_blocks, eos_token_ids=self.eos_token_ids)
        if self.speculator is not None:      # a draft model's KV goes with its sequence's blocks
            self.scheduler.on_free = self.speculator.release
        # Requests whose grammar is still compiling: in `requests`, not yet in the scheduler.
        self._awaiting_grammar: dict[str, Future] = {}
        self.generation_defaults = _generation_defaults(config.model.generation_config, bundle.generation_defaults)
        # The one table of requests in flight in this process.
        self.requests: dict[str, Request] = {}
        self._emit = hooks.request_event_emitter()   # None when nothing subscribes: no cost per step
        capacity = self.num_kv_blocks * config.cache.block_size
        logger.info(
            "model %s (%s) on platform %s, dtype %s, attention backend %s, loaded in %.1fs",
            self.model_name, bundle.architecture, self.platform.name, self.dtype_description,
            self.attention_backend_name, time.perf_counter() - start)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB); maximum concurrency at "
                    "max_model_len=%d: %.2fx", self.num_kv_blocks, config.cache.block_size, capacity,
                    self.num_kv_blocks * self.executor.bytes_per_block / 2**20, self.max_model_len,
                    capacity / self.max_model_len)

    def _choose_backend(self, attn_config: Any) -> type:
        return discovery.select_attention_backend(self.platform, attn_config, self.config.device.attention_backend)

    @property
    def dtype_description(self) -> str:
        weights = str(self.weight_dtype).replace("torch.", "")
        text = weights if self.weight_dtype == self.dtype else \
            f"{weights} weights, {str(self.dtype).replace('torch.', '')} activations"
        if self.config.model.quantization:
            text += f", quantization {self.config.model.quantization}"
        kv = self.executor.kv_cache_dtype
        if kv != self.dtype:
            text += f", KV cache {str(kv).replace('torch.', '')}"
        return text

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def max_concurrency(self) -> float:
        return self.num_kv_blocks * self.config.cache.block_size / self.max_model_len

    # ------------------------------------------------------------------ requests
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        return request_checks.prompt_token_ids(prompt, self.tokenizer.encode, self.vocab_size)

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Union[SamplingParams, PoolingParams, None] = None,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    max_tokens_must_fit: bool = False, group_id: Optional[str] = None,
                    lora_request: Union[LoRARequest, str, None] = None) -> None:
        """Queue a request; RequestError (a ValueError naming the parameter) when it cannot run. `max_tokens_must_fit`:
        refuse an explicit max_tokens beyond max_model_len (else: capped); `group_id`: see Sequence.group_id;
        `lora_request`: run on that adapter (a LoRARequest, or the name of a loaded one)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id", "invalid_value")
        lora = None if lora_request is None else enabled(self.lora).resolve(lora_request)
        text, token_ids = self.tokenize_prompt(prompt)
        params, pooling = pooling_request(params, self.pooler_config, len(token_ids), self.max_model_len,
                                          self.scheduler.fits_in_pool)
        if pooling is None:
            request_checks.check_length(len(token_ids), params, self.max_model_len, max_tokens_must_fit,
                                        self.scheduler.fits_in_pool)
        if self.generation_defaults:
            params = params.with_generation_defaults(self.generation_defaults)
        compiled = None
        if params.structured_outputs is not None:   # a cache hit is ready now; else it compiles meanwhile
            compiled = self.structured.submit(params.structured_outputs)
            if compiled.done():
                compiled = compiled.result()        # a refused spec raises here, before anything ran
        now = time.time() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, i, token_ids, params, now, priority, group_id)
            seq.pooling = pooling
            seq.lora_request, seq.cache_salt = lora, cache_salt(lora)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.platform.device()).manual_seed(params.seed + i)
            if params.detokenize:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            if params.logprobs is not None:
                seq.cumulative_logprob = 0.0
            seqs.append(seq)
        request = self.requests[request_id] = Request(request_id, seqs, RequestMetrics(arrival_time=now))
        if isinstance(compiled, Future):
            self._awaiting_grammar[request_id] = compiled
        else:
            self._start(request, compiled)
        self._event("arrived", request)

    def _start(self, request: Request, compiled: Any) -> None:
        """Hand the request's sequences to the scheduler, each with its grammar matcher if constrained."""
        matchers = self.structured.matchers(compiled, len(request.seqs)) if compiled is not None else None
        gate = None
        if matchers is not None and self.reasoning_parser is not None and request.seqs[0].detokenizer is not None:
            gate = reasoning_gate(self.reasoning_parser, self.tokenizer, request.seqs[0].prompt_token_ids)
        for i, seq in enumerate(request.seqs):
            if matchers is not None:
                if gate is None:
                    seq.grammar = matchers[i]
                else:
                    seq.pending_grammar, seq.grammar_gate = matchers[i], gate
            self.scheduler.add(seq)

    def _admit_compiled(self) -> list[RequestDelta]:
        """Start the requests whose grammar is compiled; end those whose grammar was refused. With
        nothing else to run, wait (briefly) for a compile rather than spin."""
        if not self.scheduler.waiting and not self.scheduler.running:
            wait_futures(list(self._awaiting_grammar.values()), timeout=0.05, return_when=FIRST_COMPLETED)
        refused = []
        for request_id, future in list(self._awaiting_grammar.items()):
            if not future.done():
                continue
            del self._awaiting_grammar[request_id]
            request = self.requests[request_id]
            error = future.exception()
            if error is None:
                self._start(request, future.result())
                continue
            del self.requests[request_id]
            request.metrics.finished_time = time.time()
            for seq in request.seqs:
                seq.finish_reason = "abort"
            self._event("aborted", request)
            refused.append(RequestDelta(request_id, [], finished=True, error=error))
        return refused

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Drop requests wherever they are; nothing more is emitted for them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if self._awaiting_grammar.pop(request_id, None) is not None:   # never reached the scheduler
                for seq in request.seqs:
                    seq.finish_reason = "abort"
                request.metrics.finished_time = time.time()
                self._event("aborted", request)
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
            request.metrics.finished_time = time.time()
            self._event("aborted", request)

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Register an adapter by name, as vLLM's engine does; ValueError when it cannot be served."""
        enabled(self.lora).add_adapter(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        return enabled(self.lora).remove_adapter(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.registry.values()) if self.lora is not None else []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            num_running=len(s.running_request_ids),
            num_waiting=len(s.waiting_request_ids) + len(self._awaiting_grammar),
            kv_cache_usage=s.kv_cache_usage, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens, **self.structured.counters(),
            moe_expert_tokens=counts_by_layer(self._expert_tokens),
            **(self.speculator.counters() if self.speculator is not None else {}),
            **(self.lora.counters(self.scheduler.running, self.scheduler.waiting) if self.lora is not None else {}))

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestDelta]:
        refused = self._admit_compiled() if self._awaiting_grammar else []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen with add_request's pool check; never spin silently if it does.
                raise RuntimeError("the scheduler cannot admit any waiting request")
            return refused
        now = time.time()
        for seq in batch.first_scheduled:
            request = self.requests[seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                self._event("scheduled", request)
        if self._emit is not None:
            for seq in batch.preempted:
                self._event("preempted", self.requests[seq.request_id])
        result = self.executor.execute(batch)
        if result.expert_tokens is not None:       # read (one copy) only when the stats are built
            self._expert_tokens = result.expert_tokens
        sampled = None
        if result.sampled:
            eos = self.eos_token_ids
            rows: list[SamplingRow] = []
            for s, num_rows in zip(result.sampled_seqs(batch), result.rows_per_seq()):
                if num_rows > 1:     # verifying drafts: one row per position (core/spec_decode.py)
                    rows.extend(self.speculator.sampling_rows(s, eos))
                    continue
                rows.append(SamplingRow(params=s.params, prompt_token_ids=s.prompt_token_ids,
                                        output_token_ids=s.output_token_ids, generator=s.generator,
                                        eos_token_ids=() if s.params.ignore_eos or s.grammar else eos,
                                        grammar=s.grammar))
            sampled = (self.sampler(result.logits, rows) if result.num_rows is None     # else: drafts verified
                       else self.speculator.sample(self.sampler, result, batch, rows))
        updates = self.scheduler.update_from_output(batch, result, sampled)
        if self.scheduler.verified:
            for num_drafts, num_accepted in self.scheduler.verified:
                self.speculator.record(num_drafts, num_accepted)
            self.scheduler.verified.clear()
        return refused + self._request_deltas(updates)

    def _request_deltas(self, updates: list[SequenceUpdate]) -> list[RequestDelta]:
        """Group the sequences' updates by request; close the requests that finished."""
        deltas: dict[str, RequestDelta] = {}
        now = time.time()
        for update in updates:
            seq = update.seq
            request = self.requests[seq.request_id]
            delta = deltas.get(seq.request_id)
            if delta is None:
                delta = deltas[seq.request_id] = RequestDelta(
                    seq.request_id, [], num_cached_tokens=request.seqs[0].num_cached_tokens)
            if update.prompt_logprobs is not None:
                delta.prompt_logprobs = update.prompt_logprobs
            delta.pooled = update.pooled
            if update.delta is None:
                continue
            delta.outputs.append(update.delta)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self._event("first_token", request)
            metrics.last_token_time = now
            if update.delta.finish_reason is not None:
                request.num_unfinished -= 1
                if request.num_unfinished == 0:
                    delta.finished = True
                    metrics.finished_time = now
                    delta.metrics = metrics
                    del self.requests[request.request_id]
                    self._event("finished", request)
        return list(deltas.values())

    def _event(self, kind: str, request: Request) -> None:
        if self._emit is None:
            return
        head = request.seqs[0]
        self._emit(RequestEvent(kind=kind, request_id=request.request_id, time=time.time(),
                                num_prompt_tokens=head.num_prompt_tokens,
                                num_output_tokens=sum(s.num_output_tokens for s in request.seqs),
                                finish_reason=head.finish_reason))


def _stem(path: str) -> str:
    base = os.path.basename(str(path).rstrip("/"))
    return base[:-5] if base.endswith(".gguf") else base


def _generation_defaults(mode: str, model_defaults: dict) -> dict:
    """Sampling defaults: the model's ("auto"), none ("vllm", "none"), or a folder's generation_config.json."""
    if mode == "auto":
        return model_defaults
    if mode in ("vllm", "none"):
        return {}
    from .loaders.hf import read_generation_config
    return read_generation_config(mode)[0]
