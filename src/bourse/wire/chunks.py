"""OpenAI response shapes built in process: the stream chunk the in-process engines
make (:func:`stream_chunk`), and those the gateway builds itself: the aggregated
(non-stream) completion, the usage chunk, and the error frame.

Chunks from engines are relayed as they come; only metering looks inside them.
:class:`Aggregator` folds a stream of chunks back into one ``chat.completion`` or
``text_completion`` for clients that did not ask to stream.
"""

from __future__ import annotations

from typing import Any, assert_never

from bourse.domain.errors import GatewayError
from bourse.domain.policy import ErrorFrame

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
        self._logprobs: dict[str, list[Any]] | None = None
        """Each list of the choices' ``logprobs`` objects, concatenated: ``content`` (and
        ``refusal``) for chat; ``tokens``, ``token_logprobs``, ``top_logprobs`` and
        ``text_offset`` for a legacy completion (whose streamed offsets already count
        from the start of the text, so they are kept as they come)."""
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
            self._logprobs = {}
        if isinstance(lp, dict):
            for key, values in lp.items():
                if isinstance(values, list):
                    self._logprobs.setdefault(key, []).extend(values)

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
                "logprobs": self._logprobs,
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
                "logprobs": None if self._logprobs is None else {"content": [], **self._logprobs},
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


def terminal_chunk(kind: str, request_id: str, model: str, created: int) -> dict[str, Any]:
    """A chunk with an empty choice and no ``finish_reason``: the terminal chunk that
    carries the usage when the engine sent none with a ``finish_reason`` (a failure)."""
    return stream_chunk(kind, request_id, model, created, {} if kind == "chat" else "")


def has_finish(chunk: dict[str, Any]) -> bool:
    """The chunk carries a choice's ``finish_reason``."""
    return any(choice.get("finish_reason") for choice in chunk.get("choices") or ())


def split_role_and_finish(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat chunk of one choice as the chunks OpenAI itself sends: the ``role`` alone
    on a chunk of its own (``delta: {"role": …}``), the content, and the
    ``finish_reason`` alone (``delta: {}``). ``chunk`` is changed in place."""
    choices = chunk.get("choices")
    if not choices or len(choices) != 1:
        return [chunk]
    choice = choices[0]
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return [chunk]
    out: list[dict[str, Any]] = []
    if "role" in delta and len(delta) > 1:
        out.append(
            {**chunk, "choices": [{**choice, "delta": {"role": delta.pop("role")}, "finish_reason": None}]}
        )
    finish = choice.get("finish_reason")
    if finish and delta:
        choice["finish_reason"] = None
        out.append(chunk)
        out.append({**chunk, "choices": [{**choice, "delta": {}, "finish_reason": finish}]})
    else:
        out.append(chunk)
    return out


def error_frame(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    error: GatewayError,
    *,
    shape: ErrorFrame,
    fields: tuple[str, ...],
    finish_reason: bool,
) -> dict[str, Any]:
    """The in-band error of SPEC section 6 in a policy's shape
    (:data:`bourse.domain.policy.ErrorFrame`): the error object with ``fields``, at the
    top level beside the chunk's identity (``chunk``), alone (``envelope``) or with the
    id (``envelope_id``); ``finish_reason`` adds a choice that ends with ``"error"``."""
    envelope = error.envelope()
    match shape:
        case "chunk":
            frame: dict[str, Any] = {"id": request_id, "object": CHAT_CHUNK if kind == "chat" else TEXT,
                                     "created": created, "model": model}  # fmt: skip
        case "envelope" | "envelope_id":
            frame = {}
        case _:  # the config admits no other word; one that got past it is refused, named
            assert_never(shape)
    if finish_reason:
        piece: dict[str, Any] = {"delta": {}} if kind == "chat" else {"text": ""}
        frame["choices"] = [{"index": 0, **piece, "finish_reason": "error"}]
    frame["error"] = {k: envelope[k] for k in fields if k in envelope}
    if shape == "envelope_id":
        frame["id"] = request_id
    return frame
