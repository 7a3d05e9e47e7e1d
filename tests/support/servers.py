"""Test helper: serve an ASGI app on a real local socket from a background thread,
with the HTTP protocol ``bourse serve`` uses (:mod:`bourse.http.connections`: its
connection limits, and the client-presence probe and watch the relay relies on)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from bourse.http.connections import ConnectionLimits, bounded_protocol


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
    server = uvicorn.Server(config)
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
        server.should_exit = True
        thread.join(timeout=10)
