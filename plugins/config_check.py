"""tokenmill's own config validator (hook `tokenmill_validate_config`): combinations of settings
that are each valid alone but cannot work together. Single-field checks stay in EngineConfig."""
from __future__ import annotations

import logging
from typing import Any

from .hookspecs import hookimpl

logger = logging.getLogger("tokenmill.plugins")


class ConfigSanity:
    @hookimpl
    def tokenmill_validate_config(self, config: Any) -> list[str]:
        problems = []
        cache, sched = config.cache, config.scheduler
        max_len = config.model.max_model_len       # None until the model's context length is known
        budget = sched.max_num_batched_tokens
        if (not sched.enable_chunked_prefill and max_len is not None and budget is not None
                and budget < max_len):
            # Without chunking a prompt is scheduled whole: longer than the budget, it never runs.
            problems.append(f"max_num_batched_tokens={budget} is below max_model_len={max_len} with "
                            f"chunked prefill disabled, so long prompts could never be scheduled")
        if cache.num_gpu_blocks_override is not None and cache.kv_cache_memory is not None:
            problems.append("num_gpu_blocks_override and kv_cache_memory both size the KV cache; give one")
        if cache.enable_prefix_caching and max_len is not None and cache.block_size > max_len:
            # Harmless, but it can never hit: only full blocks are shared.
            logger.warning("prefix caching can never hit: block_size %d exceeds max_model_len %d",
                           cache.block_size, max_len)
        return problems
