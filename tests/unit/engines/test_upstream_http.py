"""The openai engine's upstream client (``bourse.engines.upstream_http``) against raw
upstreams over real sockets: what it writes, how it reads odd heads, when it keeps a
connection, and that giving up closes the connection whether the head has come or not."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import anyio
import pytest
import yarl

from bourse.engines.openai_http import OpenAIHTTPEngine
from bourse.engines.upstream_http import MalformedAnswer, UpstreamClient
from bourse.ports.engine import GenerationRequest

pytestmark = pytest.mark.anyio

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Raw:
    """A raw upstream: each request's head as received, each connection's opening and close."""

    def __init__(self, answer: Callable[[int, asyncio.StreamWriter], Awaitable[None]]) -> None:
        self.answer = answer
        self.heads: list[bytes] = []
        self.connections = 0
        self.closed: list[float] = []
        self.port = 0
        self.gone = asyncio.Event()
        """Set when a connection closes."""
        self.asked = asyncio.Event()
        """Set when a request's head has come."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.heads.append(head)
                self.asked.set()
                await self.answer(len(self.heads), writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.append(time.monotonic())
            self.gone.set()
            writer.close()


@contextlib.asynccontextmanager
async def _served(
    answer: Callable[[int, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[Raw, UpstreamClient]]:
    raw = Raw(answer)
    server = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
    raw.port = server.sockets[0].getsockname()[1]
    client = UpstreamClient({"x-fixed": "1"}, max_connections=8, connect_timeout_s=5, read_timeout_s=5)
    try:
        yield raw, client
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


def _url(raw: Raw, path: str = "/v1/chat/completions") -> yarl.URL:
    return yarl.URL(f"http://127.0.0.1:{raw.port}{path}")


async def _ok(n: int, writer: asyncio.StreamWriter) -> None:
    writer.write(OK)


async def test_the_request_is_one_head_with_its_headers_and_body() -> None:
    async with _served(_ok) as (raw, client):
        target = client.target("POST", _url(raw, "/v1/chat/completions?x=1"))
        response = await client.request(target, b'{"a":1}', {"x-request-id": "r-1"})
        assert (response.status, await response.read()) == (200, b"{}")
        response.release()
    head = raw.heads[0].decode()
    assert head.startswith("POST /v1/chat/completions?x=1 HTTP/1.1\r\n")
    lines = head.lower().split("\r\n")
    assert f"host: 127.0.0.1:{raw.port}" in lines
    assert {"x-fixed: 1", "x-request-id: r-1", "content-length: 7"} <= set(lines)


async def test_a_header_value_cannot_add_a_header() -> None:
    async with _served(_ok) as (raw, client):
        response = await client.request(
            client.target("POST", _url(raw)), b"{}", {"x-request-id": "a\r\nx-injected: 1\n"}
        )
        await response.read()
        response.release()
    lines = raw.heads[0].decode().lower().split("\r\n")
    assert "x-request-id: ax-injected: 1" in lines
    assert not any(line.startswith("x-injected") for line in lines)


async def test_a_connection_read_to_its_end_is_used_again_unless_the_upstream_closes_it() -> None:
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        close = b"connection: close\r\n" if n == 2 else b""
        writer.write(b"HTTP/1.1 200 OK\r\n" + close + b"content-length: 2\r\n\r\n{}")

    async with _served(answer) as (raw, client):
        target = client.target("POST", _url(raw))
        for _ in range(3):
            response = await client.request(target, b"{}")
            assert await response.read() == b"{}"
            response.release()
    assert raw.connections == 2  # the first two on one connection; the third on a new one


async def test_an_informational_answer_is_passed_over() -> None:
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)

    async with _served(answer) as (raw, client):
        response = await client.request(client.target("POST", _url(raw)), b"{}")
        assert (response.status, await response.read()) == (200, b"{}")
        response.release()


async def test_a_malformed_head_is_a_client_error() -> None:
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")

    async with _served(answer) as (raw, client):
        with pytest.raises(MalformedAnswer) as info:
            await client.request(client.target("POST", _url(raw)), b"{}")
    assert isinstance(info.value, aiohttp.ClientError)


async def _silent(n: int, writer: asyncio.StreamWriter) -> None:
    """No answer: the upstream goes back to reading, and sees the client close."""


async def _closed_within(raw: Raw, since: float, seconds: float = 1.0) -> float:
    with anyio.move_on_after(seconds):
        await raw.gone.wait()
    assert raw.closed, "the upstream never saw the connection close"
    return raw.closed[0] - since


async def test_a_request_cancelled_before_its_head_closes_the_connection() -> None:
    async with _served(_silent) as (raw, client):
        task = asyncio.ensure_future(client.request(client.target("POST", _url(raw)), b"{}"))
        await raw.asked.wait()
        task.cancel()
        cancelled_at = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _closed_within(raw, cancelled_at) < 0.2


async def test_a_cancel_scope_takes_its_cancellation_and_the_connection_closes() -> None:
    async with _served(_silent) as (raw, client):
        with anyio.move_on_after(0.2) as scope:
            await client.request(client.target("POST", _url(raw)), b"{}")
        assert scope.cancelled_caught
        assert await _closed_within(raw, time.monotonic()) < 0.2


async def test_a_get_is_sent_again_once_when_its_connection_drops_but_a_post_is_not() -> None:
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        if n == 1:
            writer.transport.abort()  # dropped without an answer
        else:
            writer.write(OK)

    async with _served(answer) as (raw, client):
        response = await client.request(client.target("GET", _url(raw, "/v1/models")))
        assert (response.status, await response.read()) == (200, b"{}")
        response.release()
    assert len(raw.heads) == 2
    async with _served(answer) as (raw, client):
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.request(client.target("POST", _url(raw)), b"{}")
    assert len(raw.heads) == 1


async def test_the_engine_sends_one_accept_header_for_a_stream_an_answer_and_a_probe() -> None:
    sse = b"data: [DONE]\n\n"

    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(sse), sse))

    async with _served(answer) as (raw, _):
        engine = OpenAIHTTPEngine(f"http://127.0.0.1:{raw.port}/v1", "m", None, flavor="vllm")
        try:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            for stream in (True, False):
                request = GenerationRequest(request_id="r", kind="chat", body=body, stream=stream)
                with contextlib.suppress(Exception):
                    async for _ in engine.generate(request):
                        pass
            await engine.probe()
        finally:
            await engine.aclose()
    accepts = [[x for x in h.decode().lower().split("\r\n") if x.startswith("accept:")] for h in raw.heads]
    assert accepts[:2] == [["accept: text/event-stream"], ["accept: application/json"]]
    assert len(accepts) > 2 and all(a == ["accept: application/json"] for a in accepts[2:])


def test_the_aiohttp_range_admits_only_versions_with_the_pool_lookup_the_client_uses() -> None:
    """The client takes a kept-alive connection with ``await connector._get(key, traces)``,
    a coroutine taking the traces from aiohttp 3.10.11 on (synchronous, key only, before):
    on 3.10.0-3.10.10 every upstream request failed with a TypeError."""
    import inspect
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    spec = next(
        Requirement(r) for r in project["project"]["dependencies"] if r.startswith("aiohttp")
    ).specifier
    assert "3.10.10" not in spec and "3.10.11" in spec and aiohttp.__version__ in spec
    lookup = aiohttp.TCPConnector._get
    assert inspect.iscoroutinefunction(lookup)
    assert list(inspect.signature(lookup).parameters)[:3] == ["self", "key", "traces"]
