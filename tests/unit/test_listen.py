"""The listening sockets of ``bourse serve`` (one, or one per worker): TCP sockets
whose accepted connections send small writes at once (``TCP_NODELAY``) whatever the
event loop. uvloop sets it on every TCP connection; asyncio's own loop only on sockets
made with ``IPPROTO_TCP`` (``socket.create_server`` makes them with protocol 0), and
without it a keep-alive client waits ~40 ms for each answer (Nagle's algorithm against
delayed ACKs)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from bourse.cli import listen
from bourse.workers import listen_workers


async def _accepted_nodelay(*socks: socket.socket) -> int:
    """TCP_NODELAY of a connection the plain asyncio loop accepted on ``socks`` (all
    served: the kernel hands a connection to any of the sockets sharing a port)."""
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[int] = loop.create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            s = transport.get_extra_info("socket")
            seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    servers = [await loop.create_server(Probe, sock=sock) for sock in socks]
    try:
        host, port = socks[0].getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
    finally:
        for server in servers:
            server.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_served_connection_is_nodelay_on_the_plain_asyncio_loop(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")  # pragma: no cover
    with listen(host, 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP
        assert asyncio.run(_accepted_nodelay(sock)) != 0


def test_each_workers_socket_is_nodelay_too() -> None:
    socks = listen_workers("127.0.0.1", 0, 2)
    try:
        assert len({s.getsockname()[1] for s in socks}) == 1
        for s in socks:
            assert s.proto == socket.IPPROTO_TCP
        assert asyncio.run(_accepted_nodelay(*socks)) != 0
    finally:
        for s in socks:
            s.close()
