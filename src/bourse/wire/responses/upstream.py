"""An upstream that speaks the Responses API (an ``openai`` deployment with
``api = "responses"``): :func:`upstream_request` writes a chat request as a Responses
request, and :class:`UpstreamEvents` reads its typed events back as chat chunks and
usage. Pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


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
