"""Validation of client input at the edge: request bodies, numbers, ids.

Bodies are parsed to plain dicts (the dict is what is forwarded upstream, so fields
the gateway does not own pass through unchanged) and checked against pydantic
models that follow OpenAI's shapes with ``extra="allow"``. A failure names the
field: ``messages.0.role: Input should be ...``.

Every number a client sends is bounded here so that the ledger's arithmetic stays
inside int64 (:data:`MAX_PRICE`, :data:`INT64_MAX`), and every id or cursor a route
takes goes through :func:`check_id` (no NUL, which PostgreSQL refuses in text, nor any
other control character; at most :data:`MAX_ID_CHARS`). The body's ``sim`` object is
held to the bounds of :mod:`bourse.wire.sim`. Each failure is a 400.

Every JSON body a route reads goes through :func:`parse_json`, which bounds its nesting
(``[server] max_json_depth``): a body nested deeper is a 400 naming the limit and the
field (``text.format.schema``, ``tools.0.function.parameters``), before any key or
money is looked at. Everything the gateway later serialises (a stored response, a job,
an answer that echoes the request) nests at most a few levels deeper than the body,
and orjson refuses to write past 254 levels, so the limit is held well below that
(:data:`MAX_JSON_DEPTH_CEILING`).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import MAX_PRICE_USD
from bourse.wire.sim import SimKnobError, parse_sim

Kind = Literal["chat", "completion"]

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

MAX_QUOTE_TOKENS = 2**32
"""Above any request's quote. A quote counts one token per prompt byte, 8 per message,
64 per content part without text, 8 per request, and the output budget
(:func:`bourse.domain.money.quote_tokens`). The densest body is a list of
``{"type":""}`` parts, 12 bytes for 64 tokens (< 6 tokens per byte); a body is at most
512 MiB (the ceiling of ``server.max_body_bytes``) and an output budget at most 10^7
tokens (``max_output_tokens``), so a quote is below 6 * 2^29 + 10^7 + 8 < 2^32."""

MAX_PRICE = MAX_PRICE_USD
"""The highest ``max_price`` (and ``X-Max-Price``) a request may name, in USD per 1M
tokens: one dollar a token. A hold is ``ceil(tokens * price * 10^6 / 10^6)`` micro-USD,
so the largest is ``MAX_QUOTE_TOKENS * MAX_PRICE`` = 2^32 * 10^6 ~ 4.3e15 micro-USD, about
2,000 times below int64 (9.2e18): a hold, and sums of many holds, fit the ledger's
BIGINT columns, and ``price * 10^6`` (1e12) is exact in a double."""

MAX_ID_CHARS = 256
"""The longest id or cursor a route takes (every id the gateway issues is far shorter)."""

_CONTROLS = r"\x00-\x1f\x7f-\x9f"
"""C0 and C1 control characters and DEL (as a regex class body; NUL is the first)."""
_CONTROL = re.compile(f"[{_CONTROLS}]")
IdText = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=f"^[^{_CONTROLS}]+$")]
"""An id in a JSON body: the rule of :func:`check_id`, as a pydantic type."""
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

MAX_JSON_DEPTH_CEILING = 128
"""The highest ``[server] max_json_depth``: a body nested this deep, wrapped by what the
gateway stores and sends (an event around a response, a job around its body: a few
levels), stays far below the 254 levels orjson can write."""

_SCHEMA_HOLDERS = frozenset({"schema", "parameters"})
"""Keys whose value is a JSON schema (``response_format.json_schema.schema``,
``text.format.schema``, a tool's ``parameters``): a too-deep body names the field there."""

GATEWAY_FIELDS = ("max_price", "timeout", "deadline_s", "detached")
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
    n: Int64 | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    seed: Int64 | None = None
    user: str | None = None
    # gateway extensions
    max_price: float | None = Field(default=None, gt=0, le=MAX_PRICE, allow_inf_nan=False, strict=True)
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    deadline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False, strict=True)
    """A deadline order: admitted by then at the lowest bid that makes it, ``max_price``
    its ceiling (:mod:`bourse.services.deadline`)."""
    detached: bool = False
    sim: dict[str, Any] | None = None


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    best_of: Int64 | None = None
    suffix: str | None = None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"})


def _loc(loc: tuple[int | str, ...]) -> str:
    """A field path without pydantic's union-member tags (``str``, ``list[Part]``...)."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS)))


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The JSON value in ``raw``, nested at most ``max_depth`` levels (the top object or
    array is the first), or a 400 saying why not."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):  # orjson's own, at 1024 levels
            raise too_deep(max_depth, None) from None
        raise invalid_request(f"The request body is not valid JSON: {exc}") from None
    if nests_deeper(raw, doc, max_depth):
        raise too_deep(max_depth, _too_deep_field(doc, max_depth))
    return doc


def nests_deeper(raw: bytes, doc: Any, max_depth: int) -> bool:
    """Whether ``doc``, parsed from ``raw``, nests more than ``max_depth`` levels. Each
    level opens with a bracket and closes with another, so a document shorter than two
    brackets a level past the limit (an engine's chunk, most bodies) is within it
    without a look at its bytes (two counts of a chunk's bytes were ~1,000 instructions
    each, twice a chunk of every stream); then one with no more opening brackets than
    the limit (a chat's messages) is; only others are walked."""
    return (
        len(raw) > 2 * max_depth + 1
        and raw.count(b"{") + raw.count(b"[") > max_depth
        and _deeper_than(doc, max_depth)
    )


def parse_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The JSON object in ``raw`` (at most ``max_depth`` levels), or a 400 saying why not."""
    if not raw:
        raise invalid_request("The request body is empty; send a JSON object.")
    body = parse_json(raw, max_depth)
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    return body


def check_storable(value: Any, param: str) -> None:
    """What the gateway will keep or echo of a request, written once before any money is
    held: a value that cannot be written as JSON is the client's 400 now, never a
    failure after the run (a charge for an answer the client does not get)."""
    try:
        orjson.dumps(value)
    except TypeError as exc:  # orjson.JSONEncodeError is one
        raise invalid_request(f"{param}: cannot be kept as JSON ({exc})", param=param) from None


def too_deep(max_depth: int, param: str | None) -> GatewayError:
    where = f"{param}: " if param else ""
    return invalid_request(
        f"{where}the JSON is nested deeper than {max_depth} levels, this gateway's limit "
        "([server] max_json_depth).",
        param=param,
    )


def _deeper_than(doc: Any, max_depth: int) -> bool:
    """Whether ``doc`` nests more than ``max_depth`` levels: one level at a time, each a
    list of its containers (no recursion, so no Python stack to exhaust)."""
    level = [doc] if type(doc) is dict or type(doc) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        level = [
            v
            for c in level
            for v in (c.values() if type(c) is dict else c)
            if type(v) is dict or type(v) is list
        ]
    return False


def _too_deep_field(doc: Any, max_depth: int) -> str | None:
    """The field a too-deep ``doc`` is too deep in: its path down to the first schema
    (``text.format.schema``), else its top-level key (a job's: its body's key too)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(doc, ())]
    while stack:
        node, path = stack.pop()
        if len(path) >= max_depth:
            for i, key in enumerate(path):
                if key in _SCHEMA_HOLDERS:
                    return ".".join(path[: i + 1])
            return ".".join(path[:2] if path[0] == "body" else path[:1]) or None
        items = node.items() if type(node) is dict else enumerate(node)
        stack.extend((v, (*path, str(k))) for k, v in items if type(v) is dict or type(v) is list)
    return None


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
    if req.sim is not None:
        try:
            parse_sim(req.sim, bounded=True)
        except SimKnobError as exc:
            raise invalid_request(str(exc), param=exc.param) from None
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


_HEADER_BOUNDS = {"X-Max-Price": MAX_PRICE}


def bounded_header(name: str, value: float) -> float:
    """A positive number read from a gateway header (``X-Max-Price``, ``X-Book-Timeout``,
    ``X-Deadline-S``), held to the bound of its body field; a 400 naming the header past it."""
    most = _HEADER_BOUNDS.get(name)
    if most is not None and value > most:
        raise invalid_request(f"{name}: expected at most {most:g}, got {value:g}", param=name)
    return value


def check_id(value: str, param: str, most: int = MAX_ID_CHARS) -> str:
    """``value``, an id or cursor from a path, query or header, or a 400 naming ``param``:
    1 to ``most`` characters, none of them a control character (NUL included)."""
    if not 0 < len(value) <= most or _CONTROL.search(value) is not None:
        raise invalid_request(
            f"{param}: expected an id of 1 to {most} characters without control characters", param=param
        )
    return value


def optional_id(value: str | None, param: str) -> str | None:
    """:func:`check_id` for an optional query parameter (a cursor such as ``after``)."""
    return None if value is None else check_id(value, param)


def check_size(length: int, limit: int) -> None:
    if length > limit:
        raise GatewayError(
            413, "request_too_large", f"The request body is {length} bytes; the limit is {limit} bytes."
        )
