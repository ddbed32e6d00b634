"""LoRA adapters (issue 14): PEFT adapters through the whole engine give transformers+peft's greedy
tokens; base and adapters mixed in one batch give each request its tokens alone; more adapters than
slots wait and swap; prefix-cache blocks are the adapter's own; the Triton op under its interpreter
equals the torch op; adapters that cannot be served are refused naming why."""
from __future__ import annotations

import json
import os

import pytest
import torch

from lora_helpers import hf_greedy, make_adapter, make_base_and_adapters

from tokenmill import LLM, LoRARequest, SamplingParams

torch.set_num_threads(1)
MAX_TOKENS = 12
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [20, 21, 22], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310,
                                                        311, 312, 313, 314, 315, 316, 317, 318]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


_CHECKPOINTS: dict = {}


def _checkpoint(kind: str, tmp_path_factory):
    """(base dir, adapter dirs, greedy tokens by "base"/"a0".."a2"), built once per architecture."""
    if kind not in _CHECKPOINTS:
        root = str(tmp_path_factory.mktemp(kind))
        base, hf, adapters = make_base_and_adapters(root, kind, 3)
        expected = {"base": hf_greedy(hf, PROMPTS, MAX_TOKENS)}
        for i, (_path, model) in enumerate(adapters):
            expected[f"a{i}"] = hf_greedy(model, PROMPTS, MAX_TOKENS)
        _CHECKPOINTS[kind] = (base, [path for path, _ in adapters], expected)
    return _CHECKPOINTS[kind]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    """Both architectures: for the tests of what the adapters compute."""
    return _checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One architecture: for the tests of slots, caching and refusals."""
    return _checkpoint("llama", tmp_path_factory)


def _llm(base: str, **kwargs) -> LLM:
    return LLM(base, dtype="float32", kv_cache_memory=16 << 20, generation_config="none", enable_lora=True, **kwargs)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _prompts():
    return [{"prompt_token_ids": p} for p in PROMPTS]


def test_each_adapter_matches_peft_and_the_base_matches_transformers(checkpoint):
    base, paths, expected = checkpoint
    llm = _llm(base, max_loras=2)
    assert _tokens(llm.generate(_prompts(), GREEDY, use_tqdm=False)) == expected["base"]
    for i, path in enumerate(paths):
        outs = llm.generate(_prompts(), GREEDY, lora_request=LoRARequest(f"a{i}", i + 1, path), use_tqdm=False)
        assert _tokens(outs) == expected[f"a{i}"], f"adapter {i}"
    assert len({json.dumps(v) for v in expected.values()}) == len(expected)   # every adapter changes the tokens


def test_one_mixed_batch_gives_each_request_its_tokens_alone(checkpoint):
    base, paths, expected = checkpoint
    llm = _llm(base, max_loras=3, max_num_batched_tokens=24)    # chunked prefills ride with decodes
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    prompts, requests, want = [], [], []
    for j, prompt in enumerate(PROMPTS):
        for k, lora in enumerate(loras):
            prompts.append({"prompt_token_ids": prompt})
            requests.append(lora)
            want.append(expected["base" if lora is None else f"a{k - 1}"][j])
    assert _tokens(llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)) == want
    stats = llm.engine.stats()
    assert stats.lora_swaps == 3 and stats.lora_evictions == 0 and stats.max_loras == 3


def test_more_adapters_than_slots_wait_and_swap(llama):
    base, paths, expected = llama
    llm = _llm(base, max_loras=1, max_cpu_loras=2)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    requests = [loras[i % 3] for i in range(9)]
    prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(9)]
    outs = llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)
    assert _tokens(outs) == [expected[f"a{i % 3}"][i % 3] for i in range(9)]
    stats = llm.engine.stats()
    assert stats.lora_swaps >= 3 and stats.lora_evictions >= 2     # one slot: every other adapter swapped in
    assert stats.lora_running == {} and stats.lora_waiting == {}
    assert len(llm.engine.lora.cpu_cache) <= 2


def test_chat_takes_lora_request_too(llama):
    base, paths, _ = llama
    llm = _llm(base)
    lora = LoRARequest("a0", 1, paths[0])
    conversation = [{"role": "user", "content": "w10 w11 w12"}]
    ids = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    chat = llm.chat(conversation, GREEDY, lora_request=lora, use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": ids}], GREEDY, lora_request=[lora], use_tqdm=False)
    base_out = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert _tokens(chat) == _tokens(plain) != _tokens(base_out)


def test_prefix_cache_blocks_are_the_adapters_own(llama):
    base, paths, expected = llama
    llm = _llm(base, max_loras=2, block_size=4)
    a0, a1 = LoRARequest("a0", 1, paths[0]), LoRARequest("a1", 2, paths[1])
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    engine = llm.engine

    def cached(lora) -> int:
        before = engine.stats().prefix_cache_hits
        outs = llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)
        assert _tokens(outs)[0] == expected["base" if lora is None else lora.lora_name][2]
        return engine.stats().prefix_cache_hits - before

    assert cached(a0) == 0
    assert cached(a0) == 16          # the same adapter reuses its blocks (all but the last token's)
    assert cached(a1) == 0           # another adapter computes its own K/V
    assert cached(None) == 0         # and so does the base model
    assert cached(None) == 16


def test_engine_refuses_what_it_cannot_serve(llama, tmp_path):
    base, paths, _ = llama
    llm = _llm(base, max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
        llm.generate(_prompts(), GREEDY, lora_request=LoRARequest("a0", 1, paths[0]), use_tqdm=False)
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(_prompts(), GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "nowhere")),
                     use_tqdm=False)
    plain = LLM(base, dtype="float32", kv_cache_memory=16 << 20, generation_config="none")
    with pytest.raises(ValueError, match="not enabled"):
        plain.generate(_prompts(), GREEDY, lora_request=LoRARequest("a0", 1, paths[0]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not plain.engine.has_unfinished_requests()


def _edit_config(src: str, dst: str, **changes) -> str:
    import shutil
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_bad_adapters_are_refused_naming_the_problem(llama, tmp_path):
    from tokenmill.core.lora.adapter import LoRAAdapterError
    base, paths, _ = llama
    llm = _llm(base)
    cases = [
        (_edit_config(paths[0], str(tmp_path / "mts"), modules_to_save=["lm_head"]), "modules_to_save",
         "modules_to_save"),
        (_edit_config(paths[0], str(tmp_path / "fc1"), target_modules=["q_proj", "fc1"]), "fc1", "target_modules"),
        (_edit_config(paths[0], str(tmp_path / "dora"), use_dora=True), "DoRA", "use_dora"),
    ]
    for path, needle, param in cases:
        with pytest.raises(LoRAAdapterError, match=needle) as info:
            llm.engine.add_lora(LoRARequest(os.path.basename(path), 5, path))
        assert info.value.param == param
    assert llm.engine.list_loras() == []


def test_rslora_and_partial_targets_match_peft(tmp_path):
    base, hf, _ = make_base_and_adapters(str(tmp_path), "llama", 0)
    path = str(tmp_path / "rs")
    model = make_adapter(base, path, seed=7, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                         use_rslora=True)
    llm = _llm(base, max_lora_rank=8)
    outs = llm.generate(_prompts(), GREEDY, lora_request=LoRARequest("rs", 1, path), use_tqdm=False)
    assert _tokens(outs) == hf_greedy(model, PROMPTS, MAX_TOKENS)


def test_lora_request_import_paths():
    import tokenmill
    from tokenmill.core.lora.request import LoRARequest as core_cls
    assert LoRARequest is core_cls is tokenmill.LoRARequest
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")


def test_triton_op_under_the_interpreter_equals_the_torch_op():
    """In a fresh interpreter: peft imports triton, and TRITON_INTERPRET must be set before that."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys; sys.path.insert(0, {tests!r}); from lora_helpers import check_triton_op; "
            "check_triton_op('float32'); check_triton_op('bfloat16')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("checked 2 batches") == 2, done.stdout + done.stderr
