"""Engine arguments shared by every command that builds an engine (generate, serve, bench)."""
from __future__ import annotations

import argparse
from typing import Any

from tokenmill.core.config import parse_size


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
    parser.add_argument("--enable-chunked-prefill", dest="enable_chunked_prefill", action="store_true",
                        help="split long prompts across steps (the default; vLLM's flag, accepted)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=_size, default=None, metavar="BYTES",
                        help="the KV pool's size: bytes, or with a unit (512MiB, 2GiB, 1.5GB)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        help="keep every block in sliding-window layers too (one block table for all layers)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true")
    parser.add_argument("--scheduling-policy", dest="policy", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--graph-capture", default=None, metavar="PROGRAM",
                        help="the platform's decode program instead of its default (fused_decode, cuda_graphs, "
                             "torch.compile, xla, none: eager; `tokenmill platforms` lists them)")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|none|FOLDER",
                        help="sampling defaults: auto (the model's generation_config.json), vllm or none "
                             "(no model defaults), or a folder holding a generation_config.json")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks each layer is split over (heads, MLP, vocabulary); docs/distributed.md")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="stages the layers are split into (hidden states passed between them)")
    parser.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                        help="split each mixture-of-experts layer's experts over the tensor-parallel ranks "
                             "(whole experts, E / tp per rank) instead of every expert's intermediate size")
    parser.add_argument("--expert-parallel-exchange", default="auto", choices=["auto", "all_reduce", "all_to_all"],
                        help="with --enable-expert-parallel: all_reduce (each rank runs its experts on every token, "
                             "one all-reduce; auto) or all_to_all (each rank sends its share of the tokens to "
                             "the experts' ranks and gathers the results); docs/distributed.md")
    parser.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray", "uni"],
                        help="how ranks run: mp (one process per rank, this machine; the default for tp/pp > 1), "
                             "ray (one Ray actor per rank: RAY_ADDRESS's cluster, or a local one)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM compatibility; tokenmill never runs a checkpoint's own code")
    parser.add_argument("--structured-outputs-backend", default="auto",
                        help="grammar backend for structured outputs: auto (= xgrammar), xgrammar, guidance "
                             "(llguidance) or a plugin's name")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4}\'')
    parser.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                        help="generate text, or pool hidden states into embeddings (/v1/embeddings, "
                             "LLM.embed); auto: pooling for encoder / sentence-transformers checkpoints")
    parser.add_argument("--pooler-config", default=None, metavar="JSON",
                        help='pooling overrides, as vLLM: \'{"pooling_type": "MEAN", "normalize": true}\' '
                             "(pooling_type CLS, MEAN or LAST)")
    parser.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                        help="native: tokenmill's own model class; transformers: transformers' modeling code on "
                             "tokenmill's paged attention; auto (default): native when registered (tokenmill models)")
    lora = parser.add_argument_group("LoRA adapters (docs/serving.md)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (PEFT format) beside the base model")
    lora.add_argument("--max-loras", type=int, default=1, help="adapters resident on the device at once (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory (default: --max-loras)")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help='adapters served from the start, as name=path or \'{"name": .., "path": ..}\'')
    parser.set_defaults(enable_prefix_caching=True, enable_chunked_prefill=True)


ENGINE_ARG_NAMES = (
    "model", "tokenizer", "device", "dtype", "quantization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "long_prefill_token_threshold", "enable_chunked_prefill", "block_size", "kv_cache_memory",
    "gpu_memory_utilization", "kv_cache_dtype", "num_gpu_blocks_override", "enable_prefix_caching",
    "disable_hybrid_kv_cache_manager",
    "policy", "attention_backend", "enforce_eager", "graph_capture", "num_threads", "seed",
    "generation_config", "structured_outputs_backend", "speculative_config", "tensor_parallel_size",
    "pipeline_parallel_size", "distributed_executor_backend", "enable_expert_parallel", "expert_parallel_exchange",
    "runner", "pooler_config", "model_impl",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules",
)


def _size(text: str) -> int:
    try:
        return parse_size(text, "--kv-cache-memory")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def generation_config_folder(value: str) -> "str | None":
    """The folder of a `--generation-config FOLDER` (None for auto / vllm / none)."""
    return None if value in ("auto", "vllm", "none") else value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {name: getattr(args, name) for name in ENGINE_ARG_NAMES if hasattr(args, name)}
    # The engine knows "auto" and "none"; vLLM's "vllm" means none, and a folder's defaults are
    # applied by the server to each request (the model's own are then off).
    if kwargs.get("generation_config") not in (None, "auto", "none"):
        kwargs["generation_config"] = "none"
    return kwargs
