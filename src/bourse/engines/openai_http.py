"""The ``openai`` engine: any OpenAI-compatible HTTP upstream (vLLM, llama.cpp, SGLang, Ollama, ...).

Owns the upstream side of the relay: one pooled HTTP client per deployment (aiohttp), the
request it sends (the gateway's body, streamed with usage when the client streams; for
a client that asked for one answer, one non-streamed upstream answer, handed on as one
chunk whose ``delta`` is the message, then its usage), the mapping of
upstream statuses and error envelopes to :class:`EngineFailure` (transient before
any output for connect errors, timeouts, 5xx and 429, except a non-streamed answer
that the upstream ran and failed, 500 or 502, or did not give in time: it may still
be running it; a refusal such as a context length error, however it is worded, is
final), and the stream's three steps: connect (send, status, first
bytes), parse (the project's SSE parser, on the hot path, hands each upstream chunk on
as it arrives and keeps the upstream's usage aside) and finish (``[DONE]`` seen, after
a ``finish_reason`` if output began, else the generation was interrupted; the usage
as a :class:`UsageEvent`: the upstream's, or, when it sent none and the deployment has
a counter (:mod:`bourse.engines.upstream_tokens`), the engine's own counts). Closing
the generator closes the upstream response, so the upstream sees its connection go
away and aborts the generation.

The API key is sent only as a header; it never appears in a failure message.

Its upstream's flavour (:mod:`bourse.engines.flavors`: configured, or found by the first
probe that reaches it) decides the ``x-request-id`` sent. :meth:`OpenAIHTTPEngine.probe`
checks the upstream (health, its model list) and reads its capacity; a 404 from the
generation route, or refused credentials, is a configuration error: the deployment's
:class:`~bourse.domain.availability.Availability` is marked (as a failed probe would)
and the failure is one the breaker does not count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import yarl

from bourse.domain.availability import Availability
from bourse.engines import flavors
from bourse.engines.upstream_reads import lean
from bourse.engines.upstream_tokens import TokenCounts
from bourse.ports.engine import (
    ChunkEvent,
    Engine,
    EngineEvent,
    EngineFailure,
    GenerationRequest,
    Kind,
    Probe,
    UsageEvent,
)
from bourse.wire.requests import MAX_JSON_DEPTH_CEILING, nests_deeper
from bourse.wire.responses import UpstreamEvents, upstream_request
from bourse.wire.sse import SSEParser
from bourse.wire.stops import StopStrings, stop_list

__all__ = ["OpenAIHTTPEngine"]

log = logging.getLogger("bourse.engines")

_DONE = b"[DONE]"
_MESSAGE_MAX = 300
_TRANSIENT_CLIENT_STATUSES = frozenset({401, 403, 404, 408, 429})
"""4xx answers that say the deployment is wrong or busy, not that the request is."""
_CONFIG_STATUSES = frozenset({401, 403, 404})
"""Answers that say the deployment is set up wrong (its URL, its credentials, its model
name): a configuration error, marked on the deployment's availability."""
_BODY_LOGGED = 300
_MISROUTE_HOLD_S = 60.0
"""A deployment whose generation route answered 404 (or refused the credentials) stays
unavailable this long, though its probes pass: a probe cannot try that route without
generating. Then one request tries it again."""
_FAILED_ANSWER_STATUSES = frozenset({500, 502})
"""Answers to a non-streamed request that say the upstream ran the generation and it
failed, perhaps after some output: final, as a failure after output is in a stream
(the ``sim`` engine answers the same at once). 503, 504 and 429 say that it did not
run it (busy, unavailable, timed out): transient."""


def _error_details(error: object) -> tuple[str, str | None, str | None]:
    """(message, code, type) from an OpenAI error object, or a vLLM/llama.cpp variant."""
    if isinstance(error, dict):
        inner = error.get("error")
        if isinstance(inner, dict):
            error = inner
        elif isinstance(inner, str):
            return inner, None, None
        message = error.get("message")
        if message is None and "detail" in error:
            message = error["detail"]
        code = error.get("code")
        error_type = error.get("type")
        return (
            str(message) if message is not None else "",
            code if isinstance(code, str) and code else None,
            error_type if isinstance(error_type, str) else None,
        )
    if isinstance(error, str):
        return error, None, None
    return "", None, None


def _refusal_code(message: str, code: str | None, error_type: str | None) -> str:
    if code:
        return code
    if error_type == "exceed_context_size_error" or _says_context(message):
        return "context_length_exceeded"
    return "invalid_request"


_CONTEXT_WORDS = ("context length", "context_length", "context window", "context size")
"""How engines word a prompt over their context: vLLM's "maximum context length",
llama-server's "exceeds the available context size", llama-cpp-python's "maximum
context length", an OpenAI-like ``context_length_exceeded``."""


def _says_context(message: str) -> bool:
    lowered = message.lower()
    return any(w in lowered for w in _CONTEXT_WORDS)


def _is_refusal(error: object, code: str | None, error_type: str | None, message: str = "") -> bool:
    """An in-stream error that says the request itself is wrong (retrying won't help):
    by its code or type, or by its words when it says the prompt is over the context."""
    if code == "context_length_exceeded" or error_type in (
        "invalid_request_error",
        "exceed_context_size_error",
    ):
        return True
    if _says_context(message):
        return True
    if isinstance(error, dict):
        inner = error.get("error", error)
        status = inner.get("code") if isinstance(inner, dict) else None
        if isinstance(status, int) and 400 <= status < 500 and status not in _TRANSIENT_CLIENT_STATUSES:
            return True
    return False


def _carries_tokens(choices: list[Any]) -> int:
    """1 if any choice carries generated text, reasoning or tool-call fragments, else 0."""
    for choice in choices:
        delta = choice.get("delta")
        if delta is not None:
            if (
                delta.get("content")
                or delta.get("reasoning_content")
                or delta.get("reasoning")
                or delta.get("tool_calls")
            ):
                return 1
        elif choice.get("text"):
            return 1
    return 0


def _too_deep(transient: bool) -> EngineFailure:
    """An upstream answer nested deeper than anything the gateway writes: refused as it
    arrives, before it is relayed or counted (orjson could not write it to the client,
    which would then get a broken answer it was charged for)."""
    return EngineFailure(
        f"upstream sent JSON nested deeper than {MAX_JSON_DEPTH_CEILING} levels",
        transient=transient, kind="malformed",
    )  # fmt: skip


class _StreamParse:
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
        """The gateway ended the answer itself (a stop string, :class:`_StopParse`): the
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
                if self.done:  # cut by the gateway (_StopParse): nothing after it counts
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
            if not self.finished:
                self.finished = any(c.get("finish_reason") for c in choices)
            tokens = _carries_tokens(choices)
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            self.failure = EngineFailure(
                "upstream sent a malformed stream chunk", transient=not self.output_began, kind="malformed"
            )
            return None
        self.output_began = True
        return ChunkEvent(chunk, tokens)

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


class _CountingParse(_StreamParse):
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


class _StopParse(_CountingParse):
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


class _ResponsesParse(_StreamParse):
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
        return ChunkEvent(chunk, _carries_tokens(chunk["choices"]))


class OpenAIHTTPEngine(Engine):
    """An engine that streams from ``{base_url}/chat/completions`` or ``/completions``,
    or, for a request that is not streamed (``GenerationRequest.stream`` false) and
    when ``unary`` is on, asks there for one non-streamed answer.

    The HTTP client is one :class:`aiohttp.ClientSession` (its C HTTP parser, one
    keep-alive connection pool of up to ``max_connections``), made on first use inside
    the running event loop. ``first_byte_timeout_s`` bounds the wait from sending the
    request to the first bytes of the answer body, including the wait for a free
    connection (a failure there is transient); ``read_timeout_s`` bounds each silence
    after that. A non-streamed answer arrives only once it is generated: its wait
    (connection, request, the whole answer) is bounded by the larger of the two; a
    connection failure, a timeout or an upstream that says it did not run the request
    (429, 503, ...) is transient (no output was relayed), so the gateway requeues it,
    while an upstream that ran it and failed (500, 502) is final, as the failure of a
    stream after output is.

    It has nothing to load: the port's defaults for ``start``, ``loaded`` and
    ``broken`` apply (an unreachable upstream shows per request, as a transient failure).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        connect_timeout_s: float = 5,
        first_byte_timeout_s: float = 60,
        read_timeout_s: float = 300,
        max_connections: int = 4096,
        unary: bool = True,
        name: str = "openai",
        api: str = "chat",
        flavor: str = "auto",
        availability: Availability | None = None,
        tokens: TokenCounts | None = None,
    ) -> None:
        self.name = name
        """The deployment's name (its failures are logged by the observer, which names it too)."""
        base = base_url.rstrip("/")
        self._base = base
        self._root = flavors.root_of(base)
        self._path = yarl.URL(base).path.rstrip("/")
        """The base URL's path (reasons name it, never the host: clients may read them)."""
        self._flavor = flavor
        """``auto`` until a probe reaches the upstream and finds what it is."""
        self.availability = availability
        """The deployment's availability, marked on a configuration error (None: probes off)."""
        self._probe_timeout_s = connect_timeout_s + min(10.0, first_byte_timeout_s)
        self._misrouted: tuple[str, float] | None = None
        """(reason, monotonic time) of the last configuration error a request met."""
        self._chat_url = yarl.URL(base + "/chat/completions")
        self._completion_url = yarl.URL(base + "/completions")
        self._responses_url = yarl.URL(base + "/responses")
        self._api = api
        """``chat``, or ``responses``: the upstream speaks the Responses API (chat requests
        are sent there, translated; their answers come back as chat chunks)."""
        self._model = model
        self._api_key = api_key or None
        self._connect_timeout_s = connect_timeout_s
        self._first_byte_timeout_s = first_byte_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._whole = unary and api != "responses"
        """A request that is not streamed gets one unary upstream call (``_answer``):
        ``unary`` (not ``always_stream``) on the chat API. The Responses API is always
        read as a stream (its events become chat chunks), so a request there is never
        answered whole, and its gaps are timed by the stall clock."""
        self._answer_timeout_s = max(first_byte_timeout_s, read_timeout_s)
        headers = {
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            "content-type": "application/json",
        }
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        self._headers = headers
        self._session: aiohttp.ClientSession | None = None
        self._tokens = tokens
        """The engine's own token counts (None: it has none; a stream without usage is
        then charged the gateway's estimate)."""
        self._upstream_counts = False
        """True once the upstream has sent usage on a stream: from then on the streams
        are parsed without counting their chunks (no cost for an upstream that counts)."""
        self._warned_estimate = False

    async def start(self) -> None:
        """Load the counter's tokenizer, if there is one (off the event loop)."""
        if self._tokens is not None:
            await self._tokens.start()

    @property
    def context_length(self) -> int:
        """The upstream's context (``TokenCounter``), 0 when not known."""
        return (self._tokens.context_length if self._tokens is not None else None) or 0

    async def count_prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        """The prompt's tokens as the upstream counts them (``TokenCounter``); None when
        the counter is not ready or the upstream's context is not known, so that the
        gateway's pre-check falls back on its byte bound."""
        tokens = self._tokens
        if tokens is None or not tokens.ready or not tokens.context_length:
            return None
        return await tokens.prompt_tokens(kind, body)

    @property
    def flavor(self) -> str:
        """The upstream's flavour: configured, or probed (``auto`` until found)."""
        return self._flavor

    @property
    def upstream(self) -> str:
        """The server's root URL (deployments on one server share it; never shown to clients)."""
        return self._root

    @property
    def answers_whole(self) -> bool:
        """A non-streamed request is one unary upstream call, bounded by the answer
        timeout: on the chat API unless ``always_stream``; never on the Responses API."""
        return self._whole

    def _open_session(self) -> aiohttp.ClientSession:
        self._session = aiohttp.ClientSession(
            connector=lean(
                aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0, keepalive_timeout=30.0)
            ),
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self._connect_timeout_s, sock_read=self._read_timeout_s
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("user-agent",),
            trust_env=False,
        )
        return self._session

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        if self._tokens is not None:
            await self._tokens.aclose()

    def _scrub(self, text: str) -> str:
        text = text if len(text) <= _MESSAGE_MAX else text[: _MESSAGE_MAX - 3] + "..."
        if self._api_key and self._api_key in text:
            text = text.replace(self._api_key, "***")
        return text

    def _status_failure(self, status: int, content: bytes, *, answer: bool = False) -> EngineFailure:
        """The failure an error status says; ``answer``: the request asked for one
        non-streamed answer (see ``_FAILED_ANSWER_STATUSES``)."""
        try:
            parsed: object = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = content.decode("utf-8", "replace").strip()
        message, code, error_type = _error_details(parsed)
        if status in _CONFIG_STATUSES:
            return self._config_failure(status, message)
        if answer and status in _FAILED_ANSWER_STATUSES:
            detail = f": {message}" if message else ""
            return EngineFailure(
                self._scrub(f"upstream failed the answer (HTTP {status}){detail}"),
                transient=False,
                kind="status",
            )
        if status >= 500 or status < 400 or status in _TRANSIENT_CLIENT_STATUSES:
            detail = f": {message}" if message else ""
            return EngineFailure(
                self._scrub(f"upstream answered HTTP {status}{detail}"), transient=True, kind="status"
            )
        refusal = _refusal_code(message, code, error_type)
        if refusal != "context_length_exceeded" and error_type != "invalid_request_error":
            # not plainly the request's fault (an empty body, a header it refuses): the operator's
            log.warning(
                "deployment %s: the upstream refused a request: HTTP %d, body %s",
                self.name, status, self._scrub(repr(content[:_BODY_LOGGED])),
            )  # fmt: skip
        return EngineFailure(
            self._scrub(message or f"upstream refused the request (HTTP {status})"),
            transient=False,
            status=400,
            code=refusal,
            error_type="invalid_request_error",
            kind="refused",
        )

    def _config_failure(self, status: int, message: str) -> EngineFailure:
        """A 404 from the generation route (a wrong ``base_url``, a model the upstream does
        not serve) or refused credentials: the deployment is set up wrong. It is marked
        unavailable until a probe passes; the failure is transient (another deployment may
        serve the request) and not counted by the breaker (the deployment is unavailable)."""
        detail = f": {message}" if message else ""
        if status == 404:
            reason = (
                f"the upstream answered HTTP 404 to a generation request{detail}; check base_url "
                "(it usually ends in /v1), api and model"
            )
        else:
            reason = f"the upstream refused bourse's credentials (HTTP {status}{detail}); check api_key_env"
        reason = self._scrub(reason)
        self._misrouted = (reason, time.monotonic())
        if self.availability is not None:
            self.availability.fail(reason)  # its on_change logs the change
        return EngineFailure(reason, transient=True, status=503, code="no_capacity", kind="config")

    def _stream_failure(self, error: object, output_began: bool) -> EngineFailure:
        message, code, error_type = _error_details(error)
        message = self._scrub(message or "upstream reported an error")
        if not output_began and _is_refusal(error, code, error_type, message):
            return EngineFailure(
                message,
                transient=False,
                status=400,
                code=_refusal_code(message, code, error_type),
                error_type="invalid_request_error",
                kind="refused",
            )
        return EngineFailure(f"upstream error: {message}", transient=not output_began, kind="stream")

    @staticmethod
    def _answer_timeout(timeout_s: float) -> EngineFailure:
        """A non-streamed request sent and not answered in time: final. The upstream may
        still be generating it (an engine does not stop a non-streamed generation when
        its client goes), so sending it again would run it twice on the same engine."""
        return EngineFailure(
            f"upstream did not answer within {timeout_s:g}s; the request was not sent again "
            "(the engine may still be running it)",
            transient=False,
            status=504,
            code="upstream_timeout",
            error_type="timeout_error",
            kind="timeout",
        )

    def _early_failure(self, exc: BaseException, waited: str) -> EngineFailure:
        """A failure before any output (connect, status, first bytes): always transient.
        Not logged here: the run reports it to the observer, whose WARNING line names the
        deployment and the failure's kind."""
        if isinstance(exc, aiohttp.ServerTimeoutError):  # also a TimeoutError: checked first
            return EngineFailure(f"upstream timed out ({type(exc).__name__})", transient=True, kind="timeout")
        if isinstance(exc, TimeoutError):
            return EngineFailure(f"upstream sent {waited}", transient=True, kind="timeout")
        return EngineFailure(
            self._scrub(f"upstream unreachable ({type(exc).__name__}: {exc})"), transient=True, kind="connect"
        )

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        if not request.stream and self._whole:
            return self._answer(request)
        return self._stream(request)

    def _post(
        self, request: GenerationRequest, body: dict[str, Any], *, json: bool
    ) -> Awaitable[aiohttp.ClientResponse]:
        """Send ``body`` to the request kind's URL; ``json``: ask for a JSON answer, not a
        stream. The caller awaits aiohttp's request itself (no coroutine of ours between:
        each of the request's suspensions would resume it)."""
        headers = {
            "x-request-id": flavors.request_id_header(self._flavor, request.request_id),
            "x-bourse-attempt": str(request.attempt),
        }
        if request.traceparent is not None:
            headers["traceparent"] = request.traceparent
        if json:
            headers["accept"] = "application/json"
        if self._api == "responses":
            url = self._responses_url
        else:
            url = self._chat_url if request.kind == "chat" else self._completion_url
        session = self._session or self._open_session()
        return session.post(url, data=orjson.dumps(body), headers=headers)

    async def _answer(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """One non-streamed upstream answer, as one chunk (``delta`` = the message) and its usage."""
        body = {k: v for k, v in request.body.items() if k != "stream_options"}
        body["model"] = self._model
        body["stream"] = False
        response, content = await self._connect(request, body, json=True)
        response.release()  # read to its end: the connection goes back to the pool
        chunk, usage = self._parse_answer(content, request.kind == "chat")
        if chunk is not None:
            yield chunk
        if usage is not None:
            yield usage

    def _parse_answer(self, content: bytes, chat: bool) -> tuple[ChunkEvent | None, UsageEvent | None]:
        """A non-streamed answer as a chunk event (None without choices) and its usage.
        The chunk's token count is the upstream's completion tokens, else an estimate."""
        try:
            doc = orjson.loads(content)
            if not isinstance(doc, dict):
                raise TypeError
            if nests_deeper(content, doc, MAX_JSON_DEPTH_CEILING):
                raise _too_deep(True)
            if doc.get("error") is not None or doc.get("object") == "error":
                raise self._stream_failure(doc, False)
            usage = doc.pop("usage", None)
            tokens = _answer_chunk(doc, chat) if doc.get("choices") else None
        except (orjson.JSONDecodeError, TypeError, AttributeError, KeyError):
            raise EngineFailure(
                "upstream sent a malformed answer", transient=True, kind="malformed"
            ) from None
        usage_event = _usage_event(usage) if isinstance(usage, dict) else None
        if tokens is None:
            return None, usage_event
        if usage_event is not None and usage_event.completion_tokens > 0:
            tokens = usage_event.completion_tokens
        return ChunkEvent(doc, tokens), usage_event

    def _stream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body to stream: the gateway's as it is when it already asks this model
        for a stream with usage (it does), else a copy with those set."""
        options = body.get("stream_options")
        if (
            body.get("stream") is True
            and body.get("model") == self._model
            and isinstance(options, dict)
            and options.get("include_usage") is True
        ):
            return body
        options = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
        return {**body, "model": self._model, "stream": True, "stream_options": options}

    async def _connect(
        self, request: GenerationRequest, body: dict[str, Any], *, json: bool
    ) -> tuple[aiohttp.ClientResponse, bytes]:
        """The connect step, nothing yielded yet: send ``body``, check the status, then
        read the first body bytes of a stream, or the whole answer (``json``). Bounded by
        ``first_byte_timeout_s`` (a stream) or the answer's timeout; every failure is
        transient, and closes the response."""
        timeout_s = self._answer_timeout_s if json else self._first_byte_timeout_s
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._post(request, body, json=json)
                if not 200 <= response.status < 300:
                    raise self._status_failure(response.status, await response.read(), answer=json)
                return response, await (response.read() if json else response.content.readany())
        except BaseException as exc:
            if response is not None:
                response.close()  # (an error answer, read to its end, is already back in the pool)
            if json and isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise self._answer_timeout(timeout_s) from None
            if isinstance(exc, TimeoutError | aiohttp.ClientError):
                waited = f"no answer within {timeout_s:g}s" if json else f"nothing within {timeout_s:g}s"
                raise self._early_failure(exc, waited) from None
            raise

    def _stream_parts(self, request: GenerationRequest) -> tuple[dict[str, Any], _StreamParse]:
        """The body to stream upstream and the parse step for its answer, by the upstream's API."""
        if self._api != "responses":
            body = self._stream_body(request.body)
            stops = stop_list(body.get("stop")) if self._counting() else []
            if stops and body.get("n", 1) == 1:
                body = {k: v for k, v in body.items() if k != "stop"}  # applied here: see _StopParse
                return body, _StopParse(self._stream_failure, stops, request.kind == "chat")
            return body, self._chat_parse()
        if request.kind != "chat":
            raise EngineFailure(
                "this deployment's upstream speaks the Responses API: legacy completions are not served",
                transient=False, status=400, code="invalid_request", error_type="invalid_request_error",
            )  # fmt: skip
        return upstream_request(request.body, self._model), _ResponsesParse(self._stream_failure)

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """Connect, then relay each read's chunks as they come (the parse step), then the
        usage once the stream has ended well (the finish step)."""
        body, parse = self._stream_parts(request)
        response, piece = await self._connect(request, body, json=False)
        try:
            while True:
                for event in parse.events(piece):
                    yield event
                if parse.failure is not None:
                    raise parse.failure
                if not piece or parse.cut:
                    break
                try:
                    piece = await response.content.readany()
                except aiohttp.ServerTimeoutError:
                    silent = f"upstream went silent for {self._read_timeout_s:g}s"
                    raise EngineFailure(silent, transient=not parse.output_began, kind="timeout") from None
                except (aiohttp.ClientError, TimeoutError) as exc:
                    broke = self._scrub(f"upstream stream broke ({type(exc).__name__})")
                    raise EngineFailure(broke, transient=not parse.output_began, kind="stream") from None
        except BaseException:
            # not read to its end (closed early, cancelled, failed): drop the connection,
            # so the upstream sees it go and stops generating
            response.close()
            raise
        if parse.done and not parse.cut:
            response.release()  # read to its end: the connection goes back to the pool
        else:  # cut by a stop string, or closed without [DONE] (llama-cpp-python then closes it too)
            response.close()
        usage = parse.finish()
        if usage is None or not self._upstream_counts:
            usage = await self._own_usage(request, parse, usage)
        if usage is not None:
            yield usage

    # -- probes ---------------------------------------------------------------------

    async def _fetch(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        session = self._session or self._open_session()
        async with asyncio.timeout(self._probe_timeout_s):
            async with session.request(
                method, url, data=body, headers={"accept": "application/json"}
            ) as response:
                return response.status, await response.read()

    async def probe(self) -> Probe:
        """Find the flavour (``auto``, once the upstream answers), check that the upstream
        serves this deployment's model, read what it says of its capacity. Never raises."""
        try:
            if self._flavor == "auto":
                self._flavor = await flavors.detect(self._fetch, self._root)
            self._warn_uncounted()
            reason, listing = await self._check()
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason, listing = self._unreachable(exc), None
        if reason is not None:
            return Probe(self._scrub(reason), self._flavor)
        cap = await flavors.read_capacity(self._fetch, self._root, self._flavor)
        context = cap.context_length or flavors.context_of(listing, self._model)
        return Probe(None, self._flavor, cap.slots, cap.waiting, context)

    def _warn_uncounted(self) -> None:
        """Once, as soon as the flavour is known: a WARNING naming the deployment when its
        server sends no usage on streams and the deployment has no tokenizer to count
        with (its streams are then charged the gateway's estimate, ``usage_estimated``)."""
        if self._warned_estimate or self._tokens is not None:
            return
        if flavors.sends_stream_usage(self._flavor) is False:
            self._warned_estimate = True
            log.warning(
                "%s: its upstream (%s) sends no usage on streams and the deployment has no tokenizer: "
                "streams are charged the gateway's estimate (usage_estimated); set tokenizer to the "
                "GGUF the server runs for its own counts (docs/engines.md)",
                self.name, self._flavor,
            )  # fmt: skip

    def _unreachable(self, exc: BaseException) -> str:
        """A probe's transport failure, in one line (no address)."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"the upstream did not accept a connection within {self._connect_timeout_s:g} s"
        if isinstance(exc, aiohttp.ClientConnectorError):
            errno = exc.os_error.errno  # its strerror names the address: the errno's words only
            cause = os.strerror(errno) if errno else type(exc.os_error).__name__
            return f"the upstream is unreachable ({cause})"
        if isinstance(exc, TimeoutError):
            return f"the upstream did not answer a probe within {self._probe_timeout_s:g} s"
        return f"the upstream is unreachable ({type(exc).__name__})"

    async def _check(self) -> tuple[str | None, object]:
        """(why the upstream cannot serve this deployment or None, its model listing)."""
        if self._misrouted is not None:
            reason, at = self._misrouted
            if time.monotonic() - at < _MISROUTE_HOLD_S:
                return reason, None
            self._misrouted = None
        if self._flavor == "llama.cpp":
            status, _ = await self._fetch("GET", self._root + "/health", None)
            if status != 200:
                loading = " (loading its model)" if status == 503 else ""
                return f"its health check answered HTTP {status}{loading}", None
        models = f"{self._path}/models"
        status, content = await self._fetch("GET", self._base + "/models", None)
        if status == 404:
            return f"GET {models} answered 404: is base_url right (it usually ends in /v1)?", None
        if status in (401, 403):
            return f"the upstream refused bourse's credentials (HTTP {status}); check api_key_env", None
        if status != 200:
            return f"GET {models} answered HTTP {status}", None
        try:
            listing: object = orjson.loads(content)
        except orjson.JSONDecodeError:
            return f"GET {models} answered something other than JSON", None
        served = flavors.served_models(listing)
        if self._model in served:
            return None, listing
        # a server that serves any name says so for the name itself (GET /models/{id})
        one = self._base + "/models/" + urllib.parse.quote(self._model, safe="")
        if (await self._fetch("GET", one, None))[0] == 200:
            return None, listing
        shown = ", ".join(repr(m) for m in served[:5]) or "none"
        return f"the upstream does not serve the model {self._model!r} (it lists {shown})", listing

    def _chat_parse(self) -> _StreamParse:
        """The parse step of a chat or completion stream: counting its chunks while the
        engine has a counter and the upstream has not yet shown that it counts itself."""
        return (_CountingParse if self._counting() else _StreamParse)(self._stream_failure)

    def _counting(self) -> bool:
        """Whether this deployment counts its streams itself: it has a counter and its
        upstream has not shown that it counts them."""
        return self._tokens is not None and not self._upstream_counts

    async def _own_usage(
        self, request: GenerationRequest, parse: _StreamParse, usage: UsageEvent | None
    ) -> UsageEvent | None:
        """The usage of a stream that ended well: the upstream's (noting that it counts),
        else the engine's own counts; None (the gateway's estimate, ``usage_estimated``)
        when it has no counter that can tell."""
        if usage is not None:
            self._upstream_counts = True
            return usage
        tokens = self._tokens
        prompt = None
        if tokens is not None and tokens.ready and isinstance(parse, _CountingParse):
            prompt = await tokens.prompt_tokens(request.kind, request.body)
        if prompt is None:
            if not self._warned_estimate:
                self._warned_estimate = True
                log.warning(
                    "%s: the upstream sent no usage on a stream and bourse has no tokenizer loaded "
                    "for it (the deployment's tokenizer): streams are charged the gateway's estimate "
                    "(usage_estimated)",
                    self.name,
                )
            return None
        assert tokens is not None and isinstance(parse, _CountingParse)
        return UsageEvent(prompt, tokens.completion_tokens(parse.tokens))


def _answer_chunk(doc: dict[str, Any], chat: bool) -> int:
    """Turn a non-streamed answer into a stream chunk in place (each chat choice's
    ``message`` becomes its ``delta``; tool calls get their ``index``); returns an
    estimate of the completion tokens it carries (UTF-8 bytes / 4), for when the
    upstream gives no usage."""
    nbytes = 0
    for choice in doc["choices"]:
        if chat:
            doc["object"] = "chat.completion.chunk"
            message = choice.pop("message", None) or {}
            choice["delta"] = message
            for key in ("content", "reasoning_content", "reasoning", "refusal"):
                text = message.get(key)
                if isinstance(text, str):
                    nbytes += len(text.encode())
            calls = message.get("tool_calls")
            if calls:
                for i, call in enumerate(calls):
                    call.setdefault("index", i)
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
    except (TypeError, ValueError):
        raise EngineFailure(
            "upstream sent a malformed usage block", transient=False, kind="malformed"
        ) from None
    details = {
        k: v for k, v in usage.items() if k not in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return UsageEvent(prompt, completion, details)
