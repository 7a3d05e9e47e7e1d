"""What an open connection keeps (``http/connections.py``): bench scenario (e) holds
10,000 of them. uvicorn's protocol keeps its state in the instance's ``__dict__``;
CPython shares one key table between a class's instances only up to ~30 keys, and past
that each connection's dict is a table of its own (1,584 bytes against ~300). The
protocol's own state is in slots so that the dict stays shared; and the connection's
empty queues (its two events' waiters, its pipelined requests) are lists, not 760-byte
deques. Served on a real loopback socket, one streamed request open, as in (e)."""

from __future__ import annotations

import asyncio
import collections
import sys
from typing import Any

import pytest
import uvicorn

from bourse.http.connections import BoundedHttpToolsProtocol, ConnectionLimits, bounded_protocol

pytestmark = pytest.mark.anyio


async def test_an_open_streamed_request_keeps_a_shared_dict_and_no_empty_deque() -> None:
    loop = asyncio.get_running_loop()
    started, release = asyncio.Event(), asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        started.set()
        await release.wait()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    config.load()
    state = uvicorn.server.ServerState()
    cls = bounded_protocol(ConnectionLimits())
    made: list[BoundedHttpToolsProtocol] = []

    def factory() -> BoundedHttpToolsProtocol:
        made.append(cls(config, state, {}, loop))
        return made[-1]

    server = await loop.create_server(factory, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    writers = []
    try:
        for _ in range(3):  # a class's key table is shared from its second instance on
            started.clear()
            reader, writer = await asyncio.open_connection(host, port)
            writers.append(writer)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(5):
                await started.wait()
                await reader.readuntil(b"data: x\n\n")
        proto = made[-1]
        assert proto.cycle is not None and not proto.cycle.response_complete  # the stream is open
        assert sys.getsizeof(vars(proto)) < 600, sorted(vars(proto))
        queues = [proto.pipeline, proto.flow._is_writable_event._waiters, proto.cycle.message_event._waiters]
        assert not any(isinstance(q, collections.deque) for q in queues), queues
    finally:
        release.set()
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
