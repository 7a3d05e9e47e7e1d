"""The request head's size is bounded (``[server] max_header_bytes``), through raw
sockets against a served ``bourse serve`` process.

Before the bound, httptools (uvicorn's parser) kept every byte of a header until its
end: ``GET /healthz`` with one 64 MB header was answered 200 and the gateway grew by
64 MB; twelve such clients at once took it past 300 MB within the header timeout. Now
a head over the limit (its request line and headers, or a chunked body's trailers) is
answered 431 ``request_header_fields_too_large`` in the error envelope and the
connection is closed; what the client sends past the limit is never kept, so the
gateway's peak memory (``VmHWM``, reset before each test) grows by well under a
megabyte per such client. A head of exactly the limit is served, on a fresh
connection and on a kept-alive one.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest

from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_header_size_test"
LIMIT = 16 * 1024
CONFIG = f"""
[server]
max_header_bytes = {LIMIT}
header_timeout_s = 60
[products.one]
[[products.one.deployments]]
engine = "sim"
"""
BIG = 64 * 1024 * 1024
"""The header the issue sent: 64 MB."""
PIECE = 64 * 1024
GROWTH_BOUND = 8 * 1024 * 1024
"""Allowed growth of the gateway's peak memory (the issue's sender grew it by 64 MB each)."""


@dataclass
class Served:
    url: str
    pid: int

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=30)

    def status(self, field: str) -> int:
        """A memory figure of the gateway's process, in bytes (``VmRSS``, ``VmHWM``)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")

    def reset_peak(self) -> int:
        """The peak memory set back to the current one (Linux: clear_refs 5); that figure."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.status("VmHWM")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("head")
    with serve_process(tmp, "head", CONFIG, tmp / "data", ADMIN_KEY) as (url, proc):
        yield Served(url, proc.pid)


def _request(head_bytes: int, path: str = "/healthz") -> bytes:
    """A GET of exactly ``head_bytes`` bytes: its line, a Host header and one padding header."""
    start = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ".encode()
    end = b"\r\n\r\n"
    pad = head_bytes - len(start) - len(end)
    assert pad >= 1
    return start + b"a" * pad + end


class Reader:
    """The responses on one connection, read in order (pipelined ones arrive together)."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buffer = b""

    def _more(self, what: str) -> None:
        chunk = self.s.recv(65536)
        assert chunk, f"closed {what}: {self.buffer!r}"
        self.buffer += chunk

    def response(self) -> tuple[int, bytes, bytes]:
        """The next response: status, head, body (read by its content-length)."""
        while b"\r\n\r\n" not in self.buffer:
            self._more("before a response")
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            self._more("within a body")
            rest = self.buffer.partition(b"\r\n\r\n")[2]
        self.buffer = rest[length:]
        return int(head.split(b" ", 2)[1]), head, rest[:length]


def _read_response(s: socket.socket) -> tuple[int, bytes, bytes]:
    """The one response expected on ``s`` now."""
    return Reader(s).response()


def _send_big_header(served: Served, out: dict[str, tuple[int, bytes]], name: str) -> None:
    """Send ``GET /healthz`` with a header of :data:`BIG` bytes in pieces; note what came
    back and how many bytes the gateway took before it closed."""
    sent = 0
    with served.connect() as s:
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            piece = b"a" * PIECE
            while sent < BIG:
                s.sendall(piece)
                sent += PIECE
            s.sendall(b"\r\n\r\n")
        except OSError:  # the gateway closed the connection: what it answered is read below
            pass
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except OSError:
            pass
    out[name] = (sent, received)


def _assert_431(received: bytes) -> None:
    assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    error = orjson.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large", error
    assert error["type"] == "invalid_request_error", error
    assert str(LIMIT) in error["message"], error


def test_a_64_mb_header_gets_431_and_the_gateway_does_not_grow(served: Served) -> None:
    before = served.reset_peak()
    out: dict[str, tuple[int, bytes]] = {}
    _send_big_header(served, out, "one")
    sent, received = out["one"]
    _assert_431(received)
    assert sent < BIG, "the gateway read all 64 MB instead of closing"
    grown = served.status("VmHWM") - before
    assert grown < GROWTH_BOUND, f"the gateway's peak memory grew by {grown / 2**20:.1f} MiB"


def test_twelve_senders_at_once_stay_bounded(served: Served) -> None:
    before = served.reset_peak()
    out: dict[str, tuple[int, bytes]] = {}
    threads = [threading.Thread(target=_send_big_header, args=(served, out, str(i))) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 12, f"{12 - len(out)} senders did not finish"
    for sent, received in out.values():
        _assert_431(received)
        assert sent < BIG
    grown = served.status("VmHWM") - before
    assert grown < GROWTH_BOUND, f"twelve senders grew the gateway's peak memory by {grown / 2**20:.1f} MiB"


def test_a_head_of_exactly_the_limit_is_served_and_one_byte_more_is_431(served: Served) -> None:
    with served.connect() as s:
        s.sendall(_request(LIMIT))
        status, _, body = _read_response(s)
        assert status == 200, body
        # the same connection, kept alive: each request's head has the whole limit
        s.sendall(_request(LIMIT))
        status, _, body = _read_response(s)
        assert status == 200, body
    with served.connect() as s:
        s.sendall(_request(LIMIT + 1))
        status, head, body = _read_response(s)
        assert status == 431, body
        _assert_431(head + b"\r\n\r\n" + body)
        assert s.recv(1) == b"", "the connection stays open after a 431"


def test_a_head_under_the_limit_sent_byte_by_byte_is_served(served: Served) -> None:
    request = _request(LIMIT - 100)
    with served.connect() as s:
        step = 997  # many reads, none on a line's boundary
        for i in range(0, len(request), step):
            s.sendall(request[i : i + step])
            time.sleep(0.001)
        status, _, body = _read_response(s)
        assert status == 200, body


def test_a_head_then_its_body_in_one_write_is_served(served: Served) -> None:
    """The limit counts the head only: a body far larger than it, in the same write, is
    the body's (``max_body_bytes``) to bound."""
    body = b'{"id": "acct-big-write", "credit_usd": 1, "pad": "' + b"p" * (3 * LIMIT) + b'"}'
    head = (f"POST /admin/accounts HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with served.connect() as s:
        s.sendall(head + body)
        status, _, answer = _read_response(s)
        assert status in (201, 400), answer  # the admin API's own answer, not the head limit's
        assert b"request_header_fields_too_large" not in answer


def test_pipelined_requests_each_have_the_whole_limit(served: Served) -> None:
    one = _request(LIMIT // 2 + 10)
    with served.connect() as s:
        s.sendall(one * 3)  # three heads in one write, together over the limit
        reader = Reader(s)
        for _ in range(3):
            status, _, body = reader.response()
            assert status == 200, body


def test_huge_trailers_of_a_chunked_body_get_431(served: Served) -> None:
    """A chunked body's trailers are headers too: bounded the same way."""
    before = served.reset_peak()
    with served.connect() as s:
        sent = 0
        try:
            s.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"3\r\nabc\r\n0\r\nX-Trailer: ")  # fmt: skip
            piece = b"t" * PIECE
            while sent < 16 * 1024 * 1024:
                s.sendall(piece)
                sent += PIECE
        except OSError:
            pass
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except OSError:
            pass
    assert sent < 16 * 1024 * 1024, "the gateway read every trailer byte"
    # /healthz answered (405: it takes GET only) before the body ended; then the connection is closed
    assert received.startswith(b"HTTP/1.1 "), received[:200]
    grown = served.status("VmHWM") - before
    assert grown < GROWTH_BOUND, f"the gateway's peak memory grew by {grown / 2**20:.1f} MiB"
