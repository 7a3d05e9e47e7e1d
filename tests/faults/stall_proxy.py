"""A TCP relay on loopback that stops forwarding on command: a frozen database server or
a network partition, for the gateway behind it.

:class:`StallProxy` runs its own event loop on a thread. While frozen it forwards nothing
in either direction, opens no upstream connection and passes on no close (what it read
waits, as in a peer's buffers); thawed, it forwards what waited, then carries on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")


class StallProxy:
    """127.0.0.1:``port`` relayed to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stall-proxy", daemon=True)
        self._open = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    def dsn(self, dsn: str) -> str:
        """``dsn`` through this proxy."""
        parts = urlsplit(dsn)
        user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    def __enter__(self) -> StallProxy:
        self._thread.start()
        self._server = self._run(self._start())
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def freeze(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def thaw(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> asyncio.Server:
        self._open.set()
        return await asyncio.start_server(self._relay, "127.0.0.1", 0)

    async def _stop(self) -> None:
        self._open.set()
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self._open.wait()
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            self._writers.discard(writer)
            return
        self._writers.add(up_writer)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                await self._open.wait()  # what came while frozen waits for the thaw
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
