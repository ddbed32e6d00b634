"""Request bodies of the OpenAI routes (pydantic), plus the sampling extras vLLM accepts.

Unknown fields are ignored (as OpenAI-compatible servers commonly do), so a client that sends
a newer OpenAI field does not break. Validation errors are turned into OpenAI-shaped 400s that
name the offending `param` (see `validation_error`). Responses have no models: they are built
as plain dicts, the cheapest thing to json.dumps once per streamed chunk.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError, bad_request


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingFields(_Base):
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
    user: Optional[str] = None
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
    echo: Optional[bool] = False


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[int]


def _param_from_loc(loc: tuple) -> Optional[str]:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in ("str", "list[str]", "list[int]", "list[list[int]]", "function-after", "union"):
            # pydantic's names for union branches are not part of the field path
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return bad_request(f"Invalid value for '{param}': {msg}.", param, "invalid_value")


def parse(model_cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None

