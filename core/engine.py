"""The engine loop: schedule → forward (one flattened batch) → sample → postprocess.

`LLMEngine` is synchronous and single-process; the offline `LLM` drives it directly and the
server runs it in its own process.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from tokenmill.attention_backends.interface import AttentionConfig
from tokenmill.plugins import discovery
from tokenmill.platforms.interface import resolve_dtype

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling.sampler import Sampler, SamplingRow
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger("tokenmill.engine")

PromptType = Union[str, list[int], dict]


def prompt_error(message: str, param: str = "prompt") -> ValueError:
    err = ValueError(message)
    err.param = param  # type: ignore[attr-defined]
    return err


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float           # 0..1
    prefix_cache_queries: int       # tokens, cumulative
    prefix_cache_hits: int          # tokens, cumulative
    num_preemptions: int            # cumulative
    prompt_tokens: int              # cumulative computed prompt tokens
    generation_tokens: int          # cumulative generated tokens


class Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "seqs", "metrics", "finished")

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 seqs: list[Sequence], metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = seqs
        self.metrics = metrics
        self.finished = False


def bind_attention_backend(model: torch.nn.Module, backend_cls: type) -> None:
    """Give every attention layer an instance of the chosen backend."""
    for layer in model.attention_layers:
        old = layer.impl
        layer.impl = backend_cls(old.num_heads, old.head_size, old.scale, old.num_kv_heads,
                                 sliding_window=old.sliding_window, logits_soft_cap=old.logits_soft_cap,
                                 kv_cache_dtype=old.kv_cache_dtype)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.attention_backends.reference import ReferenceAttention
        from tokenmill.core.loaders.loader import load_model

        self.config = config
        self.platform = discovery.resolve_platform(config.device.device)
        self.platform.check_and_update_config(config)
        _check_quantization(config.model.quantization, self.platform)
        self.weight_dtype = resolve_dtype(config.model.dtype, torch.float32)
        self.dtype = self.platform.activation_dtype(self.weight_dtype)
        self.platform.set_seed(config.model.seed)
        start = time.perf_counter()
        bundle = load_model(config.model.model, config.model.tokenizer, dtype=self.dtype,
                            device=self.platform.device(), attn_backend_cls=ReferenceAttention,
                            kv_cache_dtype=config.cache.kv_cache_dtype,
                            extra_architectures=discovery.extra_model_architectures())
        self.bundle = bundle
        self.tokenizer = bundle.tokenizer
        config.finalize(bundle.max_model_len)
        self.max_model_len = config.model.max_model_len
        self.model_name = config.model.served_model_name or _stem(bundle.source.path)

        layer = bundle.model.attention_layers[0].impl
        attn_config = AttentionConfig(
            head_size=layer.head_size, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
            dtype=self.dtype, kv_cache_dtype=config.cache.kv_cache_dtype, block_size=config.cache.block_size,
            sliding_window=layer.sliding_window, logits_soft_cap=layer.logits_soft_cap,
            graph_capture=self.platform.graph_capture(config).name, device=self.platform.dispatch_key)
        backend_cls = discovery.select_attention_backend(self.platform, attn_config, config.device.attention_backend)
        bind_attention_backend(bundle.model, backend_cls)
        self.attention_backend_name = backend_cls.name

        self.platform.prepare_model(bundle.model, config)
        self.runner = ModelRunner(config, self.platform, bundle.model, self.dtype)
        self.num_kv_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(self.num_kv_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.sampler = Sampler()
        self.eos_token_ids = tuple(bundle.eos_token_ids)
        self.vocab_size = int(getattr(bundle.hf_config, "vocab_size", 0) or len(self.tokenizer))
        self.generation_defaults = bundle.generation_defaults if config.model.generation_config == "auto" else {}
        self.requests: dict[str, Request] = {}
        self.seq_to_request: dict[int, Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        capacity = self.num_kv_blocks * config.cache.block_size
        logger.info(
            "model %s (%s) on platform %s, dtype %s, attention backend %s, loaded in %.1fs",
            self.model_name, bundle.architecture, self.platform.name, self.dtype_description,
            self.attention_backend_name, time.perf_counter() - start)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB); maximum concurrency at "
                    "max_model_len=%d: %.2fx", self.num_kv_blocks, config.cache.block_size, capacity,
                    self.num_kv_blocks * self.runner.bytes_per_block / 2**20, self.max_model_len,
                    capacity / self.max_model_len)

    @property
    def dtype_description(self) -> str:
        weights = str(self.weight_dtype).replace("torch.", "")
        text = weights if self.weight_dtype == self.dtype else \
            f"{weights} weights, {str(self.dtype).replace('torch.', '')} activations"
        if self.config.model.quantization:
            text += f", quantization {self.config.model.quantization}"
        kv = self.runner.kv_cache_dtype
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
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise prompt_error("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise prompt_error(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_token_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise prompt_error("prompt_token_ids must be a list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise prompt_error(f"prompt token id {bad[0]} is out of vocabulary (size {self.vocab_size})")
        return list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, priority: int = 0) -> None:
        if request_id in self.requests:
            raise prompt_error(f"request id {request_id!r} is already in use", param="request_id")
        params = params or SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        if not token_ids:
            raise prompt_error("the prompt is empty")
        if len(token_ids) + 1 > self.max_model_len:
            raise prompt_error(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(token_ids)} tokens, leaving no room for any output.")
        needed_blocks = -(-(len(token_ids) + 1) // self.config.cache.block_size)
        if needed_blocks > self.num_kv_blocks:
            raise prompt_error(f"the prompt needs {needed_blocks} KV blocks but the pool has only "
                               f"{self.num_kv_blocks} (raise kv_cache_memory)")
        if self.generation_defaults:
            params = params.with_generation_defaults(self.generation_defaults)
        now = time.time() if arrival_time is None else arrival_time
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, i, token_ids, params, now, priority)
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.platform.device()).manual_seed(params.seed + i)
            if params.detokenize:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            if params.logprobs is not None:
                seq.logprobs = []
                seq.cumulative_logprob = 0.0
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            seqs.append(seq)
        request = Request(request_id, text, token_ids, seqs, RequestMetrics(arrival_time=now))
        self.requests[request_id] = request
        for seq in seqs:
            self.seq_to_request[seq.seq_id] = request
            self.scheduler.add(seq)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
                self.seq_to_request.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len({s.request_id for s in self.scheduler.running}),
            num_waiting=len({s.request_id for s in self.scheduler.waiting}),
            kv_cache_usage=bm.usage, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen with add_request's pool check; never spin silently if it does.
                raise RuntimeError("the scheduler cannot admit any waiting request")
            return []
        now = time.time()
        for seq, n in batch.entries:
            request = self.seq_to_request[seq.seq_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.prompt_tokens_total += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        result = self.runner.execute(batch)

        sampled_tokens: list[int] = []
        sample_out = None
        if result.sampled_seqs:
            rows = [SamplingRow(params=s.params, prompt_token_ids=s.prompt_token_ids,
                                output_token_ids=s.output_token_ids, generator=s.generator,
                                eos_token_ids=() if s.params.ignore_eos else self.eos_token_ids)
                    for s in result.sampled_seqs]
            sample_out = self.sampler(result.logits, rows)
            sampled_tokens = sample_out.token_ids

        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.seq_id in result.prompt_logits:
                self._record_prompt_logprobs(seq, *result.prompt_logits[seq.seq_id])

        touched: dict[str, Request] = {}
        now = time.time()
        for i, seq in enumerate(result.sampled_seqs):
            request = self.seq_to_request[seq.seq_id]
            token = sampled_tokens[i]
            self._append_token(seq, token, sample_out, i)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            touched[request.request_id] = request
        return [self._make_output(r) for r in touched.values()]

    def _append_token(self, seq: Sequence, token: int, sample_out, row: int) -> None:
        params = seq.params
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        if seq.logprobs is not None and sample_out.top_logprobs[row] is not None:
            seq.logprobs.append(sample_out.top_logprobs[row])
            seq.cumulative_logprob += sample_out.sampled_logprobs[row]
        stop_str = seq.detokenizer.append([token]) if seq.detokenizer is not None else None
        num_out = seq.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
            elif token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
        if seq.finish_reason is None and (
                (params.max_tokens is not None and num_out >= params.max_tokens)
                or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        if len(seq.prompt_logprobs) > start + logits.shape[0]:
            return  # recomputed after a preemption: already recorded
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + logits.shape[0]], dtype=torch.long)
        logprobs = torch.log_softmax(logits, dim=-1)
        k = seq.params.prompt_logprobs
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        top_vals, top_ids = (logprobs.topk(k, dim=-1) if k > 0 else (None, None))
        for j, target in enumerate(targets.tolist()):
            if start + 1 + j < len(seq.prompt_logprobs):
                continue
            entry = {target: chosen[j]}
            if k > 0:
                entry.update(zip(top_ids[j].tolist(), top_vals[j].tolist()))
            seq.prompt_logprobs.append(entry)

    def _make_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            finished = seq.finish_reason is not None
            text = seq.detokenizer.output_text(finished=finished, delta=False) if seq.detokenizer else ""
            outputs.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = all(seq.finish_reason is not None for seq in request.seqs)
        if finished:
            request.finished = True
            request.metrics.finished_time = time.time()
            self.requests.pop(request.request_id, None)
            for seq in request.seqs:
                self.seq_to_request.pop(seq.seq_id, None)
        head = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=outputs, finished=finished, metrics=request.metrics,
            prompt_logprobs=list(head.prompt_logprobs) if head.prompt_logprobs is not None else None,
            num_cached_tokens=head.num_cached_tokens)


def _stem(path: str) -> str:
    import os
    base = os.path.basename(str(path).rstrip("/"))
    return base[:-5] if base.endswith(".gguf") else base


def _check_quantization(quantization: Optional[str], platform) -> None:
    """quantization=None keeps checkpoints as loaded (GGUF blocks dequantized); any other name
    must be one the platform applies."""
    if quantization is None:
        return
    offered = platform.quantization_methods()
    if quantization not in offered:
        raise ValueError(f"quantization {quantization!r} is not supported on the {platform.name} platform; "
                         f"supported: {offered or 'none'} (or leave it unset: checkpoints are dequantized at load)")
