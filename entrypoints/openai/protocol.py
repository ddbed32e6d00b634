"""Request bodies of the OpenAI routes (pydantic), plus the sampling extras vLLM accepts.

Unknown top-level fields are refused, as OpenAI's API refuses them ("Unrecognized request argument
supplied: X", param X): a field this server does not implement must not be silently ignored (a
client that asked for constrained output would get free text). Fields that only carry metadata
(`user`, `metadata`, `store`, `service_tier`, ...) are accepted. Types are strict: a boolean is not
a number or a token id, a string not a boolean. vLLM's older `guided_*` fields are mapped onto
`structured_outputs`. Validation errors are turned into OpenAI-shaped 400s that name the offending
`param` in OpenAI's spelling, `messages[0].role` (see `validation_error`), with a code: invalid_type,
invalid_value, missing_required_parameter, unknown_parameter. Responses have no models: they are
built as plain dicts, the cheapest thing to json.dumps once per streamed chunk.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from .errors import APIError, bad_request


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=(), allow_inf_nan=False)


class _Metadata(_Base):
    """Fields that only describe a request (who sent it, billing, caching hints): accepted, unused."""
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


# vLLM's older names for structured outputs -> the key of `structured_outputs` each one sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class StreamOptions(_Base):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False
    include_obfuscation: Optional[bool] = None     # OpenAI's stream padding: accepted, nothing to pad here


class _SamplingFields(_Metadata):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Optional[str] = None
    n: Optional[int] = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_tokens: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    # vLLM's sampling extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    priority: Optional[int] = 0
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's structured outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: Optional[dict[str, Any]] = None

    # which body field the structured outputs came from: a guided_ field, or structured_outputs itself
    _structured_param: str = PrivateAttr(default="structured_outputs")

    @model_validator(mode="wrap")
    @classmethod
    def _guided_fields(cls, body: Any, handler: Any) -> Any:
        """vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` become the
        structured_outputs they mean (the engine validates the value; its errors name the guided_ field)."""
        given = [name for name in GUIDED_FIELDS if isinstance(body, dict) and body.get(name) is not None]
        if not given:
            return handler({k: v for k, v in body.items() if k not in GUIDED_FIELDS}
                           if isinstance(body, dict) else body)
        if len(given) > 1 or body.get("structured_outputs") is not None:
            raise bad_request(f"Set only one of {', '.join([*GUIDED_FIELDS, 'structured_outputs'])}.", given[0],
                              "invalid_value")
        value = body[given[0]]
        body = {k: v for k, v in body.items() if k not in GUIDED_FIELDS}
        body["structured_outputs"] = {GUIDED_FIELDS[given[0]]: value}
        req = handler(body)
        req._structured_param = given[0]
        return req


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: Optional[bool] = True


class ChatMessage(_Base):
    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM extras for the chat template
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None     # the request's own: only with --trust-request-chat-template
    echo: Optional[bool] = False


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    return_token_strs: Optional[bool] = False
    chat_template: Optional[str] = None     # as in ChatCompletionRequest
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[int]


_BRANCH_NAMES = {"str", "int", "float", "bool", "none", "dict", "list", "union"}


def _is_branch(item: Any) -> bool:
    """pydantic's name for a union branch or validator wrapper in a loc ('list[int]', 'function-after[...]'):
    not part of the field path."""
    return isinstance(item, str) and (item in _BRANCH_NAMES or "[" in item or "-" in item)


class EmbeddingRequest(_Metadata):
    """POST /v1/embeddings (serving_embeddings.py), with vLLM's extras."""
    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: Optional[bool] = True
    normalize: Optional[bool] = None          # None: as the model's pooler config says
    priority: Optional[int] = 0


def _param_from_loc(loc: tuple) -> Optional[str]:
    """The loc in OpenAI's spelling: `messages[0].role`, `prompt[1][0]`."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _is_branch(item):
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def _path_depth(error: Any) -> int:
    return sum(1 for item in error.get("loc", ()) if not _is_branch(item))


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for pydantic's first error, the most specific one of a union's branches (the deepest
    path: `prompt[1][0]` rather than `prompt`). Its code says what kind of error it is."""
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request(f"Invalid request: {exc}.", None, "invalid_value")
    first = max(errors, key=_path_depth)     # max() keeps the first of equally deep ones
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    kind = first.get("type", "")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind.endswith("_type") or kind in ("is_instance_of", "model_attributes_type"):
        return bad_request(f"Invalid type for '{param}': {msg}.", param, "invalid_type")
    return bad_request(f"Invalid value for '{param}': {msg}.", param, "invalid_value")


def parse(model_cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None

