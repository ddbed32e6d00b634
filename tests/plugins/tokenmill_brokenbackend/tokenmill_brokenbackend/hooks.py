"""pluggy hook implementations for tokenmill's `tokenmill.plugins` entry-point group."""
from tokenmill.plugins.hookspecs import hookimpl


@hookimpl
def tokenmill_attention_backends():
    return {"broken_lastblock": "tokenmill_brokenbackend.backend:DropLastBlockAttention"}
