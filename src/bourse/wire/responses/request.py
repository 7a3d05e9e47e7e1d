"""A ``POST /v1/responses`` body checked: :func:`parse_request` gives the
:class:`ResponsesRequest`, and :func:`parse_item` one input item's model; a field this
gateway does not serve (built-in tools, ``conversation``, ``prompt``…) is a 400 that
names it. Pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bourse.domain.errors import invalid_request
from bourse.wire.requests import INT64_MAX, MAX_PRICE, IdText, Int64

_UNSUPPORTED = {
    "conversation": "conversations are not served; chain responses with previous_response_id",
    "prompt": "prompt templates are not served; send the input itself",
    "max_tool_calls": "only function tools are served, and their calls are the client's",
    "top_logprobs": "log probabilities are not served on this endpoint",
    "prompt_cache_options": "prompt caching is the engine's own",
    "prompt_cache_retention": "prompt caching is the engine's own",
}
"""OpenAI request fields this gateway does not serve, with why (a 400 names the field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextPart(_Open):
    type: Literal["input_text", "output_text"]
    text: str


class ImagePart(_Open):
    type: Literal["input_image"]
    image_url: str
    detail: str | None = None


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]
    id: str | None = None


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None


class ItemReference(_Strict):
    type: Literal["item_reference"]
    id: IdText


class ReasoningItem(_Open):
    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    id: str | None = None


_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "item_reference": ItemReference,
}


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: IdText | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(default=None, max_length=16)
    store: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    background: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # bourse's own
    max_price: float | None = Field(default=None, gt=0, le=MAX_PRICE, allow_inf_nan=False)
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    deadline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    sim: dict[str, Any] | None = None
    seed: Int64 | None = None

    @property
    def stored(self) -> bool:
        """Kept for GET and ``previous_response_id`` (``store`` defaults to true, as OpenAI's)."""
        return self.store is not False


def _field_error(exc: ValidationError, prefix: str = "") -> Exception:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TAGS))]
    where = ".".join([prefix, *loc] if prefix else loc) or "body"
    if err["type"] == "extra_forbidden":
        return invalid_request(f"{where}: not supported by this gateway's Responses API", param=where)
    return invalid_request(f"{where}: {err['msg']}", param=where)


_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "function-after"})


def parse_request(body: Mapping[str, Any]) -> ResponsesRequest:
    """The request in ``body``; a 400 names the field that is wrong or not served."""
    for name, why in _UNSUPPORTED.items():
        if body.get(name) is not None:
            raise invalid_request(f"{name}: not supported by this gateway ({why})", param=name)
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise _field_error(exc) from None
    for i, tool in enumerate(req.tools or ()):
        _check_tool(i, tool)
    _check_tool_choice(req.tool_choice)
    _check_text(req.text)
    if req.background and not req.stored:
        raise invalid_request("background: a background response must be stored (store: true)", "background")
    if isinstance(req.input, list):
        for i, item in enumerate(req.input):
            parse_item(i, item)
    return req


def _check_tool(i: int, tool: Mapping[str, Any]) -> None:
    kind = tool.get("type")
    if kind != "function":
        raise invalid_request(
            f"tools.{i}.type: {kind!r} is not supported by this gateway; only function tools are served "
            "(built-in tools such as web search are not).",
            param=f"tools.{i}.type",
        )
    try:
        FunctionTool.model_validate(tool)
    except ValidationError as exc:
        raise _field_error(exc, f"tools.{i}") from None


def _check_tool_choice(choice: str | Mapping[str, Any] | None) -> None:
    if choice is None or isinstance(choice, str):
        return
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid_request(
            'tool_choice: expected "none", "auto", "required" or {"type": "function", "name": …}',
            param="tool_choice",
        )


def _check_text(text: Mapping[str, Any] | None) -> None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid_request(
            "text.format.type: expected text, json_object or json_schema", param="text.format.type"
        )
    if kind == "json_schema" and not isinstance(fmt.get("schema"), Mapping):
        raise invalid_request("text.format.schema: expected a JSON schema object", param="text.format.schema")


def parse_item(i: int, item: Mapping[str, Any]) -> BaseModel:
    """Input item ``i`` as its type's model; a 400 names what is wrong or not served."""
    kind = item.get("type", "message" if "role" in item else None)
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise invalid_request(
            f"input.{i}.type: {kind!r} is not supported by this gateway (message, function_call, "
            "function_call_output, reasoning and item_reference items are)",
            param=f"input.{i}.type",
        )
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        raise _field_error(exc, f"input.{i}") from None
