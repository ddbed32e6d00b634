"""The general plugin: pluggy hook implementations (entry-point group `tokenmill.plugins`)."""
from __future__ import annotations

from tokenmill.plugins.hookspecs import hookimpl


@hookimpl
def tokenmill_attention_backends():
    from .attention import TestPagedAttention
    return {"testcpu_paged": TestPagedAttention}


@hookimpl
def tokenmill_model_architectures():
    from .model import TestLlamaForCausalLM
    return {"TestLlamaForCausalLM": TestLlamaForCausalLM}
