"""The ``openai`` engine: any OpenAI-compatible HTTP upstream (vLLM, llama.cpp, SGLang, Ollama, ...).

Owns the upstream side of the relay: one pooled HTTP client per deployment (aiohttp), the
request it sends (the gateway's body, streamed with usage when the client streams; for
a client that asked for one answer, one non-streamed upstream answer, handed on as one
chunk whose ``delta`` is the message, then its usage), the mapping of
upstream statuses and error envelopes to :class:`EngineFailure` (transient before
any output for connect errors, timeouts, 5xx and 429, except a non-streamed answer
that the upstream ran and failed, 500 or 502; a refusal such as a context length
error is final), and the stream's three steps: connect (send, status, first
bytes), parse (the project's SSE parser, on the hot path, hands each upstream chunk on
as it arrives and keeps the upstream's usage aside) and finish (``[DONE]`` seen, the
usage as a :class:`UsageEvent`: the upstream's, or, when it sent none and the
deployment has a counter (:mod:`bourse.engines.upstream_tokens`), the engine's own
counts). Closing the generator closes the upstream response, so the upstream sees its
connection go away and aborts the generation.

The API key is sent only as a header; it never appears in a failure message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import yarl

from bourse.engines.upstream_reads import lean
from bourse.engines.upstream_tokens import TokenCounts
from bourse.ports.engine import (
    ChunkEvent,
    Engine,
    EngineEvent,
    EngineFailure,
    GenerationRequest,
    Kind,
    UsageEvent,
)
from bourse.wire.responses import UpstreamEvents, upstream_request
from bourse.wire.sse import SSEParser

__all__ = ["OpenAIHTTPEngine"]

log = logging.getLogger("bourse.engines")


_DONE = b"[DONE]"
_MESSAGE_MAX = 300
_TRANSIENT_CLIENT_STATUSES = frozenset({401, 403, 404, 408, 429})
"""4xx answers that say the deployment is wrong or busy, not that the request is."""
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
    lowered = message.lower()
    if (
        error_type == "exceed_context_size_error"
        or "context length" in lowered
        or "context_length" in lowered
    ):
        return "context_length_exceeded"
    return "invalid_request"


def _is_refusal(error: object, code: str | None, error_type: str | None) -> bool:
    """An in-stream error that says the request itself is wrong (retrying won't help)."""
    if code == "context_length_exceeded" or error_type in (
        "invalid_request_error",
        "exceed_context_size_error",
    ):
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


class _StreamParse:
    """The parse step of one upstream stream: each read's SSE payloads into chunk events.

    It keeps what the finish step needs: whether ``[DONE]`` came, whether output began
    (a failure after that is final) and the upstream's usage, popped off the chunk that
    carried it. An upstream error or a malformed chunk ends a read's events and is kept
    in ``failure`` for the caller to raise once those events are relayed.
    """

    __slots__ = ("_failure_of", "_sse", "done", "failure", "output_began", "usage")

    def __init__(self, failure_of: Callable[[object, bool], EngineFailure]) -> None:
        self._sse = SSEParser()
        self._failure_of = failure_of
        self.done = False
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
            tokens = _carries_tokens(choices)
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            self.failure = EngineFailure(
                "upstream sent a malformed stream chunk", transient=not self.output_began, kind="malformed"
            )
            return None
        self.output_began = True
        return ChunkEvent(chunk, tokens)

    def finish(self) -> UsageEvent | None:
        """The finish step, at the end of the stream: it must have said ``[DONE]``; its usage."""
        if not self.done:
            if self.output_began:
                raise EngineFailure("upstream closed the stream early", transient=False, kind="stream")
            raise EngineFailure("upstream closed the stream before any output", transient=True, kind="stream")
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
            chunk = up.chunk(event)
        except (orjson.JSONDecodeError, TypeError, AttributeError):
            self.failure = EngineFailure("upstream sent a malformed event", transient=not self.output_began)
            return None
        if up.error is not None:
            self.failure = self._failure_of({"error": up.error}, self.output_began)
            return None
        self.done = up.done
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
        tokens: TokenCounts | None = None,
    ) -> None:
        self.name = name
        """The deployment's name (its failures are logged by the observer, which names it too)."""
        base = base_url.rstrip("/")
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
        self._unary = unary
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
    def answers_whole(self) -> bool:
        """A non-streamed request is one unary upstream call, bounded by the answer timeout."""
        return self._unary

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
        return EngineFailure(
            self._scrub(message or f"upstream refused the request (HTTP {status})"),
            transient=False,
            status=400,
            code=_refusal_code(message, code, error_type),
            error_type="invalid_request_error",
            kind="refused",
        )

    def _stream_failure(self, error: object, output_began: bool) -> EngineFailure:
        message, code, error_type = _error_details(error)
        message = self._scrub(message or "upstream reported an error")
        if not output_began and _is_refusal(error, code, error_type):
            return EngineFailure(
                message,
                transient=False,
                status=400,
                code=_refusal_code(message, code, error_type),
                error_type="invalid_request_error",
                kind="refused",
            )
        return EngineFailure(f"upstream error: {message}", transient=not output_began, kind="stream")

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
        if self._api == "responses":
            return self._stream(request)
        if not request.stream and self._unary:
            return self._answer(request)
        return self._stream(request)

    def _post(
        self, request: GenerationRequest, body: dict[str, Any], *, json: bool
    ) -> Awaitable[aiohttp.ClientResponse]:
        """Send ``body`` to the request kind's URL; ``json``: ask for a JSON answer, not a
        stream. The caller awaits aiohttp's request itself (no coroutine of ours between:
        each of the request's suspensions would resume it)."""
        headers = {"x-bourse-attempt": str(request.attempt)}  # i34 stop-gap: no x-request-id
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
            if isinstance(exc, TimeoutError | aiohttp.ClientError):
                waited = f"no answer within {timeout_s:g}s" if json else f"nothing within {timeout_s:g}s"
                raise self._early_failure(exc, waited) from None
            raise

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """Connect, then relay each read's chunks as they come (the parse step), then the
        usage once the stream has ended well (the finish step)."""
        parse: _StreamParse
        if self._api == "responses":
            if request.kind != "chat":
                raise EngineFailure(
                    "this deployment's upstream speaks the Responses API: legacy completions are not served",
                    transient=False, status=400, code="invalid_request", error_type="invalid_request_error",
                )  # fmt: skip
            body, parse = upstream_request(request.body, self._model), _ResponsesParse(self._stream_failure)
        else:
            body, parse = self._stream_body(request.body), self._chat_parse()
        response, piece = await self._connect(request, body, json=False)
        try:
            while True:
                for event in parse.events(piece):
                    yield event
                if parse.failure is not None:
                    raise parse.failure
                if not piece:
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
        response.release()  # read to its end: the connection goes back to the pool
        usage = parse.finish()
        if usage is None or not self._upstream_counts:
            usage = await self._own_usage(request, parse, usage)
        if usage is not None:
            yield usage

    def _chat_parse(self) -> _StreamParse:
        """The parse step of a chat or completion stream: counting its chunks while the
        engine has a counter and the upstream has not yet shown that it counts itself."""
        counting = self._tokens is not None and not self._upstream_counts
        return (_CountingParse if counting else _StreamParse)(self._stream_failure)

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
