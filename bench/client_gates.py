"""Gate checks for candidate upstream HTTP clients of the ``openai`` engine (issue 40,
item 1): what each does when a request is given up.

    bench/.work/client-venv/bin/python -m bench.client_gates [aiohttp aiohttp-raw pyreqwest rnet aiosonic]

A loopback upstream (raw asyncio, its own thread) answers ``/slow`` with nothing for
5 s (a generation before its first token) and ``/sse`` with a chunked stream of 20
chunks 100 ms apart, each carrying the time it was written; it notes when each
connection closes. For each client, under uvloop:

(a) a task cancelled while waiting for the head: the upstream sees its connection close
    within 200 ms of the cancel;
(b) ``anyio.move_on_after`` around a request waiting for its head: the scope catches the
    cancellation (``cancelled_caught``, nothing else escapes) and the connection closes;
(c) a task cancelled mid-body (after two chunks): the connection closes;
(d) each chunk is delivered as it arrives (worst lag from written to read < 30 ms).

The candidates need their own virtual environment (rnet, aiosonic and pyreqwest are not
bourse's dependencies): ``python -m venv bench/.work/client-venv`` and
``pip install 'aiohttp<3.15' anyio uvloop rnet aiosonic pyreqwest``.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio

CLOSES: list[tuple[str, float]] = []
"""(path, monotonic time) of each upstream connection closed by the client."""


class Upstream(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.path = ""
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self.path = head.split(b" ")[1].decode()
            self.task = asyncio.get_running_loop().create_task(self.answer(self.path))

    async def answer(self, path: str) -> None:
        assert self.transport is not None
        t = self.transport
        if path == "/slow":
            await asyncio.sleep(5)
            t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        elif path == "/sse":
            t.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for i in range(20):
                await asyncio.sleep(0.1)
                if t.is_closing():
                    return
                data = f"data: {i} {time.monotonic():.6f}\n\n".encode()
                t.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            t.write(b"0\r\n\r\n")
        else:
            body = b'{"ok":true}'
            t.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )

    def connection_lost(self, exc: BaseException | None) -> None:
        CLOSES.append((self.path, time.monotonic()))
        if self.task is not None:
            self.task.cancel()


def serve() -> int:
    ready: list[int] = []
    cond = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(loop.create_server(Upstream, "127.0.0.1", 0))
        ready.append(server.sockets[0].getsockname()[1])
        cond.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    cond.wait()
    return ready[0]


# --- the candidates: stream(url) -> async iterator of body chunks (status checked) -------------------

Stream = Callable[[str], AsyncIterator[bytes]]


async def make_aiohttp() -> Stream:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def stream(url: str) -> AsyncIterator[bytes]:
        response = await session.post(url, data=b"{}", headers={"content-type": "application/json"})
        try:
            assert response.status == 200
            while chunk := await response.content.readany():
                yield chunk
        finally:
            response.close()

    return stream


async def make_aiohttp_raw() -> Stream:
    """aiohttp's connector and C parser driven directly (no ClientSession)."""
    import aiohttp
    import yarl
    from aiohttp.client_reqrep import ClientRequest

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    keys: dict[str, Any] = {}

    async def stream(url: str) -> AsyncIterator[bytes]:
        u = yarl.URL(url)
        key = keys.get(u.host_port_subcomponent or "")
        if key is None:
            key = keys[u.host_port_subcomponent or ""] = ClientRequest(
                "POST", u.origin(), loop=asyncio.get_running_loop()
            )
        conn = await connector.connect(key, [], timeout)
        try:
            proto = conn.protocol
            assert proto is not None and conn.transport is not None
            proto.set_response_params(read_timeout=300)
            conn.transport.write(
                b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
                % (u.raw_path.encode(), (u.host_port_subcomponent or "").encode())
            )
            message, payload = await proto.read()
            assert message.code == 200
            while chunk := await payload.readany():
                yield chunk
        except BaseException:
            conn.close()
            raise
        conn.release()

    return stream


async def make_pyreqwest() -> Stream:
    from pyreqwest.client import ClientBuilder

    client = ClientBuilder().pool_max_idle_per_host(1024).build()

    async def stream(url: str) -> AsyncIterator[bytes]:
        req = (
            client.post(url)
            .header("content-type", "application/json")
            .body_bytes(b"{}")
            .streamed_read_buffer_limit(0)
            .build_streamed()
        )
        async with req as response:
            assert response.status == 200
            while (chunk := await response.body_reader.read_chunk()) is not None:
                yield bytes(chunk)

    return stream


async def make_rnet() -> Stream:
    import rnet

    client = rnet.Client(pool_max_idle_per_host=1024, http1_only=True)

    async def stream(url: str) -> AsyncIterator[bytes]:
        response = await client.post(url, body=b"{}", headers={"content-type": "application/json"})
        try:
            assert response.status == 200
            async with response.stream() as streamer:
                async for chunk in streamer:
                    yield bytes(chunk)
        finally:
            await response.close()

    return stream


async def make_aiosonic() -> Stream:
    import aiosonic

    client = aiosonic.HTTPClient()

    async def stream(url: str) -> AsyncIterator[bytes]:
        response = await client.request(
            url, "POST", data=b"{}", headers={"content-type": "application/json"}, stream=True
        )
        try:
            assert response.status_code == 200
            async for chunk in response.read_chunks():
                yield chunk
        finally:
            await response.aclose()

    return stream


CANDIDATES = {"aiohttp": make_aiohttp, "aiohttp-raw": make_aiohttp_raw, "pyreqwest": make_pyreqwest,
              "rnet": make_rnet, "aiosonic": make_aiosonic}  # fmt: skip


async def closed_after(path: str, since: float, n_before: int) -> float | None:
    """ms from ``since`` to the upstream's close of a ``path`` connection (None: not within 1 s)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        for p, t in CLOSES[n_before:]:
            if p == path:
                return (t - since) * 1000
        await asyncio.sleep(0.005)
    return None


async def consume(stream: Stream, url: str, two: asyncio.Event | None = None) -> None:
    """Read ``url`` to its end; set ``two`` once two chunks have come."""
    n = 0
    async for _ in stream(url):
        n += 1
        if two is not None and n == 2:
            two.set()


async def gates(name: str, base: str) -> dict[str, str]:
    stream = await CANDIDATES[name]()
    out: dict[str, str] = {}
    # warm the pool
    await consume(stream, base + "/fast")
    # (a)
    n = len(CLOSES)
    task = asyncio.ensure_future(consume(stream, base + "/slow"))
    await asyncio.sleep(0.3)
    task.cancel()
    t0 = time.monotonic()
    try:
        await task
    except BaseException as exc:
        kind = type(exc).__name__
    ms = await closed_after("/slow", t0, n)
    out["a"] = (
        f"{'PASS' if ms is not None and ms < 200 else 'FAIL'} ({kind}; close {'none in 1 s' if ms is None else f'{ms:.1f} ms'})"
    )
    # (b)
    n = len(CLOSES)
    escaped = "nothing escaped"
    caught = False
    try:
        with anyio.move_on_after(0.3) as scope:
            await consume(stream, base + "/slow")
        caught = scope.cancelled_caught
    except BaseException as exc:  # a foreign CancelledError the scope did not take
        escaped = f"{type(exc).__name__}: {exc} escaped"
    t0 = time.monotonic()
    ms = await closed_after("/slow", t0 - 0.0, n)
    ok = caught and ms is not None and ms < 200
    out["b"] = (
        f"{'PASS' if ok else 'FAIL'} (caught {caught}, {escaped}; close {'none in 1 s' if ms is None else f'{ms:.1f} ms'})"
    )
    # (c)
    n = len(CLOSES)
    two = asyncio.Event()
    task = asyncio.ensure_future(consume(stream, base + "/sse", two))
    await two.wait()
    task.cancel()
    t0 = time.monotonic()
    try:
        await task
    except BaseException:
        pass
    ms = await closed_after("/sse", t0, n)
    out["c"] = (
        f"{'PASS' if ms is not None and ms < 200 else 'FAIL'} (close {'none in 1 s' if ms is None else f'{ms:.1f} ms'})"
    )
    # (d)
    lags: list[float] = []
    count = 0
    async for chunk in stream(base + "/sse"):
        now = time.monotonic()
        for line in chunk.split(b"\n\n"):
            if line.startswith(b"data: "):
                count += 1
                lags.append((now - float(line.split()[2])) * 1000)
    worst = max(lags) if lags else float("inf")
    out["d"] = (
        f"{'PASS' if count == 20 and worst < 30 else 'FAIL'} ({count} chunks, worst lag {worst:.1f} ms)"
    )
    return out


def main() -> None:
    import uvloop

    names = sys.argv[1:] or list(CANDIDATES)
    port = serve()
    for name in names:
        try:
            res = uvloop.run(gates(name, f"http://127.0.0.1:{port}"))
        except Exception as exc:
            print(f"{name}: error {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"{name:12} " + "  ".join(f"({k}) {v}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main()
