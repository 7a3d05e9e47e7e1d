"""A pytest plugin that serves the suite's gateway under granian's ASGI interface
(granian's embedded server, in a thread) instead of uvicorn with bourse's protocol:
which end-to-end tests still pass on another server (issue 40, item 1).

    PYTHONPATH=src:.:bench/.work/granian-pkgs .venv/bin/python -m pytest -p bench.granian_tests \\
        tests/e2e/test_disconnect.py -k sim -q

Only the gateway moves (``tests.support.gateway``); the sim upstreams stay on uvicorn.
A test that insists on bourse's own server (``relay_paths`` in test_disconnect.py
asserts every relay heard of its client through the connection's watch) errors at
its teardown by design: the relay takes the listener path there. granian is installed by
``python -m bench.granian_app --setup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def serve_app_in_granian(app: Any, *, start_timeout_s: float = 30.0) -> Iterator[str]:
    """``app`` under granian (embedded, ASGI with lifespan) on a free port, in a thread."""
    from granian.constants import Interfaces
    from granian.server.embed import Server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    holder: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        server = Server(app, address="127.0.0.1", port=port, interface=Interfaces.ASGI, websockets=False)
        holder["server"], holder["loop"] = server, loop
        ready.set()
        loop.run_until_complete(server.serve())

    thread = threading.Thread(target=run, name="serve_app_in_granian", daemon=True)
    thread.start()
    ready.wait(start_timeout_s)
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("granian did not start") from None
            time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        holder["loop"].call_soon_threadsafe(holder["server"].stop)
        thread.join(timeout=10)


def pytest_configure(config: pytest.Config) -> None:
    import tests.support.gateway as gateway

    setattr(gateway, "serve_app_in_thread", serve_app_in_granian)  # noqa: B010
