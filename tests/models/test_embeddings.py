"""Embeddings / pooling models (issue 12, item 1) through the offline API: tokenmill's vectors equal
sentence-transformers' on tiny random checkpoints of each pooling architecture (a BertModel encoder with
CLS and mean pooling, Qwen3 / Llama decoders with last-token and mean pooling), with inputs of different
lengths in one batch and prompts longer than the chunked-prefill budget; the KV blocks all come back."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from embedding_helpers import cosines, reference_vectors, save_embedding_checkpoint

# Checked, not imported: importing sentence-transformers at collection imports triton, and triton
# imported before TRITON_INTERPRET=1 is set breaks the interpreter tests of test_attention_backends.
if importlib.util.find_spec("sentence_transformers") is None:
    pytest.skip("sentence-transformers is not installed", allow_module_level=True)

from tokenmill.attention_backends.interface import AttentionBackend, AttentionConfig  # noqa: E402
from tokenmill.core.errors import RequestError  # noqa: E402
from tokenmill.core.pooling_params import PoolingParams  # noqa: E402
from tokenmill.entrypoints.llm import LLM  # noqa: E402

TEXTS = ["w7 w8 w9", "w10 " * 70, "w11", "w12 w13 " * 20, "w14 w15 w16 w17 w18"]
TOL = 1e-4
ENGINE = dict(dtype="float32", kv_cache_memory=1 << 24, num_threads=1)

# name -> (kind, sentence-transformers pooling mode, what tokenmill should read from its files)
CHECKPOINTS = {"bert_cls": ("bert", "cls", "CLS"), "bert_mean": ("bert", "mean", "MEAN"),
               "qwen3_last": ("qwen3", "lasttoken", "LAST"), "llama_mean": ("llama", "mean", "MEAN")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("embedding-models")
    out = {name: save_embedding_checkpoint(kind, str(root / name), mode, is_matryoshka=(name == "bert_mean"))
           if kind == "bert" else save_embedding_checkpoint(kind, str(root / name), mode)
           for name, (kind, mode, _) in CHECKPOINTS.items()}
    return out


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.scheduler.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vectors_equal_sentence_transformers(checkpoints, name):
    path = checkpoints[name]
    # A 32-token step budget: the decoders' long prompts are computed over several steps (pooled across
    # chunks); the encoder is never chunked (bidirectional), whatever the budget.
    llm = LLM(path, max_num_batched_tokens=32, **ENGINE)
    config = llm.engine.pooler_config
    assert (config.pooling_type, config.normalize, config.source) == (CHECKPOINTS[name][2], True,
                                                                       "sentence-transformers")
    outs = llm.embed(TEXTS, use_tqdm=False)
    want = reference_vectors(path, TEXTS)
    assert [len(o.outputs.embedding) for o in outs] == [64] * len(TEXTS)
    assert min(cosines([o.outputs.embedding for o in outs], want)) >= 1 - TOL
    assert _all_blocks_free(llm)
    # One input alone gives the vector it got in the batch.
    alone = llm.embed(TEXTS[1], use_tqdm=False)[0].outputs.embedding
    assert cosines([alone], torch.tensor([outs[1].outputs.embedding]))[0] >= 1 - 1e-6


def test_decoder_with_lm_head_runner_pooling(checkpoints):
    """A Qwen3ForCausalLM checkpoint (LM head included, no sentence-transformers files): generation by
    default; runner="pooling" gives last-token + normalize (vLLM's default), and pooler_config overrides it."""
    import transformers
    raw = checkpoints["qwen3_last"] + "-hf"
    assert json.load(open(os.path.join(raw, "config.json")))["architectures"] == ["Qwen3ForCausalLM"]
    generating = LLM(raw, **ENGINE)
    assert generating.engine.pooler_config is None
    with pytest.raises(ValueError, match="pooling model"):
        generating.embed(["w7"], use_tqdm=False)
    with pytest.raises(RequestError, match="Embeddings API"):
        generating.engine.add_request("x", "w7 w8", PoolingParams())
    del generating
    model = transformers.AutoModel.from_pretrained(raw, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(raw)
    with torch.no_grad():
        hidden = [model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0] for t in TEXTS]
    last = torch.nn.functional.normalize(torch.stack([h[-1] for h in hidden]), dim=-1)
    mean = torch.stack([h.mean(0) for h in hidden])          # normalize: false
    llm = LLM(raw, runner="pooling", max_num_batched_tokens=32, **ENGINE)
    assert min(cosines([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], last)) >= 1 - TOL
    del llm
    llm = LLM(raw, runner="pooling", pooler_config='{"pooling_type": "MEAN", "normalize": false}', **ENGINE)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert torch.allclose(got, mean, atol=1e-4, rtol=1e-4)      # not normalized: the raw mean itself
    with pytest.raises(ValueError, match="runner"):
        LLM(checkpoints["bert_cls"], runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(raw, runner="pooling", pooler_config='{"pooling_type": "MAX"}', **ENGINE)


def test_matryoshka_dimensions_and_refusals(checkpoints):
    llm = LLM(checkpoints["bert_mean"], **ENGINE)        # config.json: is_matryoshka
    got = llm.embed(TEXTS, PoolingParams(dimensions=16), use_tqdm=False)
    want = reference_vectors(checkpoints["bert_mean"], TEXTS, truncate_dim=16)
    assert [len(o.outputs.embedding) for o in got] == [16] * len(TEXTS)
    assert min(cosines([o.outputs.embedding for o in got], want)) >= 1 - TOL
    assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5 for o in got)   # re-normalized
    with pytest.raises(RequestError) as info:
        llm.embed(["w7"], PoolingParams(dimensions=65), use_tqdm=False)
    assert info.value.param == "dimensions"
    with pytest.raises(RequestError) as info:                # the encoder's 256 positions
        llm.embed(["w7 " * 300], use_tqdm=False)
    assert (info.value.param, info.value.code) == ("prompt", "context_length_exceeded")
    kept = llm.embed(["w7 " * 300], use_tqdm=False, truncate_prompt_tokens=-1)[0]
    assert len(kept.prompt_token_ids) == 256
    with pytest.raises(RequestError, match="does not generate"):
        llm.generate(["w7 w8"], use_tqdm=False)
    assert _all_blocks_free(llm)
    del llm
    plain = LLM(checkpoints["bert_cls"], **ENGINE)
    with pytest.raises(RequestError) as info:
        plain.embed(["w7"], PoolingParams(dimensions=16), use_tqdm=False)
    assert info.value.param == "dimensions" and "matryoshka" in str(info.value)


@pytest.mark.parametrize("name", ["bert_cls", "qwen3_last"])
def test_bf16_close_to_float32(checkpoints, name):
    """bf16 (this CPU's default dtype; for decoders also the platform's fused_decode graph capture,
    which pooling steps bypass) stays within 1e-2 cosine of sentence-transformers' float32."""
    path = checkpoints[name]
    want = reference_vectors(path, TEXTS)
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=1 << 24, num_threads=1)
    assert min(cosines([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], want)) >= 1 - 1e-2


def test_backends_without_non_causal_are_passed_over():
    class CausalOnly(AttentionBackend):
        name = "causal_only"

    config = AttentionConfig(head_size=16, num_heads=4, num_kv_heads=4, dtype=torch.float32, causal=False)
    assert "non-causal (bidirectional) attention not supported" in CausalOnly.validate(config)
    from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
    from tokenmill.attention_backends.reference import ReferenceAttention
    assert CpuSdpaAttention.validate(config) == [] and ReferenceAttention.validate(config) == []


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_sdpa_batched_whole_prompts_match_reference(causal):
    """cpu_sdpa runs back-to-back whole prompts of one length as one SDPA call; with a decode, a
    shorter prompt and a chunk after cached context around them, every row equals the reference."""
    from tokenmill.attention_backends.cpu_sdpa import CpuSdpaAttention
    from tokenmill.attention_backends.interface import build_metadata
    from tokenmill.attention_backends.reference import ReferenceAttention
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    query_lens = [1, 20, 20, 20, 7, 5]
    seq_lens = [9, 20, 20, 20, 7, 30]
    tables, next_block = [], 0
    for n in seq_lens:
        count = -(-n // bs)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    meta = build_metadata(query_lens, seq_lens, tables, bs)
    meta.causal = causal
    t = sum(query_lens)
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    outs = []
    for cls in (CpuSdpaAttention, ReferenceAttention):
        torch.manual_seed(1)
        cache = torch.randn(2, next_block, bs, kv_heads, dim)      # the cached context: the same for both
        outs.append(cls(heads, dim, dim ** -0.5, kv_heads).forward(q, k, v, cache, meta))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_xlm_roberta_encoder_matches_transformers(tmp_path):
    """XLMRobertaModel (positions from padding_idx + 1): runner auto picks pooling, CLS + normalize by
    default; vectors equal transformers' normalized first hidden state, and token_type / position
    offsets are the model's own."""
    import transformers
    from embedding_helpers import BERT_VOCAB
    torch.manual_seed(0)
    config = transformers.XLMRobertaConfig(vocab_size=len(BERT_VOCAB), hidden_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=128, max_position_embeddings=130,
                                           type_vocab_size=1, hidden_act="gelu_new")
    model = transformers.XLMRobertaModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    path = str(tmp_path / "xlmr")
    model.save_pretrained(path)
    with open(os.path.join(path, "vocab.txt"), "w") as fh:
        fh.write("\n".join(BERT_VOCAB) + "\n")
    transformers.BertTokenizerFast(os.path.join(path, "vocab.txt")).save_pretrained(path)
    prompts = [[0, 7, 8, 9, 2], [0] + list(range(10, 130)) + [2]]      # 122 tokens: 2 below max_position_embeddings
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, 0], dim=0)
                            for p in prompts])
    llm = LLM(path, **ENGINE)
    assert llm.engine.max_model_len == 128 and llm.engine.pooler_config.pooling_type == "CLS"
    got = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    assert min(cosines([o.outputs.embedding for o in got], want)) >= 1 - TOL
