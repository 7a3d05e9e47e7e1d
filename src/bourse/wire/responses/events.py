"""A run's chat chunks as a response: :class:`ResponseBuilder` folds them into the
response's output items and, for a stream, into OpenAI's typed events, each with its
``sequence_number``; :func:`event_frames` writes those as SSE. Pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from bourse.wire.responses.document import new_id, response_usage


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
