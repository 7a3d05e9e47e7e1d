"""The openai engine's read protocol (``bourse.engines.upstream_reads``): a resume of a
read that is not paused does nothing, and streams that pause (many chunks, a large or a
compressed body, a consumer that falls behind) are still read whole, over a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator

import aiohttp
import anyio
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import RawTestServer

from bourse.engines.openai_http import OpenAIHTTPEngine
from bourse.engines.upstream_reads import ResumeWhenPaused, lean
from bourse.ports.engine import ChunkEvent, GenerationRequest

pytestmark = pytest.mark.anyio

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_a_resume_of_a_read_not_paused_does_nothing() -> None:
    protocol = ResumeWhenPaused(loop=asyncio.get_running_loop())
    fed: list[bytes] = []
    protocol.data_received = fed.append  # type: ignore[method-assign,assignment]
    protocol.resume_reading()
    assert fed == []  # not paused: the parser holds nothing back
    protocol._reading_paused = True  # as pause_reading leaves it
    protocol.resume_reading()
    assert fed == [b""]  # paused: the parser is fed again
    assert not protocol._reading_paused


async def test_the_engines_connections_are_made_with_it() -> None:
    engine = OpenAIHTTPEngine("http://127.0.0.1:9/v1", "m", None)
    try:
        connector = engine._client.connector
        assert connector._factory.func is ResumeWhenPaused
    finally:
        await engine.aclose()
    stock = aiohttp.TCPConnector()
    try:
        assert lean(stock) is stock
    finally:
        await stock.close()


def _events(n: int) -> list[bytes]:
    frames = [
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": f"{i} "}}]}) + b"\n\n"
        for i in range(n)
    ]
    # a complete answer ends with its finish_reason (without one, [DONE] says it was interrupted)
    end = (
        b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"\n\n"
    )
    return [*frames, end, b"data: [DONE]\n\n"]


@contextlib.asynccontextmanager
async def _upstream(frames: list[bytes], *, compressed: bool) -> AsyncIterator[str]:
    """An upstream writing ``frames`` as one HTTP chunk each (gzip-compressed: in
    pieces of 1 KiB of the compressed body), all at once, whether read or not."""

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        headers = {"content-type": "text/event-stream"}
        if compressed:
            headers["content-encoding"] = "gzip"
        response = web.StreamResponse(headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        if compressed:
            body = gzip.compress(b"".join(frames))
            pieces = [body[at : at + 1024] for at in range(0, len(body), 1024)]
        else:
            pieces = frames
        for piece in pieces:
            await response.write(piece)
        await response.write_eof()
        return response

    server = RawTestServer(handler, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("/v1"))
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("n", "compressed"),
    [
        (40000, False),  # more chunks than the reader holds (4,096), ~2.8 MB: more than the sockets hold
        (60000, True),  # ~2.6 MB once inflated, from ~150 KB on the wire
    ],
)
async def test_a_stream_the_reader_pauses_is_read_whole(n: int, compressed: bool) -> None:
    async with _upstream(_events(n), compressed=compressed) as url:
        engine = OpenAIHTTPEngine(url, "m", None)
        got: list[str] = []
        try:
            with anyio.fail_after(60):  # a resume lost would leave the read waiting
                async for event in engine.generate(GenerationRequest("r", "chat", CHAT)):
                    if isinstance(event, ChunkEvent) and event.tokens:
                        got.append(event.chunk["choices"][0]["delta"]["content"])
                        if len(got) == 1:
                            await asyncio.sleep(0.3)  # fall behind: the upstream's frames pile up
        finally:
            await engine.aclose()
    assert got == [f"{i} " for i in range(n)]
