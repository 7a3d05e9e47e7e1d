"""OpenAI's Responses API on the wire: the request, its translation to a chat request,
and the response object and typed stream events built from chat chunks.

bourse runs every Responses request as a chat generation on the same book, money and
relay. This module is pure (no I/O):

- :func:`parse_request` checks a ``POST /v1/responses`` body (:class:`ResponsesRequest`);
  a field this gateway does not serve (built-in tools, ``conversation``, ``prompt``…)
  is a 400 that names it;
- :func:`input_items` gives the request's input as stored items (with ids), and
  :func:`chat_body` the chat request that runs it: ``instructions`` first, then the
  stored conversation of ``previous_response_id``, then the input (messages, function
  calls and their outputs), with ``tools``, ``tool_choice``, ``text.format``, the output
  budget and bourse's own ``max_price``, ``timeout`` and ``sim``;
- :class:`ResponseBuilder` folds the chat chunks of a run into the response's output
  items and, for a stream, into OpenAI's typed events, each with its
  ``sequence_number``: ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` … ``response.output_item.done`` (reasoning as a
  reasoning item's summary, tool calls as ``function_call`` items with
  ``response.function_call_arguments.delta``), and the final ``response.completed``,
  ``response.incomplete`` or ``response.failed``. :func:`event_frames` writes them as
  SSE (``event: <type>`` and ``data: <json>``);
- :func:`response_usage` is the chat usage in the Responses API's names, with bourse's
  receipt (``cost``, ``cost_micros``, ``x_market``) kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bourse.domain.errors import invalid_request
from bourse.wire.requests import INT64_MAX, MAX_PRICE, IdText, Int64

FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "incomplete"})
"""A response in one of these states changes no more."""

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
            _item(i, item)
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


def _item(i: int, item: Mapping[str, Any]) -> BaseModel:
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


def new_id(prefix: str) -> str:
    """A new item id: ``msg_…``, ``fc_…``, ``rs_…``."""
    return f"{prefix}_{os.urandom(12).hex()}"


# -- the input -------------------------------------------------------------------


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string input is one user message)."""
    if isinstance(req.input, str):
        return [_message("user", [{"type": "input_text", "text": req.input}])]
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(req.input):
        item = _item(i, raw).model_dump(exclude_none=True)
        if item["type"] == "message":
            if isinstance(item["content"], str):
                part = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        if "id" not in item:
            item["id"] = new_id(_ID_PREFIX[item["type"]])
        out.append(item)
    return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def referenced(item_id: str) -> tuple[str, int] | None:
    """The response id and output index an output item's id names (``msg_<response
    id>_<index>``), or None for an id this gateway did not give an output item."""
    prefix, _, rest = item_id.partition("_")
    response_id, _, index = rest.rpartition("_")
    if prefix not in ("msg", "fc", "rs") or not response_id or not index.isdigit():
        return None
    return response_id, int(index)


def _message(role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": role, "status": "completed", "content": content}


def chat_messages(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Items (stored ones first, then the input) as chat messages: consecutive function
    calls join the assistant turn before them; reasoning items are left out."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "message":
            messages.append(_chat_message(item))
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p.get("text", "") for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages


def _chat_message(item: Mapping[str, Any]) -> dict[str, Any]:
    role = "system" if item["role"] == "developer" else item["role"]
    parts: list[dict[str, Any]] = []
    for p in item["content"]:
        if p["type"] == "input_image":
            image = {"url": p["image_url"], **({"detail": p["detail"]} if p.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": p["text"]})
    if all(p["type"] == "text" for p in parts) and (len(parts) == 1 or role != "user"):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def chat_body(
    req: ResponsesRequest, history: Sequence[Mapping[str, Any]], items: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The chat request that runs ``req``: its instructions, the stored conversation
    ``history`` (of ``previous_response_id``) and its input ``items``."""
    messages = chat_messages([*history, *items])
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise invalid_request("input: expected at least one message", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls if req.tools else None,
        "user": req.user,
        "max_price": req.max_price,
        "timeout": req.timeout,
        "sim": req.sim,
        "seed": req.seed,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        "response_format": _response_format(req.text),
    }
    body.update((k, v) for k, v in optional.items() if v is not None)
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
        )
    return body


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, Mapping) or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    schema.setdefault("name", "response")
    return {"type": "json_schema", "json_schema": schema}


# -- the response ------------------------------------------------------------------


def response_object(
    response_id: str, req: ResponsesRequest, model: str, created_at: int, status: str
) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed, as OpenAI's."""
    reasoning = req.reasoning or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": req.stored,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [{**t, "strict": t.get("strict")} for t in req.tools or ()],
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def response_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A chat usage in the Responses API's names; bourse's receipt fields (``cost``,
    ``cost_micros``, ``x_market``, ``usage_estimated``) ride along."""
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    out: dict[str, Any] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }
    for key in ("cost", "cost_micros", "x_market", "usage_estimated"):
        if key in usage:
            out[key] = usage[key]
    return out


class _Item:
    """One output item being built: a message, a reasoning summary or a function call."""

    __slots__ = ("data", "index", "parts")

    def __init__(self, index: int, data: dict[str, Any]) -> None:
        self.index = index
        self.data = data
        self.parts: list[str] = []


class ResponseBuilder:
    """Folds a run's chat chunks (choice 0) into a response's output items; with
    ``events``, also into the stream's typed events (taken with :meth:`take`)."""

    __slots__ = ("_created", "_events", "_finish", "_open", "_tools", "items", "response", "seq", "started")

    def __init__(self, response: dict[str, Any], *, events: bool, seq: int = 0) -> None:
        self.response = response
        """The response object (its ``output`` filled by :meth:`finish`)."""
        self._events: list[dict[str, Any]] | None = [] if events else None
        self.seq = seq
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self._tools: dict[int, _Item] = {}
        self._finish: str | None = None
        self._created = False
        self.started = False

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.append({"type": kind, "sequence_number": self.seq, **fields})
            self.seq += 1

    def take(self) -> list[dict[str, Any]]:
        """The events built since the last call."""
        out = self._events or []
        if self._events:
            self._events = []
        return out

    def queued(self) -> None:
        """``response.created`` and ``response.queued``: a background response, before it runs."""
        self._created = True
        self.response["status"] = "queued"
        self._emit("response.created", response=dict(self.response))
        self._emit("response.queued", response=dict(self.response))

    def start(self) -> None:
        """``response.created`` (unless :meth:`queued` sent it) and ``response.in_progress`` (once)."""
        if self.started:
            return
        self.started = True
        self.response["status"] = "in_progress"
        if not self._created:
            self._emit("response.created", response=dict(self.response))
        self._emit("response.in_progress", response=dict(self.response))

    def add(self, chunk: Mapping[str, Any]) -> None:
        self.start()
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self._reasoning(reasoning)
            if delta.get("content"):
                self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]

    def add_message(self, message: Mapping[str, Any], finish_reason: str | None) -> None:
        """A whole chat message (a detached job's result) as one chunk."""
        delta = dict(message)
        delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(message.get("tool_calls") or ())]
        self.add({"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    # -- items ---------------------------------------------------------------------

    def _item_id(self, prefix: str) -> str:
        """The next output item's id: its response's id and its index in the output, so that
        an ``item_reference`` finds it (:func:`referenced`)."""
        return f"{prefix}_{self.response['id']}_{len(self.items)}"

    def _begin(self, data: dict[str, Any]) -> _Item:
        self._close()
        item = _Item(len(self.items), data)
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=item.index, item=dict(data))
        return item

    def _reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item.data["type"] != "reasoning":
            item = self._begin({"id": self._item_id("rs"), "type": "reasoning", "summary": []})
            self._emit("response.reasoning_summary_part.added", item_id=item.data["id"], output_index=item.index,
                       summary_index=0, part={"type": "summary_text", "text": ""})  # fmt: skip
        item.parts.append(text)
        self._emit("response.reasoning_summary_text.delta", item_id=item.data["id"], output_index=item.index,
                   summary_index=0, delta=text)  # fmt: skip

    def _text(self, text: str) -> None:
        item = self._open
        if item is None or item.data["type"] != "message":
            item = self._begin(
                {
                    "id": self._item_id("msg"),
                    "type": "message",
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
            )
            self._emit("response.content_part.added", item_id=item.data["id"], output_index=item.index,
                       content_index=0, part=_text_part(""))  # fmt: skip
        item.parts.append(text)
        self._emit("response.output_text.delta", item_id=item.data["id"], output_index=item.index,
                   content_index=0, delta=text, logprobs=[])  # fmt: skip

    def _tool_call(self, call: Mapping[str, Any]) -> None:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        item = self._tools.get(index)
        if item is None:
            item = self._begin({"id": self._item_id("fc"), "type": "function_call", "status": "in_progress",
                                "call_id": call.get("id") or new_id("call"), "name": fn.get("name") or "",
                                "arguments": ""})  # fmt: skip
            self._tools[index] = item
        elif fn.get("name") and not item.data["name"]:
            item.data["name"] = fn["name"]
        args = fn.get("arguments")
        if args:
            item.parts.append(args)
            if item is self._open:
                self._emit("response.function_call_arguments.delta", item_id=item.data["id"],
                           output_index=item.index, delta=args)  # fmt: skip

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        data, text = item.data, "".join(item.parts)
        ids = {"item_id": data["id"], "output_index": item.index}
        if data["type"] == "message":
            part = _text_part(text)
            self._emit("response.output_text.done", **ids, content_index=0, text=text, logprobs=[])
            self._emit("response.content_part.done", **ids, content_index=0, part=part)
            data["content"] = [part]
        elif data["type"] == "reasoning":
            part = {"type": "summary_text", "text": text}
            self._emit("response.reasoning_summary_text.done", **ids, summary_index=0, text=text)
            self._emit("response.reasoning_summary_part.done", **ids, summary_index=0, part=part)
            data["summary"] = [part]
        else:
            data["arguments"] = text
            self._emit("response.function_call_arguments.done", **ids, arguments=text)
        data["status"] = status
        self._emit("response.output_item.done", output_index=item.index, item=data)

    # -- the end -------------------------------------------------------------------

    def finish(
        self,
        usage: Mapping[str, Any] | None,
        error: Mapping[str, Any] | None = None,
        *,
        cancelled: bool = False,
        extra: Mapping[str, Any] | None = None,
        completed_at: float | None = None,
    ) -> dict[str, Any]:
        """The final response: every item closed, the status (``completed``,
        ``incomplete`` when the output budget cut it, ``failed`` with ``error``
        (``code``, ``message``), ``cancelled``), the usage and ``extra`` (the receipt);
        its last event (``response.completed``, ``.incomplete`` or ``.failed``)."""
        self.start()
        cut = self._finish == "length"
        if error is not None or cancelled or cut:
            status = "failed" if error is not None else "cancelled" if cancelled else "incomplete"
        else:
            status = "completed"
        self._close("completed" if status == "completed" else "incomplete")
        r = self.response
        r["status"] = status
        r["output"] = [i.data for i in self.items]
        r["usage"] = None if usage is None else response_usage(usage)
        r["error"] = None if error is None else dict(error)
        r["incomplete_details"] = {"reason": "max_output_tokens"} if status == "incomplete" else None
        if completed_at is not None and status == "completed":
            r["completed_at"] = completed_at
        r.update(extra or {})
        last = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed"
        )
        self._emit(last, response=r)
        return r


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}


def event_frames(events: Sequence[Mapping[str, Any]]) -> bytes:
    """Typed events as SSE frames: ``event: <type>``, then ``data: <json>``."""
    return b"".join(
        b"event: " + ev["type"].encode() + b"\ndata: " + orjson.dumps(ev) + b"\n\n" for ev in events
    )


def output_text(response: Mapping[str, Any]) -> str:
    """The text of a response's message items (what the SDKs call ``output_text``)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output") or ()
        if item.get("type") == "message"
        for part in item.get("content") or ()
    )


# -- an upstream that speaks the Responses API ------------------------------------------


def upstream_request(chat: Mapping[str, Any], model: str) -> dict[str, Any]:
    """A chat request as a streamed, unstored Responses request for ``model`` (an
    ``openai`` deployment with ``api = "responses"``). What has no place there (``seed``,
    ``stop``, bourse's own fields…) is left out."""
    body: dict[str, Any] = {"model": model, "input": _upstream_input(chat.get("messages") or ()),
                            "stream": True, "store": False}  # fmt: skip
    budget = chat.get("max_completion_tokens") or chat.get("max_tokens")
    optional = {
        "max_output_tokens": budget,
        "temperature": chat.get("temperature"),
        "top_p": chat.get("top_p"),
        "parallel_tool_calls": chat.get("parallel_tool_calls"),
        "user": chat.get("user"),
        "reasoning": {"effort": chat["reasoning_effort"]} if chat.get("reasoning_effort") else None,
        "text": _upstream_text(chat.get("response_format")),
    }
    body.update((k, v) for k, v in optional.items() if v is not None)
    tools = chat.get("tools")
    if tools:
        body["tools"] = [{"type": "function", **(t.get("function") or {})} for t in tools]
    choice = chat.get("tool_choice")
    if isinstance(choice, str):
        body["tool_choice"] = choice
    elif isinstance(choice, Mapping):
        body["tool_choice"] = {"type": "function", "name": (choice.get("function") or {}).get("name")}
    return body


def _upstream_text(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_object", "json_schema"):
        return None
    if fmt["type"] == "json_object":
        return {"format": {"type": "json_object"}}
    return {"format": {"type": "json_schema", **(fmt.get("json_schema") or {})}}


def _upstream_input(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses input items (the inverse of :func:`chat_messages`)."""
    items: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": m.get("tool_call_id"),
                          "output": _plain(m.get("content"))})  # fmt: skip
            continue
        content = m.get("content")
        if content:
            items.append({"role": role, "content": _upstream_parts(role, content)})
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            items.append({"type": "function_call", "call_id": call.get("id"), "name": fn.get("name"),
                          "arguments": fn.get("arguments") or ""})  # fmt: skip
    return items


def _plain(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, Mapping))


def _upstream_parts(role: Any, content: Any) -> Any:
    if isinstance(content, str):
        return content
    text = "output_text" if role == "assistant" else "input_text"
    parts: list[dict[str, Any]] = []
    for p in content:
        if p.get("type") == "image_url":
            image = p.get("image_url") or {}
            parts.append(
                {"type": "input_image", "image_url": image.get("url"), "detail": image.get("detail", "auto")}
            )
        else:
            parts.append({"type": text, "text": p.get("text", "")})
    return parts


class UpstreamEvents:
    """An upstream's typed Responses events as chat chunks (choice 0) and, at its end,
    its usage in chat names; ``done`` once ``response.completed``, ``.incomplete`` or
    ``.failed`` came, ``error`` the failure (an ``error`` event or ``response.failed``)."""

    __slots__ = ("_calls", "done", "error", "usage")

    def __init__(self) -> None:
        self._calls: dict[str, int] = {}
        self.done = False
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    def chunk(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        """The chat chunk of one event (None: nothing a chat client sees)."""
        kind = event.get("type")
        if kind == "response.output_text.delta":
            return _delta({"content": event.get("delta", "")})
        if kind in ("response.reasoning_summary_text.delta", "response.reasoning_text.delta"):
            return _delta({"reasoning_content": event.get("delta", "")})
        if kind == "response.output_item.added" and (event.get("item") or {}).get("type") == "function_call":
            item = event["item"]
            index = self._calls.setdefault(str(item.get("id")), len(self._calls))
            call = {"index": index, "id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}  # fmt: skip
            return _delta({"tool_calls": [call]})
        if kind == "response.function_call_arguments.delta":
            index = self._calls.get(str(event.get("item_id")), 0)
            return _delta(
                {"tool_calls": [{"index": index, "function": {"arguments": event.get("delta", "")}}]}
            )
        if kind in ("response.completed", "response.incomplete", "response.failed", "error"):
            return self._end(event)
        return None

    def _end(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        self.done = True
        response = event.get("response") or {}
        if event.get("type") == "error" or response.get("status") == "failed":
            err = response.get("error") if event.get("type") != "error" else event
            err = err or {}
            self.error = {
                "message": err.get("message") or "upstream response failed",
                "code": err.get("code"),
            }
            return None
        usage = response.get("usage")
        if isinstance(usage, Mapping):
            self.usage = {
                "prompt_tokens": usage.get("input_tokens") or 0,
                "completion_tokens": usage.get("output_tokens") or 0,
                "completion_tokens_details": {
                    "reasoning_tokens": (usage.get("output_tokens_details") or {}).get("reasoning_tokens")
                    or 0
                },
            }
        incomplete = (response.get("incomplete_details") or {}).get("reason") == "max_output_tokens"
        finish = "length" if incomplete else "tool_calls" if self._calls else "stop"
        out = _delta({})
        out["choices"][0]["finish_reason"] = finish
        return out


def _delta(delta: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }
