"""Test helper: serve an ASGI app on a real local socket from a background thread,
with the HTTP protocol ``bourse serve`` uses (:mod:`bourse.http.connections`: its
connection limits, and the client-presence probe and watch the relay relies on).
Told to stop, the server starts its shutdown at once rather than at uvicorn's next
0.1 s tick (the suite stops hundreds)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from bourse.http.connections import ConnectionLimits, bounded_protocol


class _Server(uvicorn.Server):
    """uvicorn's server whose main loop also wakes when :meth:`stop` is called."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        """uvicorn's loop (a tick every 0.1 s: the date header, the exit check), each
        wait cut short by :meth:`stop`."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    def stop(self) -> None:
        """Exit (from another thread)."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(wake.set)


@contextmanager
def serve_app_in_thread(app: Any, *, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 (a free port) in a daemon thread with its
    own event loop; yield its base URL (``http://127.0.0.1:<port>``); stop it on exit."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        http=bounded_protocol(ConnectionLimits()),
    )
    server = _Server(config)
    thread = threading.Thread(target=server.run, name="serve_app_in_thread", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server exited before it started")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the test server did not start within {start_timeout_s}s")
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(timeout=10)
