"""Structured outputs in the engine: the grammar backend, bound lazily, and one matcher per sequence.

add_request compiles the request's constraint (cached by the backend, so repeats are free) and
gives each of its sequences a matcher; the sampler masks those rows' logits with the matchers'
bitmasks (sampling/structured.py) and the scheduler advances them with each sampled token and
finishes a sequence once its grammar is terminated. Compilation is synchronous, in add_request.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from tokenmill.plugins import discovery

from .errors import RequestError
from .sampling_params import StructuredOutputsParams

logger = logging.getLogger("tokenmill.structured_outputs")

DEFAULT_BACKEND = "xgrammar"


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 backend: str = DEFAULT_BACKEND) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend_name = backend
        self._backend: Optional[Any] = None

    @property
    def backend(self) -> Any:
        if self._backend is None:
            backends = discovery.grammar_backends()
            cls = backends.get(self.backend_name)
            if cls is None:
                raise RequestError(
                    f"structured outputs need the grammar backend {self.backend_name!r}, which is not "
                    f"available (installed: {', '.join(sorted(backends)) or 'none'})",
                    "structured_outputs", "invalid_value")
            self._backend = cls(self.tokenizer, self.vocab_size, self.stop_token_ids)
            logger.info("grammar backend: %s", self.backend_name)
        return self._backend

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[Any]:
        """n fresh matchers for the constraint; RequestError (param structured_outputs) if it is bad."""
        kind = params.kind
        backend = self.backend
        if backend.supported_kinds and kind not in backend.supported_kinds:
            raise RequestError(f"the grammar backend {self.backend_name!r} does not support {kind!r}",
                               "structured_outputs", "invalid_value")
        compiled = backend.compile(kind, params.spec)
        return [compiled.new_matcher() for _ in range(n)]
