"""Structured outputs in the engine: the grammar backend, bound lazily, and one matcher per sequence.

add_request compiles the request's constraint (cached by the backend, so repeats are free) and
gives each of its sequences a matcher; the sampler masks those rows' logits with the matchers'
bitmasks (sampling/structured.py) and the scheduler advances them with each sampled token and
finishes a sequence once its grammar is terminated. Compilation is synchronous, in add_request.

The backend is `structured_outputs_backend` (ModelConfig; `--structured-outputs-backend`): a name in
the `tokenmill.grammar_backends` entry-point group -- built in: `xgrammar` and `guidance`
(llguidance) -- or `auto`, which is xgrammar (guidance where xgrammar is not installed). There is no
per-request fallback: a constraint the chosen backend refuses is a 400. Counters for the metrics:
`num_constrained_requests` and `grammar_compile_seconds` (cumulative, cache hits included).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from tokenmill.plugins import discovery

from .errors import RequestError
from .sampling_params import StructuredOutputsParams

logger = logging.getLogger("tokenmill.structured_outputs")

DEFAULT_BACKEND = "xgrammar"
AUTO_ORDER = ("xgrammar", "guidance")    # what "auto" means: the first of these installed


def resolve_backend_name(name: str) -> str:
    """The backend `name` stands for ("auto" resolved); ValueError naming structured_outputs_backend
    and the installed backends when no such backend is installed."""
    if name == "auto":
        installed = discovery.grammar_backends()
        return next((n for n in AUTO_ORDER if n in installed), DEFAULT_BACKEND)
    installed = discovery.grammar_backends()
    if name not in installed:
        raise ValueError(f"structured_outputs_backend must be 'auto' or an installed grammar backend "
                         f"({', '.join(sorted(installed)) or 'none installed'}); got {name!r}")
    return name


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 backend: str = DEFAULT_BACKEND) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend_name = resolve_backend_name(backend)
        self._backend: Optional[Any] = None
        self.num_constrained_requests = 0
        self.grammar_compile_seconds = 0.0

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

    def counters(self) -> dict[str, Any]:
        """The EngineStats fields structured outputs keep."""
        return {"num_constrained_requests": self.num_constrained_requests,
                "grammar_compile_seconds": self.grammar_compile_seconds}

    def matchers(self, params: StructuredOutputsParams, n: int) -> list[Any]:
        """n fresh matchers for the constraint; RequestError (param structured_outputs) if it is bad."""
        kind = params.kind
        backend = self.backend
        if backend.supported_kinds and kind not in backend.supported_kinds:
            raise RequestError(f"the grammar backend {self.backend_name!r} does not support {kind!r}",
                               "structured_outputs", "invalid_value")
        start = time.perf_counter()
        try:
            compiled = backend.compile(kind, params.spec)
        finally:
            self.grammar_compile_seconds += time.perf_counter() - start
        self.num_constrained_requests += 1
        return [compiled.new_matcher() for _ in range(n)]
