"""Structured outputs in the engine: the grammar backend, bound lazily, and one matcher per sequence.

add_request hands the request's constraint to `submit`: a constraint in the backend's compile cache
(keyed by kind and spec) is ready at once; any other compiles on a worker thread, and the request
waits (the engine keeps it out of the scheduler) while the other requests go on stepping (the
built-in backends compile in native code, so a typical schema is ready within a step or two).
A spec the backend refuses ends
its request with the backend's RequestError (the server's 400: nothing was streamed yet); what no
backend may accept -- a schema whose `$ref` points outside it (nothing is fetched) -- is refused
here, before compiling, whichever backend it is (`check_schemas`). Once
compiled, each sequence of the request gets a matcher; the sampler masks those rows' logits with
the matchers' bitmasks (sampling/structured.py) and the scheduler advances them with each sampled
token and finishes a sequence once its grammar is terminated.

The backend is `structured_outputs_backend` (ModelConfig; `--structured-outputs-backend`): a name in
the `tokenmill.grammar_backends` entry-point group -- built in: `xgrammar` and `guidance`
(llguidance) -- or `auto`, which is xgrammar (guidance where xgrammar is not installed). There is no
per-request fallback: a constraint the chosen backend refuses is a 400. Counters for the metrics:
`num_constrained_requests` and `grammar_compile_seconds` (cumulative time spent compiling; a
cache hit costs none).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence

from tokenmill.plugins import discovery

from . import json_schema, structural_tag
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


def check_schemas(kind: str, spec: str) -> None:
    """What a constraint's JSON schemas must hold whichever backend compiles them (a plugin's too):
    no reference outside the schema (core/json_schema.py). RequestError naming structured_outputs."""
    if kind == "json":
        try:
            found: Iterable[tuple[str, Any]] = [("the JSON schema", json.loads(spec))]
        except ValueError:
            return                        # not JSON: the backend says so
    elif kind == "structural_tag":
        found = structural_tag.schemas(structural_tag.load(spec))
    else:
        return
    for what, schema in found:
        json_schema.check_refs(schema, what)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 backend: str = DEFAULT_BACKEND) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend_name = resolve_backend_name(backend)
        self._backend: Optional[Any] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()     # the counters are also written by the compile thread
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

    def submit(self, params: StructuredOutputsParams) -> "Future[Any]":
        """The request's compiled constraint, as a future: done at once on a compile-cache hit,
        else compiled on the worker thread. RequestError (param structured_outputs) at once for a
        kind the backend does not support or a schema `check_schemas` refuses, from the future for
        a spec the backend refuses."""
        kind, spec = params.kind, params.spec
        backend = self.backend
        if backend.supported_kinds and kind not in backend.supported_kinds:
            raise RequestError(f"the grammar backend {self.backend_name!r} does not support {kind!r}",
                               "structured_outputs", "invalid_value")
        hit = backend.cached(kind, spec)
        if hit is None:
            check_schemas(kind, spec)     # a cached spec passed it
        with self._lock:
            self.num_constrained_requests += 1
        if hit is not None:
            done: Future[Any] = Future()
            done.set_result(hit)
            return done
        if self._executor is None:
            # One thread: compiles queue behind each other rather than compete for the 2 cores
            # the model runs on (xgrammar parallelises one compile itself).
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-grammar")
        return self._executor.submit(self._compile, kind, spec)

    def _compile(self, kind: str, spec: str) -> Any:
        start = time.perf_counter()
        try:
            return self.backend.compiled(kind, spec)
        finally:
            with self._lock:
                self.grammar_compile_seconds += time.perf_counter() - start

    def matchers(self, compiled: Any, n: int) -> list[Any]:
        """n fresh matchers of a compiled constraint (one per sequence of the request)."""
        return [compiled.new_matcher() for _ in range(n)]
