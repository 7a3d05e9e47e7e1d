"""The reading of an OpenAI-compatible upstream's answers, on the hot path.

A stream's parse step (:class:`StreamParse`) hands each upstream chunk on as it arrives
(the project's SSE parser), keeps the upstream's usage aside, and at the end (its
finish step) checks that it said ``[DONE]``, after a ``finish_reason`` if output began
(else the generation was interrupted); :class:`CountingParse` also counts the chunks
that carry tokens (for an upstream that sends no usage), :class:`StopParse` applies the
request's stop strings itself, :class:`ResponsesParse` reads an upstream that speaks the
Responses API. :func:`parse_answer` reads a non-streamed answer as one chunk. An answer
nested deeper than the gateway writes is refused as it arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from bourse.ports.engine import ChunkEvent, EngineFailure, UsageEvent
from bourse.wire.requests import MAX_JSON_DEPTH_CEILING, nests_deeper
from bourse.wire.responses import UpstreamEvents
from bourse.wire.sse import SSEParser
from bourse.wire.stops import StopStrings

_DONE = b"[DONE]"
MAX_TOKEN_COUNT = 2**53 - 1
"""The largest token count an upstream's usage may give (JSON's safe integers): a count
past it, or a negative one, is a malformed usage block, never a charge or an answer
the gateway could not write (orjson writes no integer past 64 bits)."""


_TEXTS = frozenset({"content", "refusal", "reasoning_content", "reasoning"})
"""A delta's (a message's) text fields: the gateway joins their fragments."""


def _is(value: object, kind: type) -> bool:
    """None, or exactly of ``kind`` (orjson makes exact types: no bool for an int)."""
    return value is None or type(value) is kind


def check_choices(choices: object) -> None:
    """TypeError unless every field of ``choices`` that the gateway reads and folds into
    its own answer (a choice's ``finish_reason`` and ``text``, a delta's texts, its tool
    calls' ``index``, ``id``, ``type``, ``name`` and ``arguments``) has the type the API
    gives it (or is null). Checked as the upstream's answer arrives, before anything of
    it is relayed or counted: an answer the gateway could not fold (and would charge
    for, then fail to write) is the upstream's malformed answer instead."""
    if choices is not None:
        read_choices(choices)


CARRIES_TOKENS, FINISHED = 1, 2
"""What :func:`read_choices` found in a chunk's choices (bits)."""


def read_choices(choices: object) -> int:
    """:func:`check_choices`'s checks of a chunk's (non-null) ``choices``, and in the
    same pass what the parse step wants of them: :data:`CARRIES_TOKENS` if a choice
    carries generated text, reasoning or tool-call fragments (a delta's ``content``,
    ``reasoning_content``, ``reasoning`` or ``tool_calls``, or a choice's ``text``
    when it has no delta), :data:`FINISHED` if one has a ``finish_reason``.

    Per chunk of every stream: one call and one pass over a choice's fields, where a
    check, a count of the tokens and a search for the ``finish_reason`` each walked
    them (each a call, and a generator for the search)."""
    if type(choices) is not list:
        raise TypeError
    found = 0
    for choice in choices:
        if type(choice) is not dict:
            raise TypeError
        reason, text, delta = choice.get("finish_reason"), choice.get("text"), choice.get("delta")
        if reason is not None:
            if type(reason) is not str:
                raise TypeError
            if reason:
                found |= FINISHED
        if text is not None and type(text) is not str:
            raise TypeError
        if delta is None:
            if text:
                found |= CARRIES_TOKENS
            continue
        found |= _read_delta(delta)
    return found


def _read_delta(delta: object) -> int:
    """:func:`read_choices` of one choice's delta: its checks, and :data:`CARRIES_TOKENS`
    if it carries any text but a refusal, or tool-call fragments."""
    if type(delta) is not dict:
        raise TypeError
    found = 0
    for field, value in delta.items():
        if value is None:
            continue
        if field in _TEXTS:
            if type(value) is not str:
                raise TypeError
            if value and field != "refusal":
                found = CARRIES_TOKENS
        elif field == "tool_calls":
            _check_calls(value)
            if value:
                found = CARRIES_TOKENS
    return found


def _check_calls(calls: object) -> None:
    if type(calls) is not list:
        raise TypeError
    for call in calls:
        if type(call) is not dict or not _is(call.get("index"), int):
            raise TypeError
        fn = call.get("function")
        if not (_is(call.get("id"), str) and _is(call.get("type"), str) and _is(fn, dict)):
            raise TypeError
        if fn is not None and not (_is(fn.get("name"), str) and _is(fn.get("arguments"), str)):
            raise TypeError


def _too_deep(transient: bool) -> EngineFailure:
    """An upstream answer nested deeper than anything the gateway writes: refused as it
    arrives, before it is relayed or counted (orjson could not write it to the client,
    which would then get a broken answer it was charged for)."""
    return EngineFailure(
        f"upstream sent JSON nested deeper than {MAX_JSON_DEPTH_CEILING} levels",
        transient=transient, kind="malformed",
    )  # fmt: skip


class StreamParse:
    """The parse step of one upstream stream: each read's SSE payloads into chunk events.

    It keeps what the finish step needs: whether ``[DONE]`` came, whether output began
    (a failure after that is final), whether a choice ended with a ``finish_reason``
    (``[DONE]`` after output without one is an interrupted generation) and the
    upstream's usage, popped off the chunk that carried it. An upstream error or a
    malformed chunk ends a read's events and is kept in ``failure`` for the caller to
    raise once those events are relayed.
    """

    __slots__ = ("_failure_of", "_sse", "cut", "done", "failure", "finished", "output_began", "usage")

    def __init__(self, failure_of: Callable[[object, bool], EngineFailure]) -> None:
        self._sse = SSEParser()
        self._failure_of = failure_of
        self.done = False
        self.cut = False
        """The gateway ended the answer itself (a stop string, :class:`StopParse`): the
        upstream is still generating, so its connection is dropped, not reused."""
        self.finished = False
        """A choice came with its ``finish_reason``."""
        self.output_began = False
        self.usage: dict[str, Any] | None = None
        self.failure: EngineFailure | None = None

    def events(self, piece: bytes) -> list[ChunkEvent]:
        """The chunk events of one read (``b""`` at the end of the stream). All but the
        last say ``more``: the relay may write chunks that arrived together at once."""
        out: list[ChunkEvent] = []
        if self.done:
            return out  # anything after [DONE] is ignored
        for payload in self._sse.payloads(piece) if piece else self._sse.end():
            if payload == _DONE:
                self.done = True
                break
            event = self._event(payload)
            if event is not None:
                if out:
                    out[-1].more = True
                out.append(event)
                if self.done:  # cut by the gateway (StopParse): nothing after it counts
                    break
            elif self.failure is not None:
                break
        return out

    def _event(self, payload: bytes) -> ChunkEvent | None:
        """One payload's chunk event; None for a chunk without choices (the usage
        chunk) or, with ``failure`` set, for an error."""
        try:
            chunk = orjson.loads(payload)
            if not isinstance(chunk, dict):
                raise TypeError
            if nests_deeper(payload, chunk, MAX_JSON_DEPTH_CEILING):
                self.failure = _too_deep(not self.output_began)
                return None
            if chunk.get("error") is not None or chunk.get("object") == "error":
                self.failure = self._failure_of(chunk, self.output_began)
                return None
            if "usage" in chunk:
                usage = chunk.pop("usage")
                if isinstance(usage, dict):
                    self.usage = usage
            choices = chunk.get("choices")
            if not choices:
                return None
            found = read_choices(choices)
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            self.failure = EngineFailure(
                "upstream sent a malformed stream chunk", transient=not self.output_began, kind="malformed"
            )
            return None
        if found & FINISHED:
            self.finished = True
        self.output_began = True
        return ChunkEvent(chunk, found & CARRIES_TOKENS)

    def finish(self) -> UsageEvent | None:
        """The finish step, at the end of the stream: it must have said ``[DONE]``, after
        a ``finish_reason`` if output began (an engine that stops a generation to serve
        another, as llama-cpp-python's ``interrupt_requests`` does, sends ``[DONE]``
        without one: the answer is cut short, not complete); its usage. A stream closed
        empty, without ``[DONE]``, is kind ``empty``: transient, unless the run finds the
        prompt over the engine's context (llama-cpp-python's answer to such a prompt)."""
        if not self.done:
            if self.output_began:
                raise EngineFailure("upstream closed the stream early", transient=False, kind="stream")
            raise EngineFailure("upstream closed the stream before any output", transient=True, kind="empty")
        if self.output_began and not self.finished:
            raise EngineFailure(
                "upstream ended the stream without a finish_reason: the generation was interrupted "
                "(the engine stopped it, e.g. to serve another request) and the answer is incomplete",
                transient=False,
                kind="interrupted",
            )
        return None if self.usage is None else _usage_event(self.usage)


class CountingParse(StreamParse):
    """The parse step of a deployment that counts tokens itself (it has a counter):
    also the stream's token-carrying chunks, for when the upstream sends no usage."""

    __slots__ = ("tokens",)

    def __init__(self, failure_of: Callable[[object, bool], EngineFailure]) -> None:
        super().__init__(failure_of)
        self.tokens = 0

    def _event(self, payload: bytes) -> ChunkEvent | None:
        event = super()._event(payload)
        if event is not None:
            self.tokens += event.tokens
        return event


class StopParse(CountingParse):
    """The parse step of a counted stream whose request's stop strings the gateway
    applies itself (they were not sent upstream): an engine that never streams the
    token completing a stop string still counts it, so only a stream that carries
    every token can be counted as the engine counts. Text that may begin a stop string
    is held back; at the first match the text is cut before it, the chunk that
    completed it (counted) ends the answer with ``finish_reason: "stop"``, and the
    stream is done (``cut``: the caller drops the upstream connection, so the engine
    stops generating). One choice only (``n`` of 1)."""

    __slots__ = ("_bare", "_field", "_stops")

    def __init__(
        self, failure_of: Callable[[object, bool], EngineFailure], stops: list[str], chat: bool
    ) -> None:
        super().__init__(failure_of)
        self._stops = StopStrings(stops)
        self._field = "content" if chat else "text"
        self._bare = (self._field, "index", "finish_reason")
        """The keys of a piece that carries only text (a held one may then be dropped)."""

    def _event(self, payload: bytes) -> ChunkEvent | None:
        event = super()._event(payload)
        if event is None:
            return None
        choice = event.chunk["choices"][0]
        part = choice.get("delta") if self._field == "content" else choice
        if not isinstance(part, dict):
            return event
        text = part.get(self._field)
        shown, stopped = self._stops.push(text) if isinstance(text, str) else ("", False)
        if stopped:
            choice["finish_reason"] = "stop"
            self.finished = self.done = self.cut = True
        elif choice.get("finish_reason"):
            shown += self._stops.flush()  # the answer ended without completing a stop string
        elif text and not shown and not any(v for k, v in part.items() if k not in self._bare):
            return None  # all of it held back (may begin a stop string); counted all the same
        if isinstance(text, str) or shown:
            part[self._field] = shown
        return event


class ResponsesParse(StreamParse):
    """The parse step of an upstream that speaks the Responses API: its typed events as
    chat chunks (:class:`~bourse.wire.responses.UpstreamEvents`); the stream is done at
    ``response.completed`` (or ``.incomplete``), and ``response.failed`` or an ``error``
    event is the upstream's failure."""

    __slots__ = ("_upstream",)

    def __init__(self, failure_of: Callable[[object, bool], EngineFailure]) -> None:
        super().__init__(failure_of)
        self._upstream = UpstreamEvents()

    def _event(self, payload: bytes) -> ChunkEvent | None:
        up = self._upstream
        try:
            event = orjson.loads(payload)
            if not isinstance(event, dict):
                raise TypeError
            if nests_deeper(payload, event, MAX_JSON_DEPTH_CEILING):
                self.failure = _too_deep(not self.output_began)
                return None
            chunk = up.chunk(event)
            found = 0 if chunk is None else read_choices(chunk["choices"])
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            self.failure = EngineFailure("upstream sent a malformed event", transient=not self.output_began)
            return None
        if up.error is not None:
            self.failure = self._failure_of({"error": up.error}, self.output_began)
            return None
        self.done = self.finished = up.done  # response.completed / .incomplete end the answer
        if up.usage is not None:
            self.usage = up.usage
        if chunk is None:
            return None
        self.output_began = True
        return ChunkEvent(chunk, found & CARRIES_TOKENS)


def parse_answer(
    content: bytes, chat: bool, failure_of: Callable[[object, bool], EngineFailure]
) -> tuple[ChunkEvent | None, UsageEvent | None]:
    """A non-streamed answer as a chunk event (None without choices) and its usage.
    The chunk's token count is the upstream's completion tokens, else an estimate;
    ``failure_of`` gives the failure of an error envelope."""
    try:
        doc = orjson.loads(content)
        if not isinstance(doc, dict):
            raise TypeError
        if nests_deeper(content, doc, MAX_JSON_DEPTH_CEILING):
            raise _too_deep(True)
        if doc.get("error") is not None or doc.get("object") == "error":
            raise failure_of(doc, False)
        usage = doc.pop("usage", None)
        choices = doc.get("choices")
        if choices:
            _answer_chunk(doc, choices, chat)
            check_choices(choices)
    except (orjson.JSONDecodeError, TypeError, AttributeError, KeyError):
        raise EngineFailure("upstream sent a malformed answer", transient=True, kind="malformed") from None
    usage_event = _usage_event(usage) if isinstance(usage, dict) else None
    if not choices:
        return None, usage_event
    if usage_event is not None and usage_event.completion_tokens > 0:
        tokens = usage_event.completion_tokens
    else:  # estimated only when the upstream does not say (its choices' types checked above)
        tokens = _estimate(choices, chat)
    return ChunkEvent(doc, tokens), usage_event


def _answer_chunk(doc: dict[str, Any], choices: Any, chat: bool) -> None:
    """Turn a non-streamed answer into a stream chunk in place: each chat choice's
    ``message`` becomes its ``delta``; tool calls get their ``index``."""
    if not chat:
        return
    doc["object"] = "chat.completion.chunk"
    for choice in choices:
        message = choice.pop("message", None) or {}
        choice["delta"] = message
        calls = message.get("tool_calls")
        if calls:
            for i, call in enumerate(calls):
                call.setdefault("index", i)


def _estimate(choices: list[dict[str, Any]], chat: bool) -> int:
    """An estimate of the completion tokens an answer's (checked) choices carry: UTF-8
    bytes / 4, for an upstream that gives no usage."""
    nbytes = 0
    for choice in choices:
        if chat:
            delta = choice["delta"]
            for key in ("content", "reasoning_content", "reasoning", "refusal"):
                text = delta.get(key)
                if isinstance(text, str):
                    nbytes += len(text.encode())
            for call in delta.get("tool_calls") or ():
                nbytes += len(str((call.get("function") or {}).get("arguments") or "").encode())
        else:
            text = choice.get("text")
            if isinstance(text, str):
                nbytes += len(text.encode())
    return nbytes // 4 + 1 if nbytes else 0


def _usage_event(usage: dict[str, Any]) -> UsageEvent:
    try:
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        if not (0 <= prompt <= MAX_TOKEN_COUNT and 0 <= completion <= MAX_TOKEN_COUNT):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise EngineFailure(
            "upstream sent a malformed usage block", transient=False, kind="malformed"
        ) from None
    details = {
        k: v for k, v in usage.items() if k not in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return UsageEvent(prompt, completion, details)
