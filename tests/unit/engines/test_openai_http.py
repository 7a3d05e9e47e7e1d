"""The openai engine against the sim upstream over a real socket, and against fake upstreams."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer
from tests.support.servers import serve_app_in_thread

from bourse.engines.openai_http import OpenAIHTTPEngine
from bourse.engines.sim import SimEngine, SimSettings
from bourse.engines.sim_server import create_sim_app
from bourse.ports.engine import ChunkEvent, Engine, EngineFailure, GenerationRequest, Kind, UsageEvent
from bourse.wire.sse import Event, SSEParser

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


@dataclass
class Seen:
    """A request as a fake upstream received it."""

    path: str
    headers: dict[str, str]
    body: bytes


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def _fake(
    handler: Handler,
    *,
    api_key: str | None = SECRET,
    suffix: str = "/v1",
    user: tuple[str, str] | None = None,
    **kwargs: Any,
) -> AsyncIterator[OpenAIHTTPEngine]:
    """An engine pointed at ``handler`` served on a local socket (aiohttp's low-level server);
    ``user``: credentials put in the engine's base URL."""
    server = RawTestServer(handler, host="127.0.0.1")
    await server.start_server()
    url = server.make_url(suffix)
    if user is not None:
        url = url.with_user(user[0]).with_password(user[1])
    engine = OpenAIHTTPEngine(str(url), "internal-model", api_key, **kwargs)
    try:
        yield engine
    finally:
        await engine.aclose()
        await server.close()


def _answer(
    status: int, body: bytes, seen: list[Seen] | None = None, content_type: str = "application/json"
) -> Handler:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        raw = await request.read()
        if seen is not None:
            seen.append(Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, raw))
        ctype = "text/event-stream" if status == 200 else content_type
        return web.Response(status=status, body=body, headers={"content-type": ctype})

    return handler


def _streamed(data: bytes, size: int) -> Handler:
    """A 200 SSE answer written in chunks of ``size`` bytes, each flushed."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for at in range(0, len(data), size):
            await response.write(data[at : at + size])
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    return handler


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
        await _reset_when_idle(probe)
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


async def _reset_when_idle(probe: httpx.AsyncClient) -> None:
    """Zero the sim upstream's counts once nothing runs there: an earlier test's abandoned
    generation (a first-byte timeout that did not wait for the upstream) can still be running,
    and its cancellation, counted after the reset, would be read as this test's."""
    deadline = time.monotonic() + 2.0
    for _ in range(200):
        if not (await probe.get("/sim/stats")).json()["running"] or time.monotonic() > deadline:
            break
        await anyio.sleep(0.02)
    stats = (await probe.post("/sim/reset")).json()
    assert stats["running"] == 0, f"the sim upstream still runs an earlier test's generation: {stats}"


async def _wait_cancelled(probe: httpx.AsyncClient) -> dict[str, int]:
    deadline = time.monotonic() + 1.0
    stats: dict[str, int] = (await probe.get("/sim/stats")).json()
    while (stats["cancelled"] != 1 or stats["running"] != 0) and time.monotonic() < deadline:
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
        await _reset_when_idle(probe)
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
    assert info.value.kind == "timeout"


async def test_a_first_byte_timeout_closes_the_upstream(upstream: str) -> None:
    """The wait for the first bytes gives up: the upstream sees the connection go (and stops
    generating) at once, not when it gets round to answering."""
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream", first_byte_timeout_s=0.2)
    async with httpx.AsyncClient(base_url=upstream) as probe:
        await _reset_when_idle(probe)
        try:
            with pytest.raises(EngineFailure) as info:
                await _collect(engine, _request({**CHAT, "sim": {"ttft_ms": 30000}}))
            assert (info.value.transient, info.value.kind) == (True, "timeout")
            assert await _wait_cancelled(probe) == {
                "started": 1,
                "completed": 0,
                "cancelled": 1,
                "running": 0,
                "peak_running": 1,
            }
        finally:
            await engine.aclose()


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
    assert info.value.kind == "timeout"
    assert info.value.message == "upstream went silent for 0.2s"


async def test_connect_refused_is_transient() -> None:
    engine = OpenAIHTTPEngine(f"http://127.0.0.1:{_unused_port()}/v1", "m", SECRET)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
    assert info.value.transient
    assert info.value.status == 502
    assert info.value.kind == "connect"
    assert SECRET not in info.value.message


async def test_proxies_in_the_environment_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The upstream is reached directly, whatever HTTP(S)_PROXY says (here: a closed port)."""
    proxy = f"http://127.0.0.1:{_unused_port()}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    seen: list[Seen] = []
    async with _fake(_answer(200, _sse(_chunk("hi", "stop")), seen)) as engine:
        chunks, _ = await _collect(engine, _request(CHAT))
    assert [c.chunk["choices"][0]["delta"] for c in chunks] == [{"content": "hi"}]
    assert [s.path for s in seen] == ["/v1/chat/completions"]


# --- against fake upstreams (a handler per test, on a real socket) ------------------


async def test_request_is_built_without_mutating_the_callers_body() -> None:
    seen: list[Seen] = []
    body = {"model": "product", "messages": [], "stream": False, "stream_options": {"other": 1}}
    original = orjson.loads(orjson.dumps(body))
    async with _fake(_answer(200, _sse(_chunk("hi", "stop")), seen)) as engine:
        await _collect(engine, _request(body, attempt=2, request_id="req-99"))
        await _collect(engine, _request({"prompt": "x"}, kind="completion"))
    assert body == original
    sent = seen[0]
    assert sent.path == "/v1/chat/completions"
    assert seen[1].path == "/v1/completions"
    assert sent.headers["authorization"] == f"Bearer {SECRET}"
    assert sent.headers["x-request-id"] == "req-99"
    assert sent.headers["x-bourse-attempt"] == "2"
    assert sent.headers["accept"] == "text/event-stream"
    assert sent.headers["content-type"] == "application/json"
    assert orjson.loads(sent.body) == {
        "model": "internal-model",
        "messages": [],
        "stream": True,
        "stream_options": {"other": 1, "include_usage": True},
    }


async def test_no_authorization_header_without_a_key() -> None:
    seen: list[Seen] = []
    async with _fake(_answer(200, _sse(_chunk("hi", "stop")), seen), api_key=None, suffix="/v1/") as engine:
        await _collect(engine, _request(CHAT))
    assert "authorization" not in seen[0].headers
    assert seen[0].path == "/v1/chat/completions"


async def test_429_is_transient_502() -> None:
    error = {
        "error": {"message": "Rate limit reached for requests", "type": "requests", "code": "rate_limit"}
    }
    async with _fake(_answer(429, orjson.dumps(error))) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    failure = info.value
    assert (failure.transient, failure.status, failure.code) == (True, 502, "upstream_error")
    assert failure.message == "upstream answered HTTP 429: Rate limit reached for requests"


async def test_500_with_a_text_body_is_transient() -> None:
    async with _fake(_answer(500, b"Internal Server Error", content_type="text/plain")) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert info.value.transient
    assert info.value.message == "upstream answered HTTP 500: Internal Server Error"


async def test_error_answers_leave_the_pool_usable() -> None:
    answers = [(503, b"busy"), (200, _sse(_chunk("a", "stop")))]

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        status, body = answers.pop(0)
        return web.Response(status=status, body=body)

    async with _fake(handler) as engine:
        with pytest.raises(EngineFailure):
            await _collect(engine, _request(CHAT))
        chunks, _ = await _collect(engine, _request(CHAT))
    assert len(chunks) == 1


async def test_400_context_length_is_a_final_refusal() -> None:
    message = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
    error = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    async with _fake(_answer(400, orjson.dumps(error))) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    failure = info.value
    assert (failure.transient, failure.status, failure.code, failure.error_type) == (
        False,
        400,
        "context_length_exceeded",
        "invalid_request_error",
    )
    assert failure.message == message


async def test_vllm_style_400_without_a_string_code() -> None:
    error = {"object": "error", "message": "maximum context length is 2048 tokens", "code": 400}
    async with _fake(_answer(400, orjson.dumps(error))) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert info.value.code == "context_length_exceeded"
    assert not info.value.transient


async def test_upstream_auth_failure_is_transient_and_the_key_is_scrubbed() -> None:
    error = {"error": {"message": f"Incorrect API key provided: {SECRET}"}}
    async with _fake(_answer(401, orjson.dumps(error))) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert info.value.transient
    assert SECRET not in info.value.message
    assert SECRET not in str(info.value)
    assert "***" in info.value.message


_USAGE_1 = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
_USAGE_2 = {
    "prompt_tokens": 3,
    "completion_tokens": 2,
    "total_tokens": 5,
    "prompt_tokens_details": {"cached_tokens": 2},
}
_FRAMED = (
    b": keep-alive\r\n\r\n"
    + b"data: "
    + orjson.dumps(_chunk("Hel", usage=_USAGE_1))
    + b"\r\n\r\n"
    + b"event: message\ndata:"
    + orjson.dumps(_chunk("lo", "stop", usage=_USAGE_2))
    + b"\n\n"
    + b"data: "
    + orjson.dumps({"id": "up-1", "choices": [], "usage": None})
    + b"\n\n"
    + b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("size", [1, 7, len(_FRAMED)])
def test_sse_payloads_are_robust_to_framing(size: int) -> None:
    parser = SSEParser()
    payloads = [p for at in range(0, len(_FRAMED), size) for p in parser.payloads(_FRAMED[at : at + size])]
    payloads += parser.end()
    assert [orjson.loads(p) if p != b"[DONE]" else p for p in payloads] == [
        _chunk("Hel", usage=_USAGE_1),
        _chunk("lo", "stop", usage=_USAGE_2),
        {"id": "up-1", "choices": [], "usage": None},
        b"[DONE]",
    ]


def test_sse_payloads_join_data_lines_and_end_an_unterminated_event() -> None:
    parser = SSEParser()
    assert parser.payloads(b"data: a\ndata: b\n\n: c\nid: 4\ndata:x") == [b"a\nb"]
    assert parser.end() == [b"x"]


@pytest.mark.parametrize("size", [1, 7, len(_FRAMED)])
def test_sse_events_keep_comments_and_event_names_in_order(size: int) -> None:
    parser = SSEParser()
    events = [e for at in range(0, len(_FRAMED), size) for e in parser.feed(_FRAMED[at : at + size])]
    assert [(e.comment, e.event) for e in events] == [
        ("keep-alive", None),
        (None, None),
        (None, "message"),
        (None, None),
        (None, None),
    ]
    assert [e.data for e in events[1:]] == [
        orjson.dumps(_chunk("Hel", usage=_USAGE_1)).decode(),
        orjson.dumps(_chunk("lo", "stop", usage=_USAGE_2)).decode(),
        orjson.dumps({"id": "up-1", "choices": [], "usage": None}).decode(),
        "[DONE]",
    ]
    assert parser.feed(b"event: ping\n\ndata: \xc3\xa9\r\n\r\n") == [Event(data="é")]  # no data: no event


@pytest.mark.parametrize("size", [7, len(_FRAMED)])
async def test_sse_stream_in_pieces_gives_chunks_and_usage(size: int) -> None:
    async with _fake(_streamed(_FRAMED, size)) as engine:
        chunks, usages = await _collect(engine, _request(CHAT))
    assert [c.chunk["choices"][0]["delta"]["content"] for c in chunks] == ["Hel", "lo"]
    assert all("usage" not in c.chunk for c in chunks)
    assert [c.tokens for c in chunks] == [1, 1]
    assert usages == [UsageEvent(3, 2, {"prompt_tokens_details": {"cached_tokens": 2}})]


async def test_openai_null_usage_on_chunks_is_dropped() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    content = _sse(
        _chunk("a", usage=None), _chunk("", "stop", usage=None), {"id": "x", "choices": [], "usage": usage}
    )
    async with _fake(_answer(200, content)) as engine:
        chunks, usages = await _collect(engine, _request(CHAT))
    assert [c.tokens for c in chunks] == [1, 0]
    assert all("usage" not in c.chunk for c in chunks)
    assert usages == [UsageEvent(1, 1, {})]


async def test_missing_usage_yields_no_usage_event() -> None:
    async with _fake(_answer(200, _sse(_chunk("a", "stop")))) as engine:
        chunks, usages = await _collect(engine, _request(CHAT))
    assert len(chunks) == 1
    assert usages == []


async def test_stream_ending_without_done_after_output_is_final() -> None:
    received = 0
    async with _fake(_answer(200, _sse(_chunk("a"), done=False))) as engine:
        with pytest.raises(EngineFailure) as info:
            async for _ in engine.generate(_request(CHAT)):
                received += 1
    assert received == 1
    assert not info.value.transient
    assert info.value.message == "upstream closed the stream early"


async def test_empty_stream_is_transient() -> None:
    async with _fake(_answer(200, b"")) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert info.value.transient


async def test_empty_stream_is_kind_empty() -> None:
    """An empty 200 (llama-cpp-python's answer to a streamed prompt over its context): the
    run decides whether it is a refusal (prompt over the context) or transient."""
    async with _fake(_answer(200, b"")) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert (info.value.transient, info.value.kind) == (True, "empty")


async def test_done_without_a_finish_reason_after_content_is_an_interrupted_generation() -> None:
    """llama-cpp-python's ``interrupt_requests``: a running stream ends with ``[DONE]`` and
    no ``finish_reason`` when another request arrives; the answer is cut short."""
    received = 0
    async with _fake(_answer(200, _sse(_chunk("Hel"), _chunk("lo")))) as engine:
        with pytest.raises(EngineFailure) as info:
            async for _ in engine.generate(_request(CHAT)):
                received += 1
    assert received == 2  # what came is relayed, then the failure
    assert (info.value.transient, info.value.kind) == (False, "interrupted")
    assert "interrupted" in info.value.message


@pytest.mark.parametrize(
    "chunks",
    [
        [_chunk("Hel"), _chunk("lo", "stop")],
        [_chunk("Hel"), _chunk("", "length")],
        [_chunk("Hel", "stop"), {"id": "x", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}],
    ],
)  # fmt: skip
async def test_done_after_a_finish_reason_is_a_complete_answer(chunks: list[dict[str, Any]]) -> None:
    async with _fake(_answer(200, _sse(*chunks))) as engine:
        relayed, _ = await _collect(engine, _request(CHAT))
    assert relayed


def test_stream_parse_needs_a_finish_reason_after_output() -> None:
    from bourse.engines.openai_parse import StreamParse

    def failure_of(error: object, output_began: bool) -> EngineFailure:
        return EngineFailure("error", transient=not output_began)

    cut = StreamParse(failure_of)
    assert len(cut.events(_sse(_chunk("a")))) == 1 and cut.done
    with pytest.raises(EngineFailure) as info:
        cut.finish()
    assert info.value.kind == "interrupted"
    whole = StreamParse(failure_of)
    whole.events(_sse(_chunk("a"), _chunk("", "stop")))
    assert whole.finish() is None
    nothing = StreamParse(failure_of)  # [DONE] alone: no output, nothing cut short
    nothing.events(_sse())
    assert nothing.finish() is None


@pytest.mark.parametrize(
    "error",
    [
        {"error": {"message": "Requested tokens (4900) exceed context window of 2048"}},
        {"error": {"message": "the request exceeds the available context size, try increasing it", "code": 500}},
        {"error": "This model's maximum context length is 2048 tokens"},
    ],
)  # fmt: skip
async def test_an_in_band_context_refusal_is_a_400_however_it_is_worded(error: dict[str, Any]) -> None:
    async with _fake(_answer(200, _sse(error, done=False))) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert (info.value.transient, info.value.status, info.value.code) == (
        False,
        400,
        "context_length_exceeded",
    )


async def test_error_event_before_output_is_transient_and_after_output_final() -> None:
    error = {"error": {"message": "engine overloaded", "type": "server_error", "code": "upstream_error"}}
    async with _fake(_answer(200, _sse(error, done=False))) as before:
        with pytest.raises(EngineFailure) as first:
            await _collect(before, _request(CHAT))
    async with _fake(_answer(200, _sse(_chunk("a"), error, done=False))) as after:
        with pytest.raises(EngineFailure) as second:
            await _collect(after, _request(CHAT))
    assert first.value.transient
    assert not second.value.transient
    assert "engine overloaded" in second.value.message


async def test_in_stream_refusal_before_output_is_a_400() -> None:
    error = {"error": {"message": "prompt too long", "type": "invalid_request_error", "code": None}}
    async with _fake(_answer(200, _sse(error, done=False))) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert (info.value.transient, info.value.status, info.value.code) == (False, 400, "invalid_request")


async def test_malformed_chunk_after_output_is_final() -> None:
    content = _sse(_chunk("a"), done=False) + b"data: {not json\n\n"
    async with _fake(_answer(200, content)) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert not info.value.transient


async def test_connection_dropped_without_an_answer_is_transient() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    engine = OpenAIHTTPEngine(f"http://127.0.0.1:{port}/v1", "m", SECRET)
    try:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    finally:
        await engine.aclose()
        server.close()
        await server.wait_closed()
    assert info.value.transient
    assert info.value.code == "upstream_error"
    assert SECRET not in info.value.message


async def test_a_broken_chunked_body_after_output_is_final() -> None:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(_sse(_chunk("a"), done=False))
        assert request.transport is not None
        request.transport.abort()
        return response

    received = 0
    async with _fake(handler) as engine:
        with pytest.raises(EngineFailure) as info:
            async for _ in engine.generate(_request(CHAT)):
                received += 1
    assert received == 1
    assert not info.value.transient
    assert info.value.kind == "stream"


async def test_chunks_read_together_say_more_but_the_last() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    content = _sse(_chunk("a"), _chunk("b"), _chunk("c", "stop"), {"id": "x", "choices": [], "usage": usage})
    async with _fake(_answer(200, content)) as engine:
        chunks, usages = await _collect(engine, _request(CHAT))
    assert [(c.chunk["choices"][0]["delta"]["content"], c.more) for c in chunks] == [
        ("a", True),
        ("b", True),
        ("c", False),
    ]
    assert usages == [UsageEvent(1, 3, {})]


async def test_chunks_read_apart_do_not_say_more() -> None:
    first, second = _sse(_chunk("a"), done=False), _sse(_chunk("b", "stop"))

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(first)
        await gate.wait()
        await response.write(second)
        await response.write_eof()
        return response

    gate = asyncio.Event()
    async with _fake(handler) as engine:
        events = engine.generate(_request(CHAT))
        one = await anext(events)
        gate.set()
        rest = [ev async for ev in events]
    assert isinstance(one, ChunkEvent) and not one.more
    assert [
        (ev.chunk["choices"][0]["delta"]["content"], ev.more) for ev in rest if isinstance(ev, ChunkEvent)
    ] == [("b", False)]


async def test_a_chunk_read_with_an_error_is_yielded_before_the_failure() -> None:
    error = {"error": {"message": "engine overloaded", "type": "server_error"}}
    async with _fake(_answer(200, _sse(_chunk("a"), _chunk("b"), error, done=False))) as engine:
        got: list[ChunkEvent] = []
        with pytest.raises(EngineFailure) as info:
            async for ev in engine.generate(_request(CHAT)):
                assert isinstance(ev, ChunkEvent)
                got.append(ev)
    assert [(c.chunk["choices"][0]["delta"]["content"], c.more) for c in got] == [("a", True), ("b", False)]
    assert not info.value.transient


# --- one non-streamed answer (GenerationRequest.stream false) -----------------------


def _one(body: dict[str, Any], kind: Kind = "chat", attempt: int = 0) -> GenerationRequest:
    return GenerationRequest(request_id="req-1", kind=kind, body=body, attempt=attempt, stream=False)


def _whole(message: dict[str, Any], usage: dict[str, Any] | None = None, **extra: Any) -> bytes:
    doc: dict[str, Any] = {
        "id": "up-1",
        "object": "chat.completion",
        "created": 1,
        "model": "internal-model",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        **extra,
    }
    if usage is not None:
        doc["usage"] = usage
    return orjson.dumps(doc)


async def test_a_non_streamed_request_asks_for_one_answer_and_a_streamed_one_for_a_stream() -> None:
    seen: list[Seen] = []
    answer = _whole({"role": "assistant", "content": "hello"}, {"prompt_tokens": 5, "completion_tokens": 2})
    async with _fake(_answer(200, answer, seen)) as engine:
        chunks, usages = await _collect(engine, _one(CHAT))
    sent = orjson.loads(seen[0].body)
    assert sent["stream"] is False
    assert "stream_options" not in sent  # OpenAI refuses stream_options without stream
    assert sent["model"] == "internal-model"
    assert seen[0].headers["accept"] == "application/json"
    assert CHAT["stream"] is True  # the caller's body is not mutated
    assert len(chunks) == 1
    chunk = chunks[0].chunk
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": "hello"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert "usage" not in chunk
    assert chunks[0].tokens == 2  # the usage's completion tokens
    assert usages == [UsageEvent(5, 2, {})]
    # with unary off (always_stream), the same request streams
    seen.clear()
    async with _fake(_answer(200, _sse(_chunk("hi", "stop")), seen), unary=False) as engine:
        chunks, _ = await _collect(engine, _one(CHAT))
    assert orjson.loads(seen[0].body)["stream"] is True
    assert [c.chunk["choices"][0]["delta"] for c in chunks] == [{"content": "hi"}]


async def test_a_non_streamed_answer_keeps_tool_calls_reasoning_and_estimates_without_usage() -> None:
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    message = {"role": "assistant", "content": None, "reasoning": "think " * 10, "tool_calls": calls}
    async with _fake(_answer(200, _whole(message, system_fingerprint="fp"))) as engine:
        chunks, usages = await _collect(engine, _one(CHAT))
    assert usages == []
    delta = chunks[0].chunk["choices"][0]["delta"]
    assert delta["reasoning"] == "think " * 10
    assert [c["index"] for c in delta["tool_calls"]] == [0, 1]  # the aggregator keys calls by index
    assert chunks[0].chunk["system_fingerprint"] == "fp"
    assert chunks[0].tokens == (60 + 8 + 2) // 4 + 1  # UTF-8 bytes / 4 of what it carries


async def test_a_non_streamed_completion_is_one_text_chunk() -> None:
    doc = {
        "id": "up-1",
        "object": "text_completion",
        "created": 1,
        "model": "internal-model",
        "choices": [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    }
    seen: list[Seen] = []
    async with _fake(_answer(200, orjson.dumps(doc), seen)) as engine:
        chunks, usages = await _collect(engine, _one({"prompt": "x", "stream": True}, kind="completion"))
    assert seen[0].path == "/v1/completions"
    assert [c.chunk["choices"] for c in chunks] == [doc["choices"]]
    assert chunks[0].chunk["object"] == "text_completion"
    assert usages == [UsageEvent(1, 3, {})]


@pytest.mark.parametrize(
    ("status", "body", "transient", "code"),
    [
        # the upstream ran it and failed (perhaps after output): final, as the sim engine says
        (500, b'{"error": {"message": "boom"}}', False, "upstream_error"),
        (502, b'{"error": {"message": "failed after 3 tokens"}}', False, "upstream_error"),
        # it did not run it: transient
        (503, b"busy", True, "upstream_error"),
        (504, b"gateway timeout", True, "upstream_error"),
        (429, b'{"error": {"message": "slow down"}}', True, "upstream_error"),
        (400, b'{"error": {"message": "too long", "code": "context_length_exceeded"}}', False,
         "context_length_exceeded"),
        (200, b'{"error": {"message": "overloaded", "type": "server_error"}}', True, "upstream_error"),
        (200, b'{"choices": [{"message": "not an object"', True, "upstream_error"),
        (200, b"[1, 2]", True, "upstream_error"),
    ],
)  # fmt: skip
async def test_a_failed_non_streamed_answer_is_mapped(
    status: int, body: bytes, transient: bool, code: str
) -> None:
    async with _fake(_answer(status, body)) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _one(CHAT))
    assert info.value.transient is transient
    assert info.value.code == code


async def test_a_non_streamed_answer_that_takes_too_long_is_final(upstream: str) -> None:
    """Sent and not answered in time: the engine may still be running it (an engine does
    not stop a non-streamed generation when its client goes), so it is not sent again."""
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream", first_byte_timeout_s=0.1, read_timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _one({**CHAT, "sim": {"ttft_ms": 2000}}))
        assert 0.15 < time.monotonic() - t0 < 1.5  # bounded by the larger of the two timeouts
    finally:
        await engine.aclose()
    assert not info.value.transient
    assert (info.value.status, info.value.code, info.value.kind) == (504, "upstream_timeout", "timeout")
    assert "not sent again" in info.value.message


async def test_a_non_streamed_answer_equals_the_aggregated_stream(upstream: str) -> None:
    from bourse.wire.chunks import Aggregator

    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    body = {**CHAT, "sim": {"output_tokens": 12, "reasoning": True}}
    try:
        whole, whole_usage = await _collect(engine, _one(body))
        streamed, streamed_usage = await _collect(engine, _request(body))
    finally:
        await engine.aclose()
    built = []
    for chunks in (whole, streamed):
        agg = Aggregator("chat")
        for c in chunks:
            agg.add(c.chunk)
        built.append(agg.build("id", "m", 0, None))
    assert built[0] == built[1]
    assert built[0]["choices"][0]["message"]["reasoning_content"]
    assert whole_usage == streamed_usage


async def test_cancelling_a_non_streamed_answer_closes_the_upstream(upstream: str) -> None:
    engine = OpenAIHTTPEngine(upstream + "/v1", "sim-upstream")
    async with httpx.AsyncClient(base_url=upstream) as probe:
        await _reset_when_idle(probe)
        try:
            with anyio.move_on_after(0.3):
                await _collect(engine, _one({**CHAT, "sim": {"output_tokens": 1000, "tokens_per_s": 50}}))
            assert (await _wait_cancelled(probe))["cancelled"] == 1
        finally:
            await engine.aclose()


async def test_credentials_in_the_base_url_are_sent_as_basic_auth() -> None:
    """``http://user:pw@host/v1`` with no api_key: the upstream gets ``Authorization: Basic``,
    as aiohttp's ClientSession sent it (a deployment behind a basic-auth proxy)."""
    seen: list[Seen] = []
    async with _fake(
        _answer(200, _sse(_chunk("hi", "stop")), seen), api_key=None, user=("ops", "p:ss w")
    ) as engine:
        await _collect(engine, _request(CHAT))
    assert seen[0].headers["authorization"] == "Basic " + base64.b64encode(b"ops:p:ss w").decode()
    assert seen[0].path == "/v1/chat/completions"


async def test_an_api_key_wins_over_credentials_in_the_base_url() -> None:
    seen: list[Seen] = []
    async with _fake(_answer(200, _sse(_chunk("hi", "stop")), seen), user=("ops", "pw")) as engine:
        await _collect(engine, _request(CHAT))
    assert seen[0].headers["authorization"] == f"Bearer {SECRET}"


@pytest.mark.parametrize("status", [301, 307, 308])
async def test_a_redirect_is_not_followed_and_says_base_url_is_wrong(status: int) -> None:
    """bourse does not follow an upstream's redirect (a POST's body would be dropped or sent
    to another host): the deployment is set up wrong, and the failure says so."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        return web.Response(status=status, headers={"location": "http://127.0.0.1:9/v1/chat/completions"})

    async with _fake(handler) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    failure = info.value
    assert (failure.transient, failure.kind, failure.status) == (True, "config", 503)
    assert f"HTTP {status}" in failure.message and "redirect" in failure.message
    assert "base_url" in failure.message
