"""The ``openai`` engine: any OpenAI-compatible HTTP upstream (vLLM, llama.cpp, SGLang, Ollama, ...).

Owns the upstream side of the relay: one pooled HTTP client per deployment, the
request it sends (the gateway's body, always streamed with usage), the mapping of
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
import random
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import orjson

from bourse.ports.engine import ChunkEvent, EngineEvent, EngineFailure, GenerationRequest, UsageEvent

__all__ = ["OpenAIHTTPEngine"]

_DONE = b"[DONE]"
_MESSAGE_MAX = 300
_MAX_SHARDS = 64
_PER_SHARD = 64
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


class OpenAIHTTPEngine:
    """An engine that streams from ``{base_url}/chat/completions`` or ``/completions``.

    ``first_byte_timeout_s`` bounds the wait from sending the request to the first
    bytes of the answer body (a failure there is transient); ``read_timeout_s``
    bounds each silence after that.
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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        base = base_url.rstrip("/")
        self._chat_url = base + "/chat/completions"
        self._completion_url = base + "/completions"
        self._model = model
        self._api_key = api_key or None
        self._first_byte_timeout_s = first_byte_timeout_s
        self._read_timeout_s = read_timeout_s
        headers = {
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            "content-type": "application/json",
        }
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        # httpcore scans every connection of a pool when it assigns a request, so one
        # pool of thousands of streams costs O(n) per request. The connections are
        # spread over shards instead (a request takes the less busy of two random
        # shards), keeping each scan short.
        shards = 1 if transport is not None else max(1, min(_MAX_SHARDS, max_connections // _PER_SHARD))
        per_shard = max(1, -(-max_connections // shards))
        self._clients = [
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(
                    connect=connect_timeout_s,
                    read=read_timeout_s,
                    write=read_timeout_s,
                    pool=first_byte_timeout_s,
                ),
                limits=httpx.Limits(
                    max_connections=per_shard,
                    max_keepalive_connections=per_shard,
                    keepalive_expiry=30.0,
                ),
                transport=transport,
                trust_env=False,
            )
            for _ in range(shards)
        ]
        self._client = self._clients[0]
        self._busy = [0] * shards
        self._rng = random.Random()

    def _shard(self) -> int:
        n = len(self._clients)
        if n == 1:
            return 0
        a, b = self._rng.randrange(n), self._rng.randrange(n)
        return a if self._busy[a] <= self._busy[b] else b

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

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

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        body = dict(request.body)
        body["model"] = self._model
        body["stream"] = True
        options = body.get("stream_options")
        body["stream_options"] = (
            {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
        )
        url = self._chat_url if request.kind == "chat" else self._completion_url
        shard = self._shard()
        client = self._clients[shard]
        http_request = client.build_request(
            "POST",
            url,
            content=orjson.dumps(body),
            headers={"x-request-id": request.request_id, "x-bourse-attempt": str(request.attempt)},
        )
        response: httpx.Response | None = None
        pieces: AsyncIterator[bytes] | None = None
        self._busy[shard] += 1
        try:
            # Phase 1, nothing yielded: connect, status, first body bytes. All transient.
            buffer = b""
            try:
                async with asyncio.timeout(self._first_byte_timeout_s):
                    response = await client.send(http_request, stream=True)
                    if not 200 <= response.status_code < 300:
                        content = await response.aread()
                        raise self._status_failure(response.status_code, content)
                    pieces = response.aiter_bytes()
                    buffer = await anext(pieces, b"")
            except TimeoutError:
                raise EngineFailure(
                    f"upstream sent nothing within {self._first_byte_timeout_s:g}s", transient=True
                ) from None
            except httpx.TimeoutException as exc:
                raise EngineFailure(f"upstream timed out ({type(exc).__name__})", transient=True) from None
            except httpx.HTTPError as exc:
                raise EngineFailure(
                    self._scrub(f"upstream unreachable ({type(exc).__name__}: {exc})"), transient=True
                ) from None

            # Phase 2: parse SSE events and relay each chunk as it comes.
            assert response is not None and pieces is not None
            output_began = False
            done = False
            eof = not buffer
            if eof:
                buffer = b"\n\n"
            usage: dict[str, Any] | None = None
            data: list[bytes] = []
            while True:
                lines = buffer.split(b"\n")
                buffer = lines.pop()
                for line in lines:
                    if line[-1:] == b"\r":
                        line = line[:-1]
                    if line:
                        if line[:5] == b"data:":
                            data.append(line[6:] if line[5:6] == b" " else line[5:])
                        continue  # comments and other fields are ignored
                    if not data:
                        continue
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    data.clear()
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
                            raise self._stream_failure(chunk, output_began=output_began)
                        if "usage" in chunk:
                            chunk_usage = chunk.pop("usage")
                            if isinstance(chunk_usage, dict):
                                usage = chunk_usage
                        choices = chunk.get("choices")
                        tokens = _carries_tokens(choices) if choices else 0
                    except (orjson.JSONDecodeError, TypeError, AttributeError):
                        raise EngineFailure(
                            "upstream sent a malformed stream chunk", transient=not output_began
                        ) from None
                    if choices:
                        output_began = True
                        yield ChunkEvent(chunk, tokens)
                if eof:
                    break
                try:
                    piece = await anext(pieces, None)
                except httpx.ReadTimeout:
                    raise EngineFailure(
                        f"upstream went silent for {self._read_timeout_s:g}s", transient=not output_began
                    ) from None
                except httpx.HTTPError as exc:
                    raise EngineFailure(
                        self._scrub(f"upstream stream broke ({type(exc).__name__})"),
                        transient=not output_began,
                    ) from None
                if piece is None:
                    eof = True
                    buffer += b"\n\n"
                else:
                    buffer = buffer + piece if buffer else piece

            if not done:
                if output_began:
                    raise EngineFailure("upstream closed the stream early", transient=False)
                raise EngineFailure("upstream closed the stream before any output", transient=True)
            # Fully read: closing now returns the connection to the pool.
            await response.aclose()
            if usage is not None:
                yield _usage_event(usage)
        finally:
            self._busy[shard] -= 1
            if pieces is not None:
                aclose = getattr(pieces, "aclose", None)
                if aclose is not None:
                    await aclose()
            if response is not None:
                await response.aclose()


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
