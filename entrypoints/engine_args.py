"""Engine arguments shared by every command that builds an engine (generate, serve, bench)."""
from __future__ import annotations

import argparse
from typing import Any


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct)")
    else:
        parser.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--device", default="auto", help="platform name, or auto (default)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None,
                        help="run-time weight quantization the platform offers (cpu: int4 — 4-bit groups "
                             "of 32, the Q4_0/Q4_1 layout); default: weights as loaded")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool (CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true")
    parser.add_argument("--scheduling-policy", dest="policy", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--graph-capture", default=None, help="override the platform's graph-capture strategy")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generation-config", default="auto", choices=["auto", "none"])
    parser.add_argument("--structured-outputs-backend", default="auto",
                        help="grammar backend for structured outputs: auto (= xgrammar), xgrammar, guidance "
                             "(llguidance) or a plugin's name")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4}\'')
    parser.set_defaults(enable_prefix_caching=True, enable_chunked_prefill=True)


ENGINE_ARG_NAMES = (
    "model", "tokenizer", "device", "dtype", "quantization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "long_prefill_token_threshold", "enable_chunked_prefill", "block_size", "kv_cache_memory",
    "gpu_memory_utilization", "kv_cache_dtype", "num_gpu_blocks_override", "enable_prefix_caching",
    "policy", "attention_backend", "enforce_eager", "graph_capture", "num_threads", "seed",
    "generation_config", "structured_outputs_backend", "speculative_config",
)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES if hasattr(args, name)}
