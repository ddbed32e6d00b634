"""docs/plugins.md is enough to write a plugin: its `# file:` code blocks are written into a
package, installed, and used -- section 1 alone (one platform class, one entry-point line)
serves the default model with the same greedy tokens as --device cpu; the whole page adds an
attention backend, a quantization method, parsers, a model architecture and hooks that all load
and work."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
BLOCK = re.compile(r"^```(?:python|toml)\n# file: (\S+)( \(append\))?\n(.*?)^```", re.S | re.M)


def write_package(root: Path, text: str) -> Path:
    for path, append, body in BLOCK.findall(text):
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if append:
            assert target.exists(), f"{path} appended to before it was written"
            target.write_text(target.read_text() + "\n" + body)
        else:
            target.write_text(body)
    return root


@pytest.fixture(scope="module")
def docs_text() -> str:
    return DOC.read_text()


@pytest.fixture(scope="module")
def one_class_platform(tmp_path_factory, docs_text, pip_install) -> Path:
    """Section 1 only, installed into its own directory."""
    section1 = docs_text[:docs_text.index("\n## 2.")]
    src = write_package(tmp_path_factory.mktemp("src1"), section1)
    assert sorted(p.name for p in src.rglob("*") if p.is_file()) == ["__init__.py", "platform.py", "pyproject.toml"]
    target = tmp_path_factory.mktemp("site1")
    pip_install([src], target)
    return target


@pytest.fixture(scope="module")
def whole_page(tmp_path_factory, docs_text, pip_install) -> Path:
    src = write_package(tmp_path_factory.mktemp("src"), docs_text)
    target = tmp_path_factory.mktemp("site")
    pip_install([src], target)
    return target


GENERATE = """
import json
from tokenmill import LLM, SamplingParams
kw = dict(dtype="float32", max_model_len=256, kv_cache_memory=32 << 20, max_num_seqs=4, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = ["The capital of France is", "def fibonacci(n):"]
out = {}
for device in ("cpu", "myaccel"):
    llm = LLM(device=device, **kw)
    out[device] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    out[device + "_backend"] = llm.engine.attention_backend_name
    del llm
print("RESULT " + json.dumps(out))
"""


def test_one_class_platform_serves_like_cpu(one_class_platform, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(one_class_platform))
    done = subprocess.run([sys.executable, "-c", GENERATE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert result["myaccel"] == result["cpu"] and all(len(t) == 8 for t in result["cpu"])
    assert result["myaccel_backend"] == "reference"
    listed = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "plugins", "--json",
                             "--kind", "platform"], capture_output=True, text=True, timeout=120)
    row = next(r for r in json.loads(listed.stdout) if r["name"] == "myaccel")
    assert row["state"] == "loaded" and row["package"] == "tokenmill-myaccel"
    assert row["detail"] == "available: 1 x MyAccel"


def test_docs_attention_backend_matrix_and_selection(whole_page, use_plugin_dir):
    use_plugin_dir(whole_page)
    from tokenmill.attention_backends.interface import AttentionConfig
    from tokenmill.entrypoints.attention_grid import build_grid, run_matrix
    from tokenmill.plugins import discovery
    from tokenmill_myaccel.platform import MyAccelPlatform

    backend = discovery.attention_backend_classes()["myaccel_paged"]
    results = run_matrix({"myaccel_paged": backend}, build_grid("quick", "cpu"), device="cpu", dispatch_key="myaccel")
    assert not [r for r in results if r.status == "fail"] and any(r.status == "pass" for r in results)

    class Preferring(MyAccelPlatform):
        def attention_backends(self):
            return ["myaccel_paged", "reference"]

    config = AttentionConfig(head_size=64, num_heads=4, num_kv_heads=2, dtype=torch.float32, device="myaccel")
    assert discovery.select_attention_backend(Preferring(), config) is backend
    assert discovery.select_attention_backend(discovery.resolve_platform("myaccel"), config).name == "reference"


def test_docs_quantization_parsers_model_and_hooks(whole_page, use_plugin_dir):
    use_plugin_dir(whole_page)
    from tokenmill.core.config import EngineConfig
    from tokenmill.core.models.llama import LlamaForCausalLM
    from tokenmill.plugins import discovery, hooks
    from tokenmill.plugins.hookspecs import RequestEvent

    method = discovery.quantization_methods()["myint8"]()
    layer = torch.nn.Module()
    layer.weight_loader = lambda param, loaded, shard_id=None: param.data.copy_(loaded)
    method.create_weights(layer, 32, [8, 8], True, torch.float32)
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(16, 32, generator=g), torch.randn(16, generator=g), torch.randn(3, 32, generator=g)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.int8
    # Per-channel int8: each weight within half a step (max|w| / 254) of its value.
    bound = (x.abs() @ (w.abs().amax(dim=1, keepdim=True) / 254).expand_as(w).T)
    err = (method.apply(layer, x, layer.bias) - torch.nn.functional.linear(x, w, b)).abs()
    assert (err <= bound + 1e-5).all() and err.max() > 0

    tools = discovery.tool_parsers()["brackets"](None).extract_tool_calls('ok [[weather {"city": "Paris"}]]')
    assert tools.content == "ok" and tools.tool_calls[0].name == "weather"
    assert json.loads(tools.tool_calls[0].arguments) == {"city": "Paris"}
    assert discovery.reasoning_parsers()["think"](None).extract_reasoning("<think>a</think>b") == ("a", "b")
    assert issubclass(discovery.model_architectures()["MyLlamaForCausalLM"], LlamaForCausalLM)

    class Tokenizer:      # a five-token vocabulary: enough to walk the choice matcher
        vocab = ["y", "es", "no", "n", "o"]

        def __len__(self):
            return len(self.vocab) + 1          # + the stop token

        def decode(self, ids):
            return "".join(self.vocab[i] if i < len(self.vocab) else "" for i in ids)

    backend = discovery.grammar_backends()["choices"](Tokenizer(), 6, [5])
    matcher = backend.compiled("choice", json.dumps(["yes", "no"])).new_matcher()
    assert backend.compiled("choice", json.dumps(["yes", "no"])) is backend.cached("choice", json.dumps(["yes", "no"]))
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    assert [t for t in range(6) if int(bitmask[0, 0]) >> t & 1] == [0, 2, 3]     # y, no, n
    assert matcher.accept_token(0)
    matcher.fill_bitmask(bitmask, 0)
    assert [t for t in range(6) if int(bitmask[0, 0]) >> t & 1] == [1]           # es
    assert matcher.accept_token(1) and not matcher.is_terminated()
    matcher.fill_bitmask(bitmask, 0)
    assert [t for t in range(6) if int(bitmask[0, 0]) >> t & 1] == [5]           # the stop token
    assert matcher.accept_token(5) and matcher.is_terminated()
    with pytest.raises(ValueError, match="non-empty choice"):
        backend.compiled("regex", "a+")

    report = next(r for r in hooks.hook_reports() if r.name == "myaccel")
    assert report.loaded and report.detail == "hooks: tokenmill_request_event, tokenmill_validate_config"
    with pytest.raises(ValueError, match="MyAccel blocks hold 16 tokens"):
        hooks.validate_config(EngineConfig.from_kwargs(block_size=32))
    hooks.request_event_emitter()(RequestEvent("finished", "r9", num_output_tokens=3, finish_reason="stop"))
    from tokenmill_myaccel.hooks import FINISHED
    assert FINISHED == [("r9", 3)]
    kinds = {r.kind for r in discovery.extension_reports() if r.package == "tokenmill-myaccel" and r.loaded}
    assert kinds == {"platform", "attention_backend", "quantization_method", "tool_parser", "reasoning_parser",
                     "grammar_backend", "model_architecture", "hook"}


def test_one_class_platform_serves_over_http(one_class_platform):
    """`tokenmill serve --device myaccel` with only the docs' one class installed: the OpenAI
    route answers with the greedy tokens `--device cpu` gives."""
    import httpx

    from tokenmill.entrypoints.openai.testing import ServerProcess

    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    args = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(32 << 20), "--max-num-seqs", "4"]
    texts = {}
    for device in ("myaccel", "cpu"):
        with ServerProcess(args + ["--device", device], env={"PYTHONPATH": str(one_class_platform)}) as server:
            reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            texts[device] = (choice["text"], choice["logprobs"]["tokens"])
    assert texts["myaccel"] == texts["cpu"] and len(texts["cpu"][1]) == 8
