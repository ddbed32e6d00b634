"""Tensor and pipeline parallelism on this CPU machine (gloo, one spawned worker per rank; issue 16
items 1-3): greedy tokens at tp=2 / pp=2 equal tp=1 on tiny random float32 checkpoints, the
default model (9 query heads, 3 KV heads) at tp=3 equals tp=1 and tp=2 is refused naming
tensor_parallel_size, and each rank holds about 1/tp of the weights."""
from __future__ import annotations

import pytest

from model_helpers import save_tiny_checkpoint, tiny_config
from tokenmill.core.distributed import check_parallel_sizes, stage_layers
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.step import EntryInput, StepInputs
from tokenmill.entrypoints.llm import LLM

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [100, 200, 300, 400, 500, 600, 700, 800, 900, 17, 18, 19, 20, 21, 22,
                                          23, 24, 25]]
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 24, num_threads=1, max_model_len=256)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run(model: str, prompts: list[list[int]], max_tokens: int = 8, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, **{**ENGINE, **kwargs})
    try:
        return greedy(llm, prompts, max_tokens), llm
    finally:
        llm.engine.executor.shutdown()


# kv heads: llama 4 q / 2 kv (split), mistral 4 q / 1 kv (one KV head replicated on both ranks)
@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"num_key_value_heads": 1})])
def test_tp2_greedy_tokens_equal_tp1(tmp_path, kind, overrides):
    path = str(tmp_path / kind)
    save_tiny_checkpoint(kind, path, **overrides)
    expected, single = run(path, PROMPTS)
    got, llm = run(path, PROMPTS, tensor_parallel_size=2)
    assert got == expected
    if kind == "llama":        # each rank loaded only its shard: about half of the weights
        total = sum(p.numel() * p.element_size() for p in single.engine.runner.model.parameters())
        per_rank = [r.parameter_bytes for r in llm.engine.executor.readies]
        assert len(per_rank) == 2 and all(b < 0.56 * total for b in per_rank), (per_rank, total)


def test_pp2_greedy_tokens_equal_pp1(tmp_path):
    path = str(tmp_path / "llama")
    # 2 + 1 layers per stage; tied: the last stage loads its own copy of the embedding as its head
    save_tiny_checkpoint("llama", path, num_hidden_layers=3, tie_word_embeddings=True)
    expected, _ = run(path, PROMPTS)
    got, llm = run(path, PROMPTS, pipeline_parallel_size=2)
    assert got == expected
    assert [r.pid for r in llm.engine.executor.readies] and llm.engine.runner is None


def test_default_model_tp3_equals_tp1_and_tp2_is_refused():
    prompts = [[1, 4093, 314, 260, 1345], [30, 2583, 6205, 2567, 339, 11]]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*9 attention heads.*values that work: 1, 3\b"):
        LLM(None, tensor_parallel_size=2)
    expected, _ = run(None, prompts, max_tokens=4)
    got, _ = run(None, prompts, max_tokens=4, tensor_parallel_size=3)
    assert got == expected


def test_sizes_a_model_cannot_split_are_refused():
    config = tiny_config("llama")          # 4 heads, 2 KV heads, intermediate 128, 2 layers
    check_parallel_sizes(config, 4, 2)     # 4 ranks: one KV head on two ranks each
    with pytest.raises(ValueError, match="tensor_parallel_size=3.*values that work: 1, 2, 4"):
        check_parallel_sizes(config, 3, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        check_parallel_sizes(config, 1, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(None, tensor_parallel_size=0)
    assert [stage_layers(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]


def test_micro_batches_keep_decodes_first():
    entries = [EntryInput(i, [i], [0]) for i in range(5)]
    parts = StepInputs(entries, num_decodes=3).split(2)
    assert [len(p.entries) for p in parts] == [2, 3] and [p.num_decodes for p in parts] == [2, 1]
    assert [len(p.entries) for p in StepInputs(entries[:1], 1).split(2)] == [1]

