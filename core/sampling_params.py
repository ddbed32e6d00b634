"""Per-request sampling parameters, validated at construction (ValueError names the field)."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to one of: a JSON schema (`json`, a dict or its JSON text), any JSON
    object (`json_object=True`), a regex, one of a list of strings (`choice`), an EBNF / Lark
    grammar (`grammar`) or a structural tag (`structural_tag`, a dict or its JSON text). Exactly
    one may be set (ValueError naming `structured_outputs`).

    A structural tag (vLLM's and xgrammar's) constrains only parts of free text, e.g. tool calls:
    in the legacy form `{"type": "structural_tag", "structures": [{"begin": "<function=f>",
    "schema": {...}, "end": "</function>"}], "triggers": ["<function="]}` the text is free until a
    trigger appears; then it must go on as one of the structures whose `begin` starts with that
    trigger, a JSON value of its `schema`, and its `end`; then free text again. xgrammar's newer
    form `{"type": "structural_tag", "format": {...}}` (its format language, e.g. "triggered_tags")
    is passed to the backend as it is. The backends check the contents (core/structural_tag.py)."""
    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    structural_tag: Optional[Union[dict, str]] = None

    def __post_init__(self) -> None:
        def bad(message: str) -> ValueError:
            err = ValueError(f"structured_outputs {message}")
            err.param = "structured_outputs"  # type: ignore[attr-defined]
            return err
        if not isinstance(self.json_object, bool):
            raise bad(f"json_object must be a boolean, got {self.json_object!r}")
        set_ = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise bad(f"needs exactly one of {', '.join(_STRUCTURED_KINDS)}; got "
                      f"{', '.join(set_) if set_ else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise bad(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise bad("choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.structural_tag is not None:
            self._check_structural_tag(bad)

    def _check_structural_tag(self, bad: Any) -> None:
        """The structural tag's shape (its contents are the backends' to check)."""
        import json as _json
        value = self.structural_tag
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as e:
                raise bad(f"structural_tag is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise bad(f"structural_tag must be an object (or its JSON text), got {type(value).__name__}")
        if value.get("type", "structural_tag") != "structural_tag":
            raise bad(f"structural_tag's type must be 'structural_tag', got {value.get('type')!r}")
        legacy, new = "structures" in value or "triggers" in value, "format" in value
        if legacy == new:
            raise bad("structural_tag needs either 'structures' and 'triggers' (the legacy form) or "
                      "'format', " + ("not both" if legacy else "got neither"))
        if legacy and not (isinstance(value.get("structures"), list) and isinstance(value.get("triggers"), list)):
            raise bad("structural_tag's legacy form needs 'structures' and 'triggers', both lists")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (a cache key): JSON text for json / choice / structural_tag
        (for structural_tag canonical: the same object as a dict or as any JSON text, one key)."""
        import json as _json
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _json.dumps(self.json)   # key order is property order
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "structural_tag":
            value = self.structural_tag
            return _json.dumps(_json.loads(value) if isinstance(value, str) else value)   # key order kept
        return "" if kind == "json_object" else getattr(self, kind)

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """From a StructuredOutputsParams or a mapping of its fields (the API's body field)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise cls._bad_type(value)
        unknown = sorted(set(value) - set(_STRUCTURED_KINDS))
        if unknown:
            err = ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                             f"expected one of {', '.join(_STRUCTURED_KINDS)}")
            err.param = "structured_outputs"  # type: ignore[attr-defined]
            raise err
        return cls(**{k: v for k, v in value.items() if v is not None})

    @staticmethod
    def _bad_type(value: Any) -> ValueError:
        err = ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        err.param = "structured_outputs"  # type: ignore[attr-defined]
        return err


# Fields whose default is not None and for which None has no meaning of its own.
_NONE_MEANS_UNSET = frozenset({
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
})


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    max_tokens: Optional[int] = 16      # None: until max_model_len
    min_tokens: int = 0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None      # top-k logprobs per generated token (0 = only the sampled one)
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None   # grammar-constrained output
    # Fields the caller set explicitly; generation_config.json defaults never override them.
    _explicit: frozenset = field(default=frozenset(), repr=False, compare=False)

    def __init__(self, **kwargs: Any) -> None:
        names = {f.name for f in fields(self) if f.name != "_explicit"}
        for f in fields(self):
            if f.name == "_explicit":
                continue
            setattr(self, f.name, copy.copy(f.default))
        explicit = set()
        for key, value in kwargs.items():
            if key not in names:
                raise ValueError(f"unknown sampling parameter {key!r}")
            # None for a field whose None has no meaning (e.g. temperature=None from an API request
            # that left it out) means "unset": the default applies and generation_config may fill it.
            if value is None and key in _NONE_MEANS_UNSET:
                continue
            setattr(self, key, value)
            explicit.add(key)
        self._explicit = frozenset(explicit)
        self._normalize_and_validate()

    # ---------------------------------------------------------------- validation
    def _normalize_and_validate(self) -> None:
        def bad(param: str, message: str) -> ValueError:
            err = ValueError(f"{param} {message}")
            err.param = param  # type: ignore[attr-defined]
            return err

        def number(param: str, value: Any, integer: bool = False) -> None:
            ok = isinstance(value, int) if integer else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok:
                raise bad(param, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
            if not integer and not math.isfinite(value):
                raise bad(param, f"must be finite, got {value!r}")

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be a boolean, got {getattr(self, name)!r}")

        number("n", self.n, integer=True)
        if self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        number("temperature", self.temperature)
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        number("top_k", self.top_k, integer=True)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise bad("top_k", f"must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            number("seed", self.seed, integer=True)
            if not -2 ** 63 <= self.seed < 2 ** 63:     # a 64-bit seed, as torch.Generator and OpenAI take it
                raise bad("seed", f"must fit in a signed 64-bit integer, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            number(name, value)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {value}")
        number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            number("max_tokens", self.max_tokens, integer=True)
            if self.max_tokens < 1:
                raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        number("min_tokens", self.min_tokens, integer=True)
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            number("logprobs", self.logprobs, integer=True)
            if self.logprobs < 0:
                raise bad("logprobs", f"must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            number("prompt_logprobs", self.prompt_logprobs, integer=True)
            if self.prompt_logprobs < 0:
                raise bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a mapping of token id to bias")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise bad("logit_bias", "must map integer token ids to numbers") from None
            if any(k < 0 for k in self.logit_bias):
                raise bad("logit_bias", "token ids must be non-negative")
            for bias in self.logit_bias.values():
                if not math.isfinite(bias):
                    raise bad("logit_bias", f"values must be finite, got {bias}")
                if not -100.0 <= bias <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    # ---------------------------------------------------------------- helpers
    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def is_explicit(self, name: str) -> bool:
        return name in self._explicit

    def with_generation_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy with the model's generation_config defaults for every field the caller left unset."""
        mapping = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
        updates = {}
        for src, dst in mapping.items():
            if src in defaults and defaults[src] is not None and dst not in self._explicit:
                updates[dst] = defaults[src]
        if not updates:
            return self
        clone = self.clone()
        for key, value in updates.items():
            setattr(clone, key, value)
        clone._normalize_and_validate()
        return clone

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
