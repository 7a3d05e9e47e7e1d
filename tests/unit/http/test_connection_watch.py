"""The connection's watch (``http/connections.py``): the relay of a non-streamed answer
hears of a disconnect from the connection itself, once; a watch set after the
connection was lost is called at once; a watch taken back is never called. Served on
a real loopback socket by the protocol class ``bourse serve`` uses."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from bourse.http.connections import BoundedHttpToolsProtocol, ConnectionLimits, bounded_protocol

pytestmark = pytest.mark.anyio


async def _app(scope: Any, receive: Any, send: Any) -> None:  # never reached: no request is sent
    raise AssertionError("no request")


async def _connected() -> tuple[BoundedHttpToolsProtocol, asyncio.StreamWriter, asyncio.Server]:
    loop = asyncio.get_running_loop()
    config = uvicorn.Config(_app, log_level="warning")
    config.load()
    made: list[BoundedHttpToolsProtocol] = []
    connected = asyncio.Event()
    cls = bounded_protocol(ConnectionLimits())

    def factory() -> BoundedHttpToolsProtocol:
        made.append(cls(config, ServerState(), {}, loop))
        connected.set()
        return made[-1]

    server = await loop.create_server(factory, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    _reader, writer = await asyncio.open_connection(host, port)
    async with asyncio.timeout(5):
        await connected.wait()
    return made[0], writer, server


async def test_the_watch_is_called_once_when_the_client_leaves_and_at_once_when_set_late() -> None:
    proto, writer, server = await _connected()
    calls: list[str] = []
    lost = asyncio.Event()

    def on_lost() -> None:
        calls.append("lost")
        lost.set()

    proto.watch(on_lost)
    await asyncio.sleep(0.01)
    assert calls == []  # connected: nothing
    writer.close()
    async with asyncio.timeout(5):
        await lost.wait()
    await asyncio.sleep(0.01)
    assert calls == ["lost"]
    proto.watch(lambda: calls.append("late"))  # already lost: called now
    assert calls == ["lost", "late"]
    server.close()
    await server.wait_closed()


async def test_a_watch_taken_back_is_not_called() -> None:
    proto, writer, server = await _connected()
    calls: list[str] = []
    proto.watch(lambda: calls.append("lost"))
    proto.watch(None)
    writer.close()
    await asyncio.sleep(0.1)  # the loop processes the disconnect
    assert proto.transport.is_closing()
    assert calls == []
    server.close()
    await server.wait_closed()
