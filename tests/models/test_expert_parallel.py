"""Expert parallelism (`enable_expert_parallel`, core/layers/moe_parallel.py) and the per-expert token
counts (core/layers/expert_tokens.py, `tokenmill:moe_expert_tokens_total`): one MoE layer split over
two gloo ranks equals one rank through both exchanges, with uneven expert ranges and fewer tokens than
ranks; each rank loads only its own whole experts; Qwen3-MoE and Mixtral (5 experts: 3 + 2) at
tensor_parallel_size=2 with expert parallelism give transformers' float32 greedy tokens and one rank's
counts; the counts add up to tokens x top_k per MoE layer, offline and in a server's /metrics; what
cannot apply is ignored with a log line or refused naming the parameter."""
from __future__ import annotations

import logging
import multiprocessing
import urllib.request

import pytest
import torch

from model_helpers import generate, hf_greedy, load_for_test, make_llm, save_moe_checkpoint

from tokenmill.core import distributed
from tokenmill.core.layers.moe import FusedMoE
from tokenmill.core.layers.moe_parallel import expert_range

VOCAB = 1000
DIMS = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            num_experts_per_tok=2)
FAMILIES = {
    # MoE layers 1 and 3 (decoder_sparse_step), 8 experts: 4 per rank.
    "qwen3_moe": dict(DIMS, num_experts=8, moe_intermediate_size=32, head_dim=16, decoder_sparse_step=2,
                      norm_topk_prob=True),
    # Every layer sparse, 5 experts: rank 0 holds 3, rank 1 holds 2.
    "mixtral": dict(DIMS, num_local_experts=5),
}
MOE_LAYERS = {"qwen3_moe": ["1", "3"], "mixtral": ["0", "1", "2", "3"]}
PROMPTS = [[3 + (i * 37 + j * 11) % (VOCAB - 3) for j in range(n)] for i, n in enumerate((45, 11))]


def expert_tensors(hf, layer: int, family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' experts of `layer` as FusedMoE stacks them: w13 [E, 2I, H], w2 [E, H, I]."""
    mlp = hf.model.layers[layer].mlp
    experts = mlp.experts
    if hasattr(experts, "gate_up_proj"):              # transformers' fused experts
        return experts.gate_up_proj.detach(), experts.down_proj.detach()
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    w13 = torch.stack([torch.cat([getattr(e, names[0]).weight, getattr(e, names[1]).weight]) for e in experts])
    return w13.detach(), torch.stack([getattr(e, names[2]).weight for e in experts]).detach()


# ---------------------------------------------------------------------- one layer over two gloo ranks
def _layer(num_experts: int) -> FusedMoE:
    """A FusedMoE of `num_experts` random experts (the same on every rank), its router random too."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(num_experts, 32, 16, generator=g) * 0.3, torch.randn(num_experts, 16, 16, generator=g) * 0.3
    layer = FusedMoE(16, 16, num_experts, 2, torch.float32, renormalize=True)
    layer.gate.weight.data.copy_(torch.randn(num_experts, 16, generator=g))
    for e in range(num_experts):
        layer.weight_loader(layer.w13, w13[e, :16], (e, "gate"))
        layer.weight_loader(layer.w13, w13[e, 16:], (e, "up"))
        layer.weight_loader(layer.w2, w2[e], (e, "down"))
    return layer


def _hidden(tokens: int) -> torch.Tensor:
    return torch.randn(tokens, 16, generator=torch.Generator().manual_seed(tokens))


TOKEN_COUNTS = (1, 3, 40)          # 1 token: a rank with none of the tokens to dispatch


def _rank_main(rank: int, port: int, exchange: str, num_experts: int, queue) -> None:
    torch.set_num_threads(1)
    try:
        distributed.init_parallel_state(rank, 2, 1, "gloo", f"tcp://127.0.0.1:{port}", expert_parallel=True,
                                        expert_exchange=exchange)
        layer = _layer(num_experts)
        queue.put((rank, tuple(layer.w13.shape), [layer(_hidden(t)) for t in TOKEN_COUNTS]))
    except BaseException as exc:         # reported, not hung on
        queue.put((rank, None, repr(exc)))
    finally:
        distributed.destroy_parallel_state()


@pytest.mark.parametrize("exchange", ["all_reduce", "all_to_all"])
def test_one_layer_over_two_ranks_equals_one_rank(exchange):
    """5 experts (3 + 2): both exchanges give one rank's routed sums, each rank holding its experts only."""
    expected = [_layer(5)(_hidden(t)) for t in TOKEN_COUNTS]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    port = distributed.free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, exchange, 5, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((rank, (shape, outs)) for rank, shape, outs in (queue.get(timeout=60) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        shape, outs = results[rank]
        assert shape is not None, outs
        assert shape == (3 if rank == 0 else 2, 32, 16)
        for got, want in zip(outs, expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
def test_weight_loader_keeps_this_ranks_whole_experts(monkeypatch, rank):
    """Per-expert tensors and transformers' fused [E, 2I, H] / [E, H, I] fill the same local stacks."""
    monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(tp_rank=rank, tp_size=2,
                                                                         expert_parallel=True))
    assert [expert_range(5, r, 2) for r in (0, 1)] == [(0, 3), (3, 5)]
    assert [expert_range(8, r, 3) for r in (0, 1, 2)] == [(0, 3), (3, 6), (6, 8)]
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(5, 12, 8, generator=g), torch.randn(5, 8, 6, generator=g)
    per_expert, fused = FusedMoE(8, 6, 5, 2, torch.float32), FusedMoE(8, 6, 5, 2, torch.float32)
    for e in range(5):
        per_expert.weight_loader(per_expert.w13, w13[e, :6], (e, "gate"))
        per_expert.weight_loader(per_expert.w13, w13[e, 6:], (e, "up"))
        per_expert.weight_loader(per_expert.w2, w2[e], (e, "down"))
    fused.weight_loader(fused.w13, w13)
    fused.weight_loader(fused.w2, w2)
    mine = slice(*expert_range(5, rank, 2))
    for layer in (per_expert, fused):
        assert torch.equal(layer.w13, w13[mine]) and torch.equal(layer.w2, w2[mine])
    with pytest.raises(ValueError, match="tensor_parallel_size=8"):
        monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(tp_size=8, expert_parallel=True))
        FusedMoE(8, 6, 5, 2, torch.float32)


# ---------------------------------------------------------------------- whole models
def _counts_check(stats, family: str, tokens: int) -> dict:
    """Every MoE layer counted tokens x top_k picks, no other layer counted."""
    counts = stats.moe_expert_tokens
    assert sorted(counts, key=int) == MOE_LAYERS[family]
    assert all(sum(row) == tokens * DIMS["num_experts_per_tok"] for row in counts.values()), counts
    return counts


@pytest.mark.parametrize("family,exchange", [("qwen3_moe", "all_reduce"), ("qwen3_moe", "all_to_all"),
                                             ("mixtral", "all_to_all")])
def test_tp2_expert_parallel_matches_one_rank_and_transformers(tmp_path, monkeypatch, family, exchange):
    hf = save_moe_checkpoint(family, FAMILIES[family], tmp_path)
    expected = hf_greedy(hf, PROMPTS)
    single = make_llm(tmp_path)
    assert [list(o.outputs[0].token_ids) for o in generate(single, PROMPTS)] == expected
    tokens = sum(len(p) + 10 - 1 for p in PROMPTS)           # the last sampled token is never fed back
    one_rank = _counts_check(single.engine.stats(), family, tokens)
    llm = make_llm(tmp_path, tensor_parallel_size=2, enable_expert_parallel=True, expert_parallel_exchange=exchange)
    try:
        assert [list(o.outputs[0].token_ids) for o in generate(llm, PROMPTS)] == expected
        assert _counts_check(llm.engine.stats(), family, tokens) == one_rank      # the same picks, counted once
        per_rank = [r.parameter_bytes for r in llm.engine.executor.readies]
    finally:
        llm.engine.executor.shutdown()
    # Each rank holds only its whole experts (and half of the attention, as tensor parallelism does).
    num_experts = FAMILIES[family].get("num_experts") or FAMILIES[family]["num_local_experts"]
    total_experts = sum(w.numel() * 4 for layer in map(int, MOE_LAYERS[family])
                        for w in expert_tensors(hf, layer, family))
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "_STATE", distributed.ParallelState(tp_rank=rank, tp_size=2,
                                                                             expert_parallel=True))
        shard = load_for_test(tmp_path, tensor_parallel_size=2, enable_expert_parallel=True).model
        assert sum(p.numel() * p.element_size() for p in shard.parameters()) == per_rank[rank]
        start, end = expert_range(num_experts, rank, 2)
        held = 0
        for layer in map(int, MOE_LAYERS[family]):
            moe = shard.model.layers[layer].mlp
            w13, w2 = expert_tensors(hf, layer, family)
            assert torch.equal(moe.w13, w13[start:end]) and torch.equal(moe.w2, w2[start:end])
            held += (moe.w13.numel() + moe.w2.numel()) * 4
        assert held * num_experts == total_experts * (end - start)


def test_pipeline_stages_counts_add_up(tmp_path):
    """pp=2: Qwen3-MoE's MoE layers 1 and 3 on different stages; both stages' counts reach the engine."""
    save_moe_checkpoint("qwen3_moe", FAMILIES["qwen3_moe"], tmp_path)
    generate(single := make_llm(tmp_path), PROMPTS)
    llm = make_llm(tmp_path, pipeline_parallel_size=2)
    try:
        generate(llm, PROMPTS)
        tokens = sum(len(p) + 10 - 1 for p in PROMPTS)
        assert _counts_check(llm.engine.stats(), "qwen3_moe", tokens) == single.engine.stats().moe_expert_tokens
    finally:
        llm.engine.executor.shutdown()


def test_metric_in_a_servers_metrics(tmp_path):
    """`tokenmill:moe_expert_tokens_total{layer, expert}`: a 12-token prompt and 6 new tokens are
    17 forwarded tokens, 2 picks each, in each of Qwen3-MoE's 2 MoE layers."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from tokenmill.entrypoints.openai.testing import ServerProcess
    save_moe_checkpoint("qwen3_moe", FAMILIES["qwen3_moe"], tmp_path)
    args = [str(tmp_path), "--device", "cpu", "--dtype", "float32", "--served-model-name", "m", "--num-threads", "1",
            "--kv-cache-memory", str(16 << 20), "--generation-config", "none", "--disable-access-log"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        client.completions.create(model="m", prompt=list(range(5, 17)), max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
        samples: dict[tuple[str, str], float] = {}
        for _ in range(50):                     # the step's stats may trail the response by a moment
            text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
            samples = {(s.labels["layer"], s.labels["expert"]): s.value
                       for family in text_string_to_metric_families(text) for s in family.samples
                       if s.name == "tokenmill:moe_expert_tokens_total" and s.labels["model_name"] == "m"}
            if sum(samples.values()) >= 2 * 17 * 2:
                break
    assert {layer for layer, _ in samples} == {"1", "3"} and len(samples) == 2 * 8
    for layer in ("1", "3"):
        assert sum(v for (lay, _), v in samples.items() if lay == layer) == 17 * 2


def test_what_cannot_apply_is_ignored_or_refused(tmp_path, caplog):
    import transformers

    from tokenmill.core.config import EngineConfig
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.engine_args import engine_kwargs
    save_moe_checkpoint("qwen3_moe", FAMILIES["qwen3_moe"], tmp_path / "moe")
    with caplog.at_level(logging.INFO, logger="tokenmill.distributed"):
        llm = make_llm(tmp_path / "moe", enable_expert_parallel=True)     # one rank: nothing to split
    assert not llm.engine.config.parallel.enable_expert_parallel
    assert "enable_expert_parallel: ignored with tensor_parallel_size=1" in caplog.text
    dense = EngineConfig.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True).parallel
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill.distributed"):
        distributed.settle_expert_parallel(dense, transformers.LlamaConfig())
    assert not dense.enable_expert_parallel and "has no mixture-of-experts layers" in caplog.text
    with pytest.raises(ValueError, match="expert_parallel_exchange must be one of auto, all_reduce, all_to_all"):
        EngineConfig.from_kwargs(expert_parallel_exchange="alltoall")
    hf_config = llm.engine.bundle.hf_config
    distributed.check_parallel_sizes(hf_config, 4, 1, expert_parallel=True)      # 8 experts: 2 per rank
    hf_config.num_experts = 2                     # fewer experts than ranks
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split this model: 2 experts cannot give "
                                         r"each of 4 ranks one \(enable_expert_parallel\); .*values that work: 1, 2$"):
        distributed.check_parallel_sizes(hf_config, 4, 1, expert_parallel=True)
    with pytest.raises(ValueError, match="quantization 'int8' is not supported with tensor_parallel_size"):
        make_llm(tmp_path / "moe", tensor_parallel_size=2, enable_expert_parallel=True, quantization="int8")
    # -dp with expert parallelism: each replica's engine gets the flags (its own EP group over its tp ranks).
    args = build_parser().parse_args(["serve", str(tmp_path / "moe"), "-dp", "2", "-tp", "2",
                                      "--enable-expert-parallel", "--expert-parallel-exchange", "all_to_all"])
    kwargs = engine_kwargs(args)
    assert (args.data_parallel_size, kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"],
            kwargs["expert_parallel_exchange"]) == (2, 2, True, "all_to_all")


def test_replicas_counts_add_up_and_survive_an_engine_restart():
    """-dp: the replicas' counts summed expert by expert; a restarted engine's zeros do not lower the counter."""
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.metrics import ServerMetrics
    from tokenmill.entrypoints.openai.replica_set import ReplicaSet
    replicas = ReplicaSet({}, 2)
    replicas.replicas = [SimpleNamespace(is_alive=True), SimpleNamespace(is_alive=True)]
    replicas._stats_from(0, {"moe_expert_tokens": {"1": [3, 0, 1], "3": [2, 2, 0]}})
    replicas._stats_from(1, {"moe_expert_tokens": {"1": [1, 1, 0], "3": [0, 2, 0]}})
    assert replicas.stats["moe_expert_tokens"] == {"1": [4, 1, 1], "3": [2, 4, 0]}
    metrics = ServerMetrics("m")

    def sample(layer: str, expert: int) -> float:
        metrics.render()
        return metrics.registry.get_sample_value("tokenmill:moe_expert_tokens_total",
                                                 {"model_name": "m", "layer": layer, "expert": str(expert)})
    metrics.update_stats(replicas.stats)
    assert [sample("1", e) for e in range(3)] == [4, 1, 1]
    metrics.engine_gone()
    metrics.update_stats({"moe_expert_tokens": {"1": [1, 0, 0]}})
    assert [sample("1", e) for e in range(3)] == [5, 1, 1] and sample("3", 1) == 4
