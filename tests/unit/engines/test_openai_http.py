"""The openai engine against the sim upstream over a real socket, and against faked transports."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import httpx
import orjson
import pytest
from tests.support.servers import serve_app_in_thread

from bourse.engines.openai_http import OpenAIHTTPEngine
from bourse.engines.sim import SimEngine, SimSettings
from bourse.engines.sim_server import create_sim_app
from bourse.ports.engine import ChunkEvent, Engine, EngineFailure, GenerationRequest, Kind, UsageEvent

pytestmark = pytest.mark.anyio

SECRET = "sk-test-SECRET-0123456789"
CHAT = {
    "model": "sim",
    "messages": [{"role": "user", "content": "tell me a story"}],
    "seed": 5,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_app_in_thread(create_sim_app(SimSettings())) as url:
        yield url


def _request(
    body: dict[str, Any], kind: Kind = "chat", attempt: int = 0, request_id: str = "req-7"
) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, kind=kind, body=body, attempt=attempt)


async def _collect(engine: Engine, request: GenerationRequest) -> tuple[list[ChunkEvent], list[UsageEvent]]:
    chunks: list[ChunkEvent] = []
    usages: list[UsageEvent] = []
    async for event in engine.generate(request):
        if isinstance(event, ChunkEvent):
            chunks.append(event)
        else:
            usages.append(event)
    return chunks, usages


def _without_created(chunks: list[ChunkEvent]) -> list[tuple[dict[str, Any], int]]:
    return [({k: v for k, v in c.chunk.items() if k != "created"}, c.tokens) for c in chunks]


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _mock_engine(handler: Callable[[httpx.Request], httpx.Response], **kwargs: Any) -> OpenAIHTTPEngine:
    return OpenAIHTTPEngine(
        "http://upstream.test/v1", "internal-model", SECRET, transport=httpx.MockTransport(handler), **kwargs
    )


def _sse(*payloads: object, done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _chunk(content: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "up-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "internal-model",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
        **extra,
    }


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for at in range(0, len(data), size):
        yield data[at : at + size]


# --- against the sim upstream over a socket ---------------------------------------


@pytest.mark.parametrize("settings", [{}, {"reasoning": True}, {"tool_call": True}])
async def test_relayed_chunks_equal_the_sims(upstream: str, settings: dict[str, Any]) -> None:
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "lookup"}}], "sim": settings}
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    try:
        relayed, usages = await _collect(engine, _request(body))
    finally:
        await engine.aclose()
    direct, direct_usages = await _collect(SimEngine(SimSettings(), "sim-upstream"), _request(body))
    assert _without_created(relayed) == _without_created(direct)
    assert usages == direct_usages
    assert all("usage" not in c.chunk and c.chunk["choices"] for c in relayed)


async def test_completion_kind_is_relayed(upstream: str) -> None:
    body = {"model": "sim", "prompt": "one two three", "seed": 3}
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    try:
        relayed, usages = await _collect(engine, _request(body, kind="completion"))
    finally:
        await engine.aclose()
    direct, _ = await _collect(SimEngine(SimSettings(), "sim-upstream"), _request(body, kind="completion"))
    assert _without_created(relayed) == _without_created(direct)
    assert usages[0].prompt_tokens == 4


async def test_usage_event_arrives_and_the_usage_chunk_is_not_relayed(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    body = {**CHAT, "stream_options": {"include_usage": False}, "sim": {"output_tokens": 7}}
    try:
        chunks, usages = await _collect(engine, _request(body))
    finally:
        await engine.aclose()
    assert len(chunks) == 7
    assert usages == [UsageEvent(prompt_tokens=10, completion_tokens=7, details={})]


async def test_failure_before_output_is_transient_and_attempt_is_sent(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    body = {**CHAT, "sim": {"fail_before_output": 1}}
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(body, attempt=0))
        chunks, _ = await _collect(engine, _request(body, attempt=1))
    finally:
        await engine.aclose()
    failure = info.value
    assert (failure.transient, failure.status, failure.code) == (True, 502, "upstream_error")
    assert "503" in failure.message
    assert "simulated failure before output" in failure.message
    assert chunks


async def test_bad_sim_object_is_a_final_400(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request({**CHAT, "sim": {"ttft_ms": "soon"}}))
    finally:
        await engine.aclose()
    failure = info.value
    assert (failure.transient, failure.status, failure.code, failure.error_type) == (
        False,
        400,
        "invalid_request",
        "invalid_request_error",
    )
    assert failure.message.startswith("sim.ttft_ms: expected a number")


async def test_failure_after_output_is_final(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    received = 0
    try:
        with pytest.raises(EngineFailure) as info:
            async for event in engine.generate(_request({**CHAT, "sim": {"fail_after_tokens": 3}})):
                assert isinstance(event, ChunkEvent)
                received += 1
    finally:
        await engine.aclose()
    assert received == 3
    assert not info.value.transient
    assert "simulated failure after 3 tokens" in info.value.message


async def test_closing_the_generator_closes_the_upstream(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    async with httpx.AsyncClient(base_url=upstream) as probe:
        await probe.post("/sim/reset")
        try:
            events = engine.generate(_request({**CHAT, "sim": {"output_tokens": 100, "tokens_per_s": 20}}))
            for _ in range(2):
                assert isinstance(await anext(events), ChunkEvent)
            await events.aclose()
            deadline = time.monotonic() + 1.0
            stats = (await probe.get("/sim/stats")).json()
            while stats["cancelled"] != 1 and time.monotonic() < deadline:
                await anyio.sleep(0.02)
                stats = (await probe.get("/sim/stats")).json()
            assert stats == {"started": 1, "completed": 0, "cancelled": 1, "running": 0, "peak_running": 1}
            # The pool still works after a closed connection.
            chunks, _ = await _collect(engine, _request({**CHAT, "sim": {"output_tokens": 2}}))
            assert len(chunks) == 2
        finally:
            await engine.aclose()


async def _wait_cancelled(probe: httpx.AsyncClient) -> dict[str, int]:
    deadline = time.monotonic() + 1.0
    stats: dict[str, int] = (await probe.get("/sim/stats")).json()
    while stats["cancelled"] != 1 and time.monotonic() < deadline:
        await anyio.sleep(0.02)
        stats = (await probe.get("/sim/stats")).json()
    return stats


@pytest.mark.parametrize("stalled", [False, True])
async def test_cancelling_the_consumer_closes_the_upstream(upstream: str, stalled: bool) -> None:
    """A cancel scope around the consumer (as an ASGI server's task group does) reaches the upstream,
    whether the upstream is silent (before the first token) or streaming."""
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    sim = {"ttft_ms": 30000} if stalled else {"output_tokens": 1000, "tokens_per_s": 50}
    async with httpx.AsyncClient(base_url=upstream) as probe:
        await probe.post("/sim/reset")
        try:
            with anyio.move_on_after(0.3):
                await _collect(engine, _request({**CHAT, "sim": sim}))
            assert await _wait_cancelled(probe) == {
                "started": 1,
                "completed": 0,
                "cancelled": 1,
                "running": 0,
                "peak_running": 1,
            }
        finally:
            await engine.aclose()


async def test_first_byte_timeout_is_transient(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream", first_byte_timeout_s=0.1)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request({**CHAT, "sim": {"ttft_ms": 1000}}))
    finally:
        await engine.aclose()
    assert info.value.transient
    assert info.value.status == 502


async def test_read_timeout_mid_stream_is_final(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream", read_timeout_s=0.2)
    received = 0
    try:
        with pytest.raises(EngineFailure) as info:
            async for _ in engine.generate(
                _request({**CHAT, "sim": {"stall_after_tokens": 2, "stall_s": 2}})
            ):
                received += 1
    finally:
        await engine.aclose()
    assert received == 2
    assert not info.value.transient


async def test_connect_refused_is_transient() -> None:
    engine = OpenAIHTTPEngine(f"http://127.0.0.1:{_unused_port()}/v1", "m", SECRET)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.transient
    assert info.value.status == 502
    assert SECRET not in info.value.message


# --- against faked transports -------------------------------------------------------


async def test_request_is_built_without_mutating_the_callers_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=_sse(_chunk("hi", "stop")))

    body = {"model": "product", "messages": [], "stream": False, "stream_options": {"other": 1}}
    original = orjson.loads(orjson.dumps(body))
    engine = _mock_engine(handler)
    try:
        await _collect(engine, _request(body, attempt=2, request_id="req-99"))
        await _collect(engine, _request({"prompt": "x"}, kind="completion"))
    finally:
        await engine.aclose()
    assert body == original
    sent = seen[0]
    assert str(sent.url) == "http://upstream.test/v1/chat/completions"
    assert str(seen[1].url) == "http://upstream.test/v1/completions"
    assert sent.headers["authorization"] == f"Bearer {SECRET}"
    assert sent.headers["x-request-id"] == "req-99"
    assert sent.headers["x-bourse-attempt"] == "2"
    assert sent.headers["accept"] == "text/event-stream"
    assert orjson.loads(sent.content) == {
        "model": "internal-model",
        "messages": [],
        "stream": True,
        "stream_options": {"other": 1, "include_usage": True},
    }


async def test_no_authorization_header_without_a_key() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=_sse(_chunk("hi", "stop")))

    engine = OpenAIHTTPEngine("http://u.test/v1/", "m", transport=httpx.MockTransport(handler))
    try:
        await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert "authorization" not in seen[0].headers
    assert str(seen[0].url) == "http://u.test/v1/chat/completions"


async def test_429_is_transient_502() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        error = {
            "error": {"message": "Rate limit reached for requests", "type": "requests", "code": "rate_limit"}
        }
        return httpx.Response(429, json=error)

    engine = _mock_engine(handler)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    failure = info.value
    assert (failure.transient, failure.status, failure.code) == (True, 502, "upstream_error")
    assert failure.message == "upstream answered HTTP 429: Rate limit reached for requests"


async def test_500_with_a_text_body_is_transient() -> None:
    engine = _mock_engine(lambda request: httpx.Response(500, text="Internal Server Error"))
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.transient
    assert info.value.message == "upstream answered HTTP 500: Internal Server Error"


async def test_400_context_length_is_a_final_refusal() -> None:
    message = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."

    def handler(request: httpx.Request) -> httpx.Response:
        error = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
        return httpx.Response(400, json=error)

    engine = _mock_engine(handler)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    failure = info.value
    assert (failure.transient, failure.status, failure.code, failure.error_type) == (
        False,
        400,
        "context_length_exceeded",
        "invalid_request_error",
    )
    assert failure.message == message


async def test_vllm_style_400_without_a_string_code() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            400,
            json={"object": "error", "message": "maximum context length is 2048 tokens", "code": 400},
        )

    engine = _mock_engine(handler)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.code == "context_length_exceeded"
    assert not info.value.transient


async def test_upstream_auth_failure_is_transient_and_the_key_is_scrubbed() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": f"Incorrect API key provided: {SECRET}"}})

    engine = _mock_engine(handler)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.transient
    assert SECRET not in info.value.message
    assert SECRET not in str(info.value)
    assert "***" in info.value.message


async def test_sse_parsing_is_robust_to_framing() -> None:
    usage_1 = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    usage_2 = {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    stream = (
        b": keep-alive\r\n\r\n"
        + b"data: "
        + orjson.dumps(_chunk("Hel", usage=usage_1))
        + b"\r\n\r\n"
        + b"event: message\ndata:"
        + orjson.dumps(_chunk("lo", "stop", usage=usage_2))
        + b"\n\n"
        + b"data: "
        + orjson.dumps({"id": "up-1", "choices": [], "usage": None})
        + b"\n\n"
        + b"data: [DONE]\n\n"
    )

    for size in (1, 7, len(stream)):

        def handler(request: httpx.Request, size: int = size) -> httpx.Response:
            return httpx.Response(200, content=_pieces(stream, size))

        engine = _mock_engine(handler)
        try:
            chunks, usages = await _collect(engine, _request(CHAT))
        finally:
            await engine.aclose()
        assert [c.chunk["choices"][0]["delta"]["content"] for c in chunks] == ["Hel", "lo"]
        assert all("usage" not in c.chunk for c in chunks)
        assert [c.tokens for c in chunks] == [1, 1]
        assert usages == [UsageEvent(3, 2, {"prompt_tokens_details": {"cached_tokens": 2}})]


async def test_openai_null_usage_on_chunks_is_dropped() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    content = _sse(
        _chunk("a", usage=None), _chunk("", "stop", usage=None), {"id": "x", "choices": [], "usage": usage}
    )
    engine = _mock_engine(lambda request: httpx.Response(200, content=content))
    try:
        chunks, usages = await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert [c.tokens for c in chunks] == [1, 0]
    assert all("usage" not in c.chunk for c in chunks)
    assert usages == [UsageEvent(1, 1, {})]


async def test_missing_usage_yields_no_usage_event() -> None:
    engine = _mock_engine(lambda request: httpx.Response(200, content=_sse(_chunk("a", "stop"))))
    try:
        chunks, usages = await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert len(chunks) == 1
    assert usages == []


async def test_stream_ending_without_done_after_output_is_final() -> None:
    engine = _mock_engine(lambda request: httpx.Response(200, content=_sse(_chunk("a"), done=False)))
    received = 0
    try:
        with pytest.raises(EngineFailure) as info:
            async for _ in engine.generate(_request(CHAT)):
                received += 1
    finally:
        await engine.aclose()
    assert received == 1
    assert not info.value.transient
    assert info.value.message == "upstream closed the stream early"


async def test_empty_stream_is_transient() -> None:
    engine = _mock_engine(lambda request: httpx.Response(200, content=b""))
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.transient


async def test_error_event_before_output_is_transient_and_after_output_final() -> None:
    error = {"error": {"message": "engine overloaded", "type": "server_error", "code": "upstream_error"}}
    before = _mock_engine(lambda request: httpx.Response(200, content=_sse(error, done=False)))
    after = _mock_engine(lambda request: httpx.Response(200, content=_sse(_chunk("a"), error, done=False)))
    try:
        with pytest.raises(EngineFailure) as first:
            await _collect(before, _request(CHAT))
        with pytest.raises(EngineFailure) as second:
            await _collect(after, _request(CHAT))
    finally:
        await before.aclose()
        await after.aclose()
    assert first.value.transient
    assert not second.value.transient
    assert "engine overloaded" in second.value.message


async def test_in_stream_refusal_before_output_is_a_400() -> None:
    error = {"error": {"message": "prompt too long", "type": "invalid_request_error", "code": None}}
    engine = _mock_engine(lambda request: httpx.Response(200, content=_sse(error, done=False)))
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert (info.value.transient, info.value.status, info.value.code) == (False, 400, "invalid_request")


async def test_malformed_chunk_after_output_is_final() -> None:
    content = _sse(_chunk("a"), done=False) + b"data: {not json\n\n"
    engine = _mock_engine(lambda request: httpx.Response(200, content=content))
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert not info.value.transient


async def test_transport_connect_error_is_transient() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    engine = _mock_engine(handler)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.transient
    assert info.value.code == "upstream_error"
