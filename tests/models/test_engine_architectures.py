"""Every registered architecture, through the whole engine: greedy tokens identical to transformers
float32 for 8 prompts of mixed lengths × 32 tokens in one batch; and every CPU-runnable attention
backend (Triton under its interpreter included) gives the same tokens."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from model_helpers import save_tiny_checkpoint

from tokenmill import LLM, SamplingParams

LENGTHS = [3, 17, 9, 33, 1, 24, 40, 12]
MAX_TOKENS = 32


def _prompts(vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_greedy(model, prompts):
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama3", {}),
    ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
])
def test_greedy_matches_transformers(kind, overrides, tmp_path):
    hf = save_tiny_checkpoint(kind, str(tmp_path), **overrides)
    prompts = _prompts()
    expected = _hf_greedy(hf, prompts)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, generation_config="none")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def _backends():
    names = ["reference", "cpu_sdpa"]
    if importlib.util.find_spec("triton") is not None:
        names.append("triton_paged")
    return names


_RUN = """
import json, sys
from tokenmill import LLM, SamplingParams
path, backend, prompts, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, dtype="float32", kv_cache_memory=16 << 20, attention_backend=backend,
          max_num_batched_tokens=32, generation_config="none")   # small budget: chunks mix with decodes
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
print(json.dumps({"backend": llm.engine.attention_backend_name, "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


@pytest.mark.parametrize("backend", _backends())
def test_every_cpu_backend_gives_the_same_greedy_tokens(backend, tmp_path):
    # A fresh interpreter per backend: Triton reads TRITON_INTERPRET when it is first imported.
    import json
    import subprocess

    hf = save_tiny_checkpoint("llama", str(tmp_path))
    prompts = _prompts()[:4]
    expected = _hf_greedy(hf, prompts)
    env = dict(os.environ, TRITON_INTERPRET="1" if backend == "triton_paged" else "0")
    proc = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path), backend, json.dumps(prompts), str(MAX_TOKENS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"] == backend
    assert result["tokens"] == expected
