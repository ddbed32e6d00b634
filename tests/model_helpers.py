"""Shared test helpers: a single-sequence AttentionMetadata with its KV caches, a decode batch
over shuffled (optionally shared-prefix) blocks, tiny random-weight HF checkpoints, and
`load_for_test` (load_model on a platform that changes nothing). Test modules import it as
`model_helpers`: pyproject's pytest `pythonpath` puts tests/ on the import path."""
from __future__ import annotations

import random
from typing import Optional

import torch

from tokenmill.attention_backends.interface import AttentionConfig, AttentionMetadata
from tokenmill.platforms.interface import Platform


class ReferencePlatform(Platform):
    """The CPU with nothing swapped in: activations in the weight dtype, no kernels, no
    quantization methods; what the token-exact comparisons with transformers run on."""
    name = "reference-test"


def load_for_test(model, dtype: str = "float32", platform=None, backend: Optional[type] = None,
                  seen: Optional[list] = None, **kwargs):
    """load_model(config, platform, choose_backend) as the engine calls it, for model-level tests.
    The backend defaults to the reference one; `seen` collects the AttentionConfigs it was asked for."""
    from tokenmill.attention_backends.reference import ReferenceAttention
    from tokenmill.core.config import EngineConfig
    from tokenmill.core.loaders.loader import load_model

    config = EngineConfig.from_kwargs(model=None if model is None else str(model), dtype=dtype, **kwargs)
    platform = platform or ReferencePlatform()
    platform.check_and_update_config(config)

    def choose(attn_config: AttentionConfig) -> type:
        if seen is not None:
            seen.append(attn_config)
        return backend or ReferenceAttention

    return load_model(config, platform, choose)


def single_sequence_metadata(num_tokens: int, block_size: int = 16, start_pos: int = 0) -> AttentionMetadata:
    """Metadata for one sequence whose tokens start_pos..start_pos+num_tokens-1 are all scheduled
    (a prefill when start_pos == 0). Blocks are 0, 1, 2, ... so slot == position."""
    seq_len = start_pos + num_tokens
    num_blocks = (seq_len + block_size - 1) // block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        slot_mapping=torch.arange(start_pos, seq_len, dtype=torch.int64),
        num_decodes=1 if num_tokens == 1 and start_pos > 0 else 0,
        max_query_len=num_tokens,
        max_seq_len=seq_len,
        block_size=block_size,
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[seq_len],
    )


def allocate_kv_caches(model, num_blocks: int, block_size: int = 16,
                       dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """Give every attention layer of `model` its own zeroed KV cache; returns them."""
    caches = []
    for layer in model.attention_layers:
        spec = getattr(layer, "kv_spec", None)          # a layer's own geometry (MLA's latent rows)
        shape = spec.cache_shape(num_blocks, block_size) if spec is not None else \
            type(layer.impl).kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_size)
        cache = torch.zeros(shape, dtype=dtype or next(model.parameters()).dtype)
        layer.kv_cache = cache
        caches.append(cache)
    return caches


@torch.no_grad()
def run_prompt(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Run token_ids through `model` as one prefill; float32 logits [len(token_ids), vocab]."""
    n = len(token_ids)
    allocate_kv_caches(model, (n + block_size - 1) // block_size + 1, block_size)
    meta = single_sequence_metadata(n, block_size)
    hidden = model(torch.tensor(token_ids, dtype=torch.long), torch.arange(n, dtype=torch.long), meta)
    return model.compute_logits(hidden)


TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)


def tiny_config(kind: str, **overrides):
    """A small random-weight config of one architecture: llama, llama3 (rope scaling), mistral,
    qwen2, qwen3."""
    import transformers
    dims = dict(TINY_DIMS)
    if kind == "llama3":
        dims["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        dims["rope_theta"] = 500000.0
        kind_cls = transformers.LlamaConfig
    else:
        kind_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[kind]
    if kind == "qwen3":
        dims["head_dim"] = 16
    dims.update(overrides)
    return kind_cls(**dims)


def save_tiny_checkpoint(kind: str, directory: str, seed: int = 0, max_shard_size: Optional[str] = None,
                         **overrides):
    """Build a random-weight transformers model of `kind`, save it (safetensors) to `directory`;
    returns the float32 transformers model for reference outputs."""
    import transformers
    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so their loading is tested.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    tiny_tokenizer(config.vocab_size).save_pretrained(directory)
    return model


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer(vocab_size: int = 1000):
    """A word-level tokenizer over vocab_size ids (w0, w1, ...), with </s> = 2 and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=specials[3:],
                                   chat_template=CHAT_TEMPLATE)


def hf_last_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (interleaves each head's rotary halves)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(hf_model, path: str, arch: str) -> None:
    """Write an HF model as a float32 GGUF the way llama.cpp's converter lays it out
    (names, Q/K permutation for llama, no output.weight when tied). Metadata only covers
    the network, not a tokenizer."""
    import gguf
    cfg = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    if cfg.rope_parameters.get("rope_type", "default") == "llama3":
        # llama.cpp stores llama3 scaling as per-frequency divisors of the default frequencies
        base = cfg.rope_parameters["rope_theta"]
        default = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        writer.add_tensor("rope_freqs.weight", (default / hf_model.model.rotary_emb.inv_freq).float().numpy())
    for name, tensor in hf_model.state_dict().items():
        tensor = tensor.float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                tensor = _llama_cpp_permute(tensor, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                tensor = _llama_cpp_permute(tensor, cfg.num_key_value_heads)
        writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def decode_batch(lens: list[int], shared_blocks: int = 0, bs: int = 16, num_blocks: int = 200,
                 seed: int = 0) -> tuple[list[list[int]], AttentionMetadata]:
    """One decode token per sequence of these lengths; block tables drawn from shuffled blocks,
    the first `shared_blocks` of every table the same physical blocks (a cached shared prefix)."""
    rng = random.Random(seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    shared, rest = blocks[:shared_blocks], blocks[shared_blocks:]
    tables = [shared + [rest.pop() for _ in range((n + bs - 1) // bs - shared_blocks)] for n in lens]
    width = max(map(len, tables))
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), num_decodes=len(lens), max_query_len=1, max_seq_len=max(lens),
        block_size=bs, query_start_loc_cpu=list(range(len(lens) + 1)), seq_lens_cpu=list(lens))
    return tables, meta


# Greedy agreement with transformers on random-weight checkpoints it writes itself.
def save_random_checkpoint(model_type: str, config_kwargs: dict, directory: str, vocab_size: int = 1000,
                           seed: int = 0):
    """A random-weight transformers model of `model_type` saved with a tokenizer; the float32 model."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():             # away from init's near-constant outputs, so tokens tell layers apart
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory)
    tiny_tokenizer(vocab_size).save_pretrained(directory)
    return model


def hf_greedy(model, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    return out


def generate(llm, prompts: list[list[int]], max_tokens: int = 10):
    from tokenmill.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_greedy_twice(llm, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Greedy tokens equal `expected` (chunked prefills of mixed-length prompts batched with decodes),
    and again on a second pass whose full prompt blocks come from the prefix cache."""
    first = generate(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    second = generate(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert second[0].num_cached_tokens >= 32


def assert_logits_match(hf_model, path, prompt: list[int]) -> None:
    """The last position's float32 logits of one prompt, tokenmill's against transformers'."""
    model = load_for_test(path).model
    torch.testing.assert_close(run_prompt(model, prompt), hf_last_logits(hf_model, prompt), atol=2e-4, rtol=2e-4)


def save_moe_checkpoint(model_type: str, config_kwargs: dict, directory, seed: int = 0, vocab_size: int = 1000,
                        correction_bias_scale: float = 0.0, router: str = "mlp.gate.weight"):
    """A random-weight transformers mixture-of-experts model saved with a tokenizer; the float32
    model. The routers' weights (parameters named ...`router`) are scaled up so each token's experts
    are picked by clear margins (not float noise); a correction bias (DeepSeek V3, GLM-4.5) random at
    `correction_bias_scale`, so it changes which experts win."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * 0.05)
            if name.endswith(router):
                param.mul_(20.0)
        for name, buffer in model.named_buffers():
            if correction_bias_scale and name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * correction_bias_scale)
    model.save_pretrained(str(directory))
    tiny_tokenizer(vocab_size).save_pretrained(str(directory))
    return model


def assert_server_greedy(path, prompts: list[list[int]], expected: list[list[int]], max_tokens: int = 10) -> None:
    """`tokenmill serve PATH` (float32) through the official openai SDK: greedy completions of the
    token-id prompts equal `expected`."""
    import openai

    from tokenmill.entrypoints.openai.testing import ServerProcess
    args = [str(path), "--device", "cpu", "--dtype", "float32", "--served-model-name", "m", "--num-threads", "1",
            "--kv-cache-memory", str(16 << 20), "--generation-config", "none", "--disable-access-log"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for prompt, want in zip(prompts, expected):
            out = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            assert [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens] == want


def make_llm(path, **kwargs):
    from tokenmill.entrypoints.llm import LLM
    args = dict(model=str(path), dtype="float32", device="cpu", num_threads=1, block_size=16,
                max_num_batched_tokens=32, kv_cache_memory=16 << 20, generation_config="none")
    args.update(kwargs)
    return LLM(**args)


def fused_and_eager_decode(llm, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states of one decode step after `prompt`, through the fused step and eagerly,
    from the same KV cache state."""
    from tokenmill.attention_backends.interface import build_metadata

    runner = llm.engine.runner
    assert hasattr(runner.forward, "fused_step"), "the engine did not take the fused decode path"
    n = len(prompt) + 1
    blocks = list(range((n + runner.block_size - 1) // runner.block_size))
    with torch.inference_mode():
        prefill = build_metadata([n - 1], [n - 1], [blocks], runner.block_size)
        runner.forward(torch.tensor(prompt), torch.arange(n - 1), prefill)     # eager: a prefill
        decode = build_metadata([1], [n], [blocks], runner.block_size, num_decodes=1)
        ids, pos = torch.tensor([prompt[-1]]), torch.tensor([n - 1])
        fused_out = runner.forward(ids, pos, decode)
        eager_out = runner._forward_eager(ids, pos, decode)
    return fused_out.float(), eager_out.float()
