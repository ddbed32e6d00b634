"""What a general plugin (entry-point group `tokenmill.plugins`) may contribute, as pluggy hookspecs.

A plugin is a module, a class or an instance with functions marked `@hookimpl` named like the
specs below; it implements only the hooks it needs. Every hook returns a dict name -> object;
a value may also be a "module:Attr" string, imported lazily.

    from tokenmill.plugins.hookspecs import hookimpl

    @hookimpl
    def tokenmill_attention_backends():
        return {"my_paged": "my_pkg.attention:MyPagedAttention"}
"""
from __future__ import annotations

import pluggy

PROJECT = "tokenmill"
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class TokenmillHookSpecs:
    @hookspec
    def tokenmill_model_architectures(self) -> dict:
        """HF `architectures` name -> model class (e.g. a subclass of tokenmill's LlamaForCausalLM)."""

    @hookspec
    def tokenmill_attention_backends(self) -> dict:
        """Backend name -> AttentionBackend subclass. Joins selection and the attention matrix."""

    @hookspec
    def tokenmill_quantization_methods(self) -> dict:
        """Quantization method name -> method class/object."""

    @hookspec
    def tokenmill_tool_parsers(self) -> dict:
        """Tool-call parser name -> parser class."""

    @hookspec
    def tokenmill_reasoning_parsers(self) -> dict:
        """Reasoning parser name -> parser class."""


HOOK_NAMES = [name for name in vars(TokenmillHookSpecs) if name.startswith("tokenmill_")]
