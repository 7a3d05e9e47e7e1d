"""OpenAI response shapes built in process: the stream chunk the in-process engines
make (:func:`stream_chunk`), and those the gateway builds itself: the aggregated
(non-stream) completion, the usage chunk, and the error frame.

Chunks from engines are relayed as they come; only metering looks inside them.
:class:`Aggregator` folds a stream of chunks back into one ``chat.completion`` or
``text_completion`` for clients that did not ask to stream.
"""

from __future__ import annotations

from typing import Any

from bourse.domain.errors import GatewayError

CHAT_CHUNK = "chat.completion.chunk"
CHAT = "chat.completion"
TEXT = "text_completion"


class Aggregator:
    """Folds stream chunks of one choice into a complete response object."""

    __slots__ = (
        "_content",
        "_finish",
        "_kind",
        "_logprobs",
        "_reasoning",
        "_reasoning_key",
        "_refusal",
        "_tools",
        "fingerprint",
    )

    def __init__(self, kind: str, reasoning_key: str = "reasoning_content") -> None:
        self._kind = kind
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._refusal: list[str] = []
        self._tools: dict[int, dict[str, Any]] = {}
        self._finish: str | None = None
        self._logprobs: list[Any] | None = None
        self._reasoning_key = reasoning_key
        self.fingerprint: str | None = None

    def add(self, chunk: dict[str, Any]) -> None:
        fp = chunk.get("system_fingerprint")
        if fp:
            self.fingerprint = fp
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
            lp = choice.get("logprobs")
            if lp:
                self._add_logprobs(lp)
            if self._kind == "completion":
                text = choice.get("text")
                if text:
                    self._content.append(text)
            else:
                self._add_delta(choice.get("delta") or {})

    def _add_delta(self, delta: dict[str, Any]) -> None:
        text = delta.get("content")
        if text:
            self._content.append(text)
        r = delta.get(self._reasoning_key)
        if r:
            self._reasoning.append(r)
        ref = delta.get("refusal")
        if ref:
            self._refusal.append(ref)
        for tc in delta.get("tool_calls") or ():
            self._add_tool_call(tc)

    def _add_tool_call(self, tc: dict[str, Any]) -> None:
        slot = self._tools.setdefault(
            tc.get("index", 0),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if tc.get("id"):
            slot["id"] = tc["id"]
        if tc.get("type"):
            slot["type"] = tc["type"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def _add_logprobs(self, lp: Any) -> None:
        if self._logprobs is None:
            self._logprobs = []
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            self._logprobs.extend(lp["content"])

    @property
    def text(self) -> str:
        return "".join(self._content)

    def build(
        self, request_id: str, model: str, created: int, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        if self._kind == "completion":
            choice: dict[str, Any] = {
                "index": 0,
                "text": self.text,
                "logprobs": None,
                "finish_reason": self._finish,
            }
            obj = TEXT
        else:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": self.text if self._content or not self._tools else None,
            }
            if self._reasoning:
                message[self._reasoning_key] = "".join(self._reasoning)
            if self._refusal:
                message["refusal"] = "".join(self._refusal)
            if self._tools:
                message["tool_calls"] = [self._tools[i] for i in sorted(self._tools)]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": {"content": self._logprobs} if self._logprobs is not None else None,
                "finish_reason": self._finish,
            }
            obj = CHAT
        out: dict[str, Any] = {
            "id": request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
        }
        if self.fingerprint:
            out["system_fingerprint"] = self.fingerprint
        if usage is not None:
            out["usage"] = usage
        return out


def stream_chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    piece: dict[str, Any] | str,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One stream chunk of choice 0: for ``chat`` a ``chat.completion.chunk`` whose
    ``delta`` is ``piece`` (a dict), for ``completion`` a ``text_completion`` whose
    ``text`` is ``piece`` (a str)."""
    if kind == "chat":
        return {
            "id": request_id,
            "object": CHAT_CHUNK,
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish_reason}],
        }
    return {
        "id": request_id,
        "object": TEXT,
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    usage: dict[str, Any],
    receipt_name: str,
    receipt: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": CHAT_CHUNK if kind == "chat" else TEXT,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
        receipt_name: receipt,
    }


def error_frame(
    kind: str, request_id: str, model: str, created: int, error: GatewayError, with_finish_reason: bool
) -> dict[str, Any]:
    """The in-band error of SPEC section 6 (or the bare envelope when the policy says so)."""
    if not with_finish_reason:
        return {"error": error.envelope()}
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": "error"}
    else:
        choice = {"index": 0, "text": "", "finish_reason": "error"}
    return {
        "id": request_id,
        "object": CHAT_CHUNK if kind == "chat" else TEXT,
        "created": created,
        "model": model,
        "choices": [choice],
        "error": error.envelope(),
    }
