"""Tiny random checkpoints with PEFT adapters (random non-zero B), for the LoRA tests."""
from __future__ import annotations

import os

import torch

from model_helpers import hf_greedy, save_tiny_checkpoint  # noqa: F401  (re-exported to the LoRA tests)

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, out_dir: str, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] = ALL_TARGETS, use_rslora: bool = False, **config):
    """A PEFT LoRA adapter for the checkpoint in `base_dir` (A and B random, B non-zero), saved to
    `out_dir`; returns the transformers+peft model for reference outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                      use_rslora=use_rslora, **config)
    model = get_peft_model(base, lora)
    with torch.no_grad():      # deltas about the size of the weights: every adapter changes the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(out_dir)
    return model.eval()


def make_base_and_adapters(root: str, kind: str, count: int, **kwargs):
    """(base dir, transformers base model, [(adapter dir, peft model)])."""
    base_dir = os.path.join(root, "base")
    hf = save_tiny_checkpoint(kind, base_dir)
    adapters = []
    for i in range(count):
        path = os.path.join(root, f"adapter{i}")
        adapters.append((path, make_adapter(base_dir, path, seed=100 + i, **kwargs)))
    return base_dir, hf.eval(), adapters


def check_triton_op(dtype_name: str) -> None:
    """platforms/triton_lora.py against the torch op (core/lora/punica.py) and a per-row reference, for
    batches mixing decodes of several adapters, the base model and prefill chunks (run under
    TRITON_INTERPRET=1, set before triton is imported)."""
    from tokenmill.core.lora.punica import add_lora, build_mapping
    from tokenmill.platforms.triton_lora import add_lora as triton_add_lora
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    slots, rank, k_in, n_out = 3, 24, 40, 56      # none a multiple of the kernels' blocks
    a = torch.randn(slots, k_in, rank, generator=g).to(dtype)     # A^T, B^T per slot (core/lora/layers.py)
    b = torch.randn(slots, rank, n_out, generator=g).to(dtype)
    checked = 0
    for rows in ([(1, 1), (-1, 1), (0, 1), (1, 3), (2, 20), (-1, 5)], [(-1, 2), (2, 7)], [(-1, 4)]):
        num = sum(n for _, n in rows)
        x = torch.randn(num, k_in, generator=g).to(dtype)
        y = torch.randn(num, n_out, generator=g).to(dtype)
        mapping = build_mapping(rows, torch.device("cpu"))
        if mapping is None:          # no adapted row: the layers skip LoRA
            assert all(slot < 0 for slot, _ in rows)
            continue
        want, got = y.clone(), y.clone()
        add_lora(want, x, a, b, mapping)
        triton_add_lora(got, x, a, b, mapping)
        reference, row = y.float().clone(), 0
        for slot, n in rows:
            if slot >= 0:
                reference[row:row + n] += x[row:row + n].float() @ a[slot].float() @ b[slot].float()
            row += n
        tol = 1e-3 if dtype == torch.float32 else 1.0     # bf16 rounding of outputs ~100 in size
        assert torch.allclose(want.float(), reference, atol=tol, rtol=2e-2), (want.float() - reference).abs().max()
        assert torch.allclose(got.float(), reference, atol=tol, rtol=2e-2), (got.float() - reference).abs().max()
        base = [r for r, s in enumerate(s for s, n in rows for _ in range(n)) if s < 0]
        assert torch.equal(got[base], y[base])     # base rows untouched
        checked += 1
    print(f"checked {checked} batches")
