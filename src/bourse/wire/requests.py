"""Validation of client request bodies (chat and legacy completions).

Bodies are parsed to plain dicts (the dict is what is forwarded upstream, so fields
the gateway does not own pass through unchanged) and checked against pydantic
models that follow OpenAI's shapes with ``extra="allow"``. A failure names the
field: ``messages.0.role: Input should be ...``.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bourse.domain.errors import GatewayError, invalid_request

Kind = Literal["chat", "completion"]

GATEWAY_FIELDS = ("max_price", "timeout", "detached")
"""Request extensions that the gateway owns and never forwards upstream."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # no coercion: the raw body goes on upstream


class StreamOptions(_Open):
    include_usage: bool | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class ToolCallFunction(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(_Open):
    type: str


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class _Common(_Open):
    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    user: str | None = None
    # gateway extensions
    max_price: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    detached: bool = False
    sim: dict[str, Any] | None = None


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"})


def _loc(loc: tuple[int | str, ...]) -> str:
    """A field path without pydantic's union-member tags (``str``, ``list[Part]``...)."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``, or a 400 saying why not."""
    if not raw:
        raise invalid_request("The request body is empty; send a JSON object.")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def validate(kind: Kind, body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """Check ``body`` against the endpoint's shape; GatewayError(400) names the field."""
    model: type[ChatCompletionRequest | CompletionRequest] = (
        ChatCompletionRequest if kind == "chat" else CompletionRequest
    )
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = _loc(err["loc"]) or "body"
        raise invalid_request(f"{where}: {err['msg']}", param=where) from None
    if req.n is not None and req.n != 1:
        raise invalid_request("n: only n=1 is supported; send one request per choice.", param="n")
    if isinstance(req, CompletionRequest):
        if (
            isinstance(req.prompt, list)
            and req.prompt
            and isinstance(req.prompt[0], str)
            and len(req.prompt) != 1
        ):
            raise invalid_request(
                "prompt: send one prompt per request (a list of several is not supported).", "prompt"
            )
        if req.best_of not in (None, 1):
            raise invalid_request("best_of: only best_of=1 is supported.", param="best_of")
    return req


def check_size(length: int, limit: int) -> None:
    if length > limit:
        raise GatewayError(
            413, "request_too_large", f"The request body is {length} bytes; the limit is {limit} bytes."
        )
