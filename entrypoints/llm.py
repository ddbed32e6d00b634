"""The offline API: `LLM(...).generate(prompts, sampling_params)`, `.chat(conversations, ...)` and, for a
pooling model (`LLM(model, runner="pooling")` or a checkpoint detected as one), `.embed(texts)`."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from tokenmill.core.config import EngineConfig
from tokenmill.core.engine import LLMEngine, PromptType
from tokenmill.core.lora.request import LoRARequest
from tokenmill.core.outputs import EmbeddingOutput, EmbeddingRequestOutput, OutputAccumulator, RequestOutput
from tokenmill.core.pooling_params import PoolingParams
from tokenmill.core.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """Offline batch inference. Keyword arguments are engine arguments (see core/config.py)."""

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (benchmarks that must not reuse an earlier run's)."""
        self.engine.reset_prefix_cache()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[list[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts`; one SamplingParams for all or one per prompt; one
        LoRARequest for all (LLM(..., enable_lora=True)) or one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        return self._run(prompts, params_list, use_tqdm, priority, loras)

    def chat(self, messages: Union[Conversation, list[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: Optional[str] = None,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            token_ids = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                chat_template=chat_template, **template_kwargs)
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):  # transformers 5 returns a BatchEncoding
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]],
              pooling_params: Optional[PoolingParams] = None, use_tqdm: bool = True,
              truncate_prompt_tokens: Optional[int] = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text, token ids or a prompt dict), in order, each `.outputs.embedding`.
        All prompts run together through the scheduler (continuous batching, as generate). A prompt
        longer than max_model_len is a ValueError unless `truncate_prompt_tokens` keeps its last k
        tokens (-1: max_model_len of them)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine = self.engine
        if engine.pooler_config is None:
            raise ValueError("LLM.embed needs a pooling model: LLM(model, runner='pooling')")
        keep = engine.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if keep is not None and not 1 <= keep <= engine.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or in 1..{engine.max_model_len}, got {keep}")
        params = pooling_params or PoolingParams()
        order: dict[str, int] = {}
        token_lists: list[list[int]] = []
        results: list[Optional[EmbeddingRequestOutput]] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Embedded prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            for i, prompt in enumerate(prompts):
                _, token_ids = engine.tokenize_prompt(prompt)
                token_ids = token_ids[-keep:] if keep else token_ids
                request_id = f"embd-{next(self._ids)}"
                engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
                order[request_id] = i
                token_lists.append(token_ids)
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    i = order.get(delta.request_id)
                    if i is not None and delta.finished and delta.pooled is not None:
                        results[i] = EmbeddingRequestOutput(delta.request_id, token_lists[i],
                                                            EmbeddingOutput(delta.pooled))
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool,
             priority: Optional[list[int]], loras: Optional[list[Optional[LoRARequest]]] = None) -> list[RequestOutput]:
        engine = self.engine
        order: dict[str, int] = {}
        accumulators: dict[str, OutputAccumulator] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = f"llm-{next(self._ids)}"
                # Tokenized here once, so the output can report the prompt the engine ran.
                text, token_ids = engine.tokenize_prompt(prompt)
                engine.add_request(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params,
                                   priority=priority[i] if priority else 0, lora_request=loras[i] if loras else None)
                order[request_id] = i
                params = params or SamplingParams()
                accumulators[request_id] = OutputAccumulator(
                    request_id, text, token_ids, params.n, want_logprobs=params.logprobs is not None,
                    want_prompt_logprobs=params.prompt_logprobs is not None)
        except Exception:
            engine.abort_request(list(order))
            raise
        results: list[Optional[RequestOutput]] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.error is not None:   # refused after acceptance (its grammar did not compile)
                        raise delta.error
                    accumulator = accumulators.get(delta.request_id)
                    if accumulator is None:
                        continue
                    output = accumulator.add(delta)
                    if delta.finished:
                        results[order[delta.request_id]] = output
                        del accumulators[delta.request_id]
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

