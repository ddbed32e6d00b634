"""Write the default model (SmolLM2-135M-Instruct: its GGUF dequantized to float32) as an HF
checkpoint, float or in a quantized on-disk format, for `docs/bench/perplexity.py --model DIR`.

    python docs/bench/quantize_checkpoint.py --format float --out /tmp/smollm2-f32
    python docs/bench/quantize_checkpoint.py --format awq --group-size 64 --out /tmp/smollm2-awq
    python docs/bench/quantize_checkpoint.py --format gptq --group-size 64 --out /tmp/smollm2-gptq
    python docs/bench/quantize_checkpoint.py --format ct:W4A16 --group-size 64 --out /tmp/smollm2-w4a16
    python docs/bench/quantize_checkpoint.py --format ct:W8A8 --out /tmp/smollm2-w8a8
    python docs/bench/quantize_checkpoint.py --format ct:FP8_DYNAMIC --out /tmp/smollm2-fp8

Round-to-nearest, no calibration (AWQ's activation-aware scaling and GPTQ's error feedback are
the quantizers' business, not the loader's): the numbers price each format's storage grid.
The packers are the tests' (tests/quant_format_writers.py: numpy AWQ/GPTQ packers written from
the formats' documentation; compressed-tensors' own compressors for ct:<preset>). SmolLM2's
hidden size 576 takes group sizes 32 and 64, not 128.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

from quant_format_writers import awq_tensors, ct_writer, gptq_tensors, quantize_state, save_checkpoint  # noqa: E402


def float_checkpoint() -> tuple[dict, object, object]:
    """(HF state dict in float32, HF config, tokenizer) of the default model."""
    from tokenmill.core.loaders import gguf_loader
    from tokenmill.core.loaders.gguf_file import GGUFFile
    from tokenmill.core.loaders.model_source import default_model_path
    from tokenmill.quantization.gguf import GGUFQuantization

    from transformers import AutoConfig

    gguf = GGUFFile(default_model_path())
    config = gguf_loader.gguf_config(gguf)
    # The architecture's own config class, so config.json names its model_type.
    config = AutoConfig.for_model(config.model_type, **{k: v for k, v in config.to_dict().items() if k != "model_type"})
    dequantize = GGUFQuantization().load_tensor
    state = {name: dequantize(t).float().contiguous() for name, t in gguf_loader.iterate_gguf_weights(gguf, config)}
    return state, config, gguf_loader.gguf_tokenizer(gguf)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", required=True, help="float, awq, gptq or ct:<compressed-tensors preset>")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    state, config, tokenizer = float_checkpoint()
    g = args.group_size
    if args.format == "float":
        quantization_config = None
    elif args.format == "awq":
        quantization_config = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"}
        state = quantize_state(state, config.num_hidden_layers, lambda name, w: awq_tensors(w.numpy(), g))[0]
    elif args.format == "gptq":
        quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": False,
                               "checkpoint_format": "gptq"}
        state = quantize_state(state, config.num_hidden_layers,
                               lambda name, w: gptq_tensors(w.numpy(), g, sym=False, v2=False))[0]
    elif args.format.startswith("ct:"):
        quantize, quantization_config, _ = ct_writer(args.format[3:], g)
        state = quantize_state(state, config.num_hidden_layers, quantize)[0]
    else:
        raise SystemExit(f"unknown --format {args.format!r}")
    save_checkpoint(args.out, state, config, quantization_config, tokenizer)
    print(f"wrote {args.out} ({sum(t.numel() * t.element_size() for t in state.values()) / 1e6:.1f} MB of tensors)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
