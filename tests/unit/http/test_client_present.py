"""The server's probe of a client's presence (``http/connections.py``), asked when a
slot comes to an order: it reads the socket itself, so a client that has closed its
connection counts as gone before the event loop has processed the disconnect."""

from __future__ import annotations

import socket
from typing import Any

from bourse.http.connections import BoundedHttpToolsProtocol


class _Transport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


class _Conn:
    def __init__(self, transport: _Transport) -> None:
        self.transport = transport


def present(conn: _Conn) -> bool:
    return BoundedHttpToolsProtocol.client_present(conn)  # type: ignore[arg-type]


def test_a_connected_client_is_present_and_one_that_closed_is_not() -> None:
    server, client = socket.socketpair()
    try:
        conn = _Conn(_Transport(server))
        assert present(conn)
        client.sendall(b"GET / HTTP/1.1\r\n")  # unread bytes (a pipelined request) are no disconnect
        assert present(conn)
        client.close()
        assert not present(conn)
    finally:
        server.close()


def test_a_closing_transport_is_not_present() -> None:
    server, client = socket.socketpair()
    try:
        transport = _Transport(server)
        transport.closing = True
        assert not present(_Conn(transport))
    finally:
        server.close()
        client.close()
