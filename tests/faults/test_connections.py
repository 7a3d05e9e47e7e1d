"""Hostile connections against a served ``bourse serve`` process (loopback only).

Clients that trickle their headers (slowloris), a body that never finishes, sockets
that connect and send nothing, a keep-alive connection left idle, and more connections
than ``[server] max_connections``. Before the fix none of these was ever closed: uvicorn
has no header or body deadline, closes only connections idle *between* requests, and
keeps every connection over its ``limit_concurrency`` open.

The timeouts are short here (about a second); every bound allows a few seconds more
for a loaded machine.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_connections_test"
HEADER_TIMEOUT_S = 1.5
BODY_TIMEOUT_S = 1.5
IDLE_TIMEOUT_S = 1.0
SLACK_S = 3.0
"""Allowed beyond a timeout before the connection must be closed (a loaded machine)."""
PRODUCT = """
[products.one]
[[products.one.deployments]]
engine = "sim"
"""
LIMITED = f"""
[server]
header_timeout_s = {HEADER_TIMEOUT_S}
body_timeout_s = {BODY_TIMEOUT_S}
keep_alive_timeout_s = {IDLE_TIMEOUT_S}
{PRODUCT}"""
CAP = 20
CAPPED = f"""
[server]
max_connections = {CAP}
header_timeout_s = 60
keep_alive_timeout_s = 60
{PRODUCT}"""


@dataclass
class Served:
    url: str
    key: str

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname == "127.0.0.1" and parts.port is not None, self.url
        return parts.hostname, parts.port

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=10)


def _api_key(url: str) -> str:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(url + "/admin/accounts", json={"id": "conn", "credit_usd": 5}, headers=admin, timeout=10)
    assert r.status_code == 201, r.text
    r = httpx.post(url + "/admin/keys", json={"account": "conn"}, headers=admin, timeout=10)
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("limits")
    with serve_process(tmp, "limits", LIMITED, tmp / "data", ADMIN_KEY) as (url, _proc):
        yield Served(url, _api_key(url))


class Clients:
    """Many raw sockets driven from one thread: send bytes, see which are closed when."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.received: dict[socket.socket, bytes] = {}
        self.closed_at: dict[socket.socket, float] = {}

    def open(self, served: Served, n: int, first: bytes = b"") -> list[socket.socket]:
        out = []
        for _ in range(n):
            s = served.connect()
            if first:
                s.sendall(first)
            s.setblocking(False)
            self.selector.register(s, selectors.EVENT_READ)
            self.received[s] = b""
            out.append(s)
        return out

    @property
    def open_sockets(self) -> list[socket.socket]:
        return [s for s in self.received if s not in self.closed_at]

    def trickle(self, data: bytes) -> None:
        """Send ``data`` on every socket still open (a closed one counts as closed)."""
        for s in self.open_sockets:
            try:
                s.send(data)
            except OSError:
                self._closed(s)

    def poll(self, seconds: float, watch: list[socket.socket] | None = None) -> None:
        """Read what arrives for ``seconds`` or until every socket (of ``watch``) is closed;
        note each connection the server closes."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and self._any_open(watch):
            for key, _ in self.selector.select(left):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self.received[s] += chunk
                else:
                    self._closed(s)

    def _any_open(self, watch: list[socket.socket] | None) -> bool:
        return any(s not in self.closed_at for s in (self.received if watch is None else watch))

    def _closed(self, s: socket.socket) -> None:
        if s not in self.closed_at:
            self.closed_at[s] = time.monotonic()
            self.selector.unregister(s)

    def close(self) -> None:
        for s in self.received:
            if s not in self.closed_at:
                self.selector.unregister(s)
            s.close()
        self.selector.close()


@pytest.fixture
def clients() -> Iterator[Clients]:
    c = Clients()
    try:
        yield c
    finally:
        c.close()


def _status_and_error(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error: dict[str, object] = orjson.loads(body)["error"]
    return status, error


def test_slowloris_clients_get_408_and_are_closed_within_the_header_timeout(
    served: Served, clients: Clients
) -> None:
    t0 = time.monotonic()
    socks = clients.open(served, 100, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    while clients.open_sockets and time.monotonic() - t0 < HEADER_TIMEOUT_S + SLACK_S:
        clients.trickle(b"x")  # one byte of a header line every 0.2 s, never the end
        clients.poll(0.2)
    assert not clients.open_sockets, f"{len(clients.open_sockets)} of 100 slow-header clients still open"
    for s in socks:
        assert clients.closed_at[s] - t0 <= HEADER_TIMEOUT_S + SLACK_S
        status, error = _status_and_error(clients.received[s])
        assert (status, error["code"]) == (408, "request_timeout"), clients.received[s]


def test_a_client_slow_but_within_the_header_timeout_is_served(served: Served) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: yes\r\n\r\n"
    with served.connect() as s:
        step = len(request) // 5 + 1
        for i in range(0, len(request), step):
            s.sendall(request[i : i + step])
            time.sleep(HEADER_TIMEOUT_S / 10)  # the whole request within half the timeout
        assert s.recv(65536).startswith(b"HTTP/1.1 200"), "a client within its deadline is answered"


def test_idle_sockets_and_an_idle_keep_alive_connection_are_closed(served: Served, clients: Clients) -> None:
    t0 = time.monotonic()
    clients.open(served, 200)  # connect and say nothing
    [kept] = clients.open(served, 1, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    clients.poll(IDLE_TIMEOUT_S + SLACK_S)
    assert not clients.open_sockets, f"{len(clients.open_sockets)} of 201 idle connections still open"
    assert max(clients.closed_at.values()) - t0 <= IDLE_TIMEOUT_S + SLACK_S
    assert clients.received[kept].startswith(b"HTTP/1.1 200"), clients.received[kept]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/admin/accounts"])
def test_a_slow_body_gets_408_and_the_connection_is_closed(
    served: Served, clients: Clients, path: str
) -> None:
    key = ADMIN_KEY if path.startswith("/admin") else served.key
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode()  # fmt: skip
    t0 = time.monotonic()
    [s] = clients.open(served, 1, head)
    while clients.open_sockets and time.monotonic() - t0 < BODY_TIMEOUT_S + SLACK_S:
        clients.trickle(b" ")  # a byte every 0.2 s: the 1000 bytes would take 200 s
        clients.poll(0.2)
    assert not clients.open_sockets, "a slow body kept its connection open"
    assert clients.closed_at[s] - t0 <= BODY_TIMEOUT_S + SLACK_S
    status, error = _status_and_error(clients.received[s])
    assert (status, error["code"]) == (408, "request_timeout"), clients.received[s]
    # the gateway is still fine
    assert httpx.get(served.url + "/healthz", timeout=10).status_code == 200


def test_connections_over_the_cap_get_503_and_are_closed(tmp_path: Path, clients: Clients) -> None:
    with serve_process(tmp_path, "capped", CAPPED, tmp_path / "data", ADMIN_KEY) as (url, _proc):
        served = Served(url, "")
        # CAP idle connections, within their (long) idle timeout; one refused because the
        # start-up's health checks were still being closed is replaced
        held: list[socket.socket] = []
        for _ in range(10):
            held = [s for s in held if s not in clients.closed_at]
            if len(held) == CAP:
                break
            held += clients.open(served, CAP - len(held))
            clients.poll(0.3)
        assert len(held) == CAP and len(clients.open_sockets) == CAP, "connections within the cap stay open"
        extra = clients.open(served, 5)
        clients.poll(SLACK_S, watch=extra)
        for s in extra:
            assert s in clients.closed_at, "a connection over the cap stays open"
            status, error = _status_and_error(clients.received[s])
            assert (status, error["code"]) == (503, "no_capacity"), clients.received[s]
            assert b"retry-after: 1" in clients.received[s].lower()
        assert all(s not in clients.closed_at for s in held)
        # room again once some close
        for s in held[:5]:
            clients.selector.unregister(s)
            clients.closed_at[s] = time.monotonic()
            s.close()
        deadline = time.monotonic() + SLACK_S
        status = 0
        while status != 200 and time.monotonic() < deadline:
            try:
                status = httpx.get(url + "/healthz", timeout=5).status_code
            except httpx.HTTPError:
                time.sleep(0.05)
        assert status == 200
