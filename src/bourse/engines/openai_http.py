"""The ``openai`` engine: any OpenAI-compatible HTTP upstream (vLLM, llama.cpp, SGLang, Ollama, ...).

Owns the upstream side of the relay: one pooled HTTP client per deployment (aiohttp), the
request it sends (the gateway's body, streamed with usage when the client streams; for
a client that asked for one answer, one non-streamed upstream answer, handed on as one
chunk whose ``delta`` is the message, then its usage), the mapping of
upstream statuses and error envelopes to :class:`EngineFailure` (transient before
any output for connect errors, timeouts, 5xx and 429; a refusal such as a context
length error is final), and a small SSE parser on the hot path that hands each
upstream chunk on as it arrives and turns the upstream's usage chunk into a
:class:`UsageEvent`. Closing the generator closes the upstream response, so the
upstream sees its connection go away and aborts the generation.

The API key is sent only as a header; it never appears in a failure message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import orjson
import yarl

from bourse.ports.engine import ChunkEvent, EngineEvent, EngineFailure, GenerationRequest, UsageEvent

__all__ = ["OpenAIHTTPEngine"]

_DONE = b"[DONE]"
_MESSAGE_MAX = 300
_TRANSIENT_CLIENT_STATUSES = frozenset({401, 403, 404, 408, 429})
"""4xx answers that say the deployment is wrong or busy, not that the request is."""


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


class _SSEPayloads:
    """The ``data`` payloads of an SSE byte stream, fed in pieces of any size.

    Lines end in LF or CRLF; ``data:`` lines of one event are joined by LF; comments
    and other fields are ignored; an event ends at a blank line.
    """

    __slots__ = ("_buffer", "_data")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, piece: bytes) -> list[bytes]:
        buffer = self._buffer + piece if self._buffer else piece
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if line[-1:] == b"\r":
                line = line[:-1]
            if line:
                if line[:5] == b"data:":
                    data.append(line[6:] if line[5:6] == b" " else line[5:])
                continue  # comments and other fields are ignored
            if data:
                out.append(data[0] if len(data) == 1 else b"\n".join(data))
                data.clear()
        return out

    def end(self) -> list[bytes]:
        """The end of the stream: an event not yet ended by a blank line counts."""
        return self.feed(b"\n\n")


class OpenAIHTTPEngine:
    """An engine that streams from ``{base_url}/chat/completions`` or ``/completions``,
    or, for a request that is not streamed (``GenerationRequest.stream`` false) and
    when ``unary`` is on, asks there for one non-streamed answer.

    The HTTP client is one :class:`aiohttp.ClientSession` (its C HTTP parser, one
    keep-alive connection pool of up to ``max_connections``), made on first use inside
    the running event loop. ``first_byte_timeout_s`` bounds the wait from sending the
    request to the first bytes of the answer body, including the wait for a free
    connection (a failure there is transient); ``read_timeout_s`` bounds each silence
    after that. A non-streamed answer arrives only once it is generated: its wait
    (connection, request, the whole answer) is bounded by the larger of the two, and a
    failure or timeout before it is complete is transient (no output was relayed), so
    the gateway requeues it.
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
    ) -> None:
        base = base_url.rstrip("/")
        self._chat_url = yarl.URL(base + "/chat/completions")
        self._completion_url = yarl.URL(base + "/completions")
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

    def _open_session(self) -> aiohttp.ClientSession:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=0, keepalive_timeout=30.0
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

    def _scrub(self, text: str) -> str:
        text = text if len(text) <= _MESSAGE_MAX else text[: _MESSAGE_MAX - 3] + "..."
        if self._api_key and self._api_key in text:
            text = text.replace(self._api_key, "***")
        return text

    def _status_failure(self, status: int, content: bytes) -> EngineFailure:
        try:
            parsed: object = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = content.decode("utf-8", "replace").strip()
        message, code, error_type = _error_details(parsed)
        if status >= 500 or status < 400 or status in _TRANSIENT_CLIENT_STATUSES:
            detail = f": {message}" if message else ""
            return EngineFailure(self._scrub(f"upstream answered HTTP {status}{detail}"), transient=True)
        return EngineFailure(
            self._scrub(message or f"upstream refused the request (HTTP {status})"),
            transient=False,
            status=400,
            code=_refusal_code(message, code, error_type),
            error_type="invalid_request_error",
        )

    def _stream_failure(self, error: object, *, output_began: bool) -> EngineFailure:
        message, code, error_type = _error_details(error)
        message = self._scrub(message or "upstream reported an error")
        if not output_began and _is_refusal(error, code, error_type):
            return EngineFailure(
                message,
                transient=False,
                status=400,
                code=_refusal_code(message, code, error_type),
                error_type="invalid_request_error",
            )
        return EngineFailure(f"upstream error: {message}", transient=not output_began)

    def _early_failure(self, exc: BaseException, waited: str) -> EngineFailure:
        """A failure before any output (connect, status, first bytes): always transient."""
        if isinstance(exc, aiohttp.ServerTimeoutError):  # also a TimeoutError: checked first
            return EngineFailure(f"upstream timed out ({type(exc).__name__})", transient=True)
        if isinstance(exc, TimeoutError):
            return EngineFailure(f"upstream sent {waited}", transient=True)
        return EngineFailure(
            self._scrub(f"upstream unreachable ({type(exc).__name__}: {exc})"), transient=True
        )

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        if not request.stream and self._unary:
            return self._answer(request)
        return self._stream(request)

    async def _answer(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """One non-streamed upstream answer, as one chunk (``delta`` = the message) and its usage."""
        body = {k: v for k, v in request.body.items() if k != "stream_options"}
        body["model"] = self._model
        body["stream"] = False
        chat = request.kind == "chat"
        url = self._chat_url if chat else self._completion_url
        session = self._session or self._open_session()
        response: aiohttp.ClientResponse | None = None
        released = False
        try:
            try:
                async with asyncio.timeout(self._answer_timeout_s):
                    response = await session.post(
                        url,
                        data=orjson.dumps(body),
                        headers={
                            "accept": "application/json",
                            "x-request-id": request.request_id,
                            "x-bourse-attempt": str(request.attempt),
                        },
                    )
                    content = await response.read()
                    response.release()
                    released = True
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise self._early_failure(exc, f"no answer within {self._answer_timeout_s:g}s") from None
            if not 200 <= response.status < 300:
                raise self._status_failure(response.status, content)
            try:
                doc = orjson.loads(content)
                if not isinstance(doc, dict):
                    raise TypeError
                if doc.get("error") is not None or doc.get("object") == "error":
                    raise self._stream_failure(doc, output_began=False)
                usage = doc.pop("usage", None)
                choices = doc.get("choices")
                tokens = _answer_chunk(doc, chat) if choices else 0
            except (orjson.JSONDecodeError, TypeError, AttributeError, KeyError):
                raise EngineFailure("upstream sent a malformed answer", transient=True) from None
            usage_event = _usage_event(usage) if isinstance(usage, dict) else None
            if choices:
                if usage_event is not None and usage_event.completion_tokens > 0:
                    tokens = usage_event.completion_tokens
                yield ChunkEvent(doc, tokens)
            if usage_event is not None:
                yield usage_event
        finally:
            if response is not None and not released:
                response.close()

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        body = request.body
        options = body.get("stream_options")
        if not (
            body.get("stream") is True
            and body.get("model") == self._model
            and isinstance(options, dict)
            and options.get("include_usage") is True
        ):  # the gateway sends it so; anything else gets a copy with these set
            body = dict(body)
            body["model"] = self._model
            body["stream"] = True
            body["stream_options"] = (
                {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
            )
        url = self._chat_url if request.kind == "chat" else self._completion_url
        session = self._session or self._open_session()
        response: aiohttp.ClientResponse | None = None
        released = False
        try:
            # Phase 1, nothing yielded: connect, status, first body bytes. All transient.
            try:
                async with asyncio.timeout(self._first_byte_timeout_s):
                    response = await session.post(
                        url,
                        data=orjson.dumps(body),
                        headers={
                            "x-request-id": request.request_id,
                            "x-bourse-attempt": str(request.attempt),
                        },
                    )
                    if not 200 <= response.status < 300:
                        content = await response.read()
                        response.release()
                        released = True
                        raise self._status_failure(response.status, content)
                    piece = await response.content.readany()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise self._early_failure(exc, f"nothing within {self._first_byte_timeout_s:g}s") from None

            # Phase 2: parse SSE events and relay each chunk as it comes.
            content_stream = response.content
            parser = _SSEPayloads()
            output_began = False
            done = False
            usage: dict[str, Any] | None = None
            while True:
                payloads = parser.feed(piece) if piece else parser.end()
                # the chunks of one read are yielded one behind, so that each but the
                # last says ``more``: the relay writes chunks that arrived together at once
                ready: ChunkEvent | None = None
                for payload in payloads:
                    if done:
                        continue
                    if payload == _DONE:
                        done = True
                        continue
                    try:
                        chunk = orjson.loads(payload)
                        if not isinstance(chunk, dict):
                            raise TypeError
                        if chunk.get("error") is not None or chunk.get("object") == "error":
                            failure = self._stream_failure(chunk, output_began=output_began)
                        else:
                            failure = None
                            if "usage" in chunk:
                                chunk_usage = chunk.pop("usage")
                                if isinstance(chunk_usage, dict):
                                    usage = chunk_usage
                            choices = chunk.get("choices")
                            tokens = _carries_tokens(choices) if choices else 0
                    except (orjson.JSONDecodeError, TypeError, AttributeError):
                        failure = EngineFailure(
                            "upstream sent a malformed stream chunk", transient=not output_began
                        )
                    if failure is not None:
                        if ready is not None:
                            yield ready
                        raise failure
                    if choices:
                        output_began = True
                        if ready is not None:
                            ready.more = True
                            yield ready
                        ready = ChunkEvent(chunk, tokens)
                if ready is not None:
                    yield ready
                if not piece:
                    break
                try:
                    piece = await content_stream.readany()
                except aiohttp.ServerTimeoutError:
                    raise EngineFailure(
                        f"upstream went silent for {self._read_timeout_s:g}s", transient=not output_began
                    ) from None
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise EngineFailure(
                        self._scrub(f"upstream stream broke ({type(exc).__name__})"),
                        transient=not output_began,
                    ) from None

            if not done:
                if output_began:
                    raise EngineFailure("upstream closed the stream early", transient=False)
                raise EngineFailure("upstream closed the stream before any output", transient=True)
            # Fully read: releasing now returns the connection to the pool.
            response.release()
            released = True
            if usage is not None:
                yield _usage_event(usage)
        finally:
            if response is not None and not released:
                # not read to its end (closed early, cancelled, failed): drop the
                # connection, so the upstream sees it go and stops generating
                response.close()


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
        raise EngineFailure("upstream sent a malformed usage block", transient=False) from None
    details = {
        k: v for k, v in usage.items() if k not in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    return UsageEvent(prompt, completion, details)
