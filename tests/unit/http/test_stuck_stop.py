"""A stop that hangs after the drain says where: every thread's stack on stderr.

``bourse serve`` under a service manager is killed (SIGKILL, exit 137) when its stop
outlasts the manager's timeout; the log then ended at the drain's last line and said
nothing of what held the process (a compose stop in CI). :class:`GatewayServer` arms
:mod:`faulthandler` once the drain has ended: a process still alive ``STUCK_S`` later
prints every thread's stack. Each test runs the real server in its own process (the
dump is process-wide), with ``STUCK_S`` shortened and an app whose lifespan shutdown
blocks the loop, or returns at once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SERVER = """
import socket, sys, threading
import uvicorn
from bourse.http import server

server.STUCK_S = 0.5
HANG = sys.argv[1] == "hang"

def hang_in_shutdown() -> None:
    threading.Event().wait()  # the loop's thread blocked, as a stop step that never returns

async def app(scope, receive, send):
    assert scope["type"] == "lifespan"
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            if HANG:
                hang_in_shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return

class Drain:
    async def __call__(self) -> None:
        pass

    def hurry(self) -> None:
        pass

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
print(sock.getsockname()[1], flush=True)
server.GatewayServer(uvicorn.Config(app, lifespan="on", log_config=None), Drain()).run(sockets=[sock])
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    err = tmp_path / f"{mode}.err"
    with err.open("w") as stderr:  # the child keeps its own copy
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, mode],
            stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3] / "src")},
        )  # fmt: skip
    assert proc.stdout is not None
    with proc.stdout:
        port = int(proc.stdout.readline())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # listening once a connection is accepted
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, err
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the server never listened: {err.read_text()}")


def test_a_stop_that_hangs_after_the_drain_prints_every_threads_stack(tmp_path: Path) -> None:
    proc, err = _start(tmp_path, "hang")
    try:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while "hang_in_shutdown" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the hanging stop exited"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    text = err.read_text()
    assert "Thread 0x" in text and "hang_in_shutdown" in text, text


def test_a_stop_that_ends_prints_no_stack(tmp_path: Path) -> None:
    proc, err = _start(tmp_path, "end")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, err.read_text()
    time.sleep(1.0)  # past STUCK_S: a timer left armed would have fired by now
    text = err.read_text()
    assert "SIGTERM: draining, then stopping" in text and "Thread 0x" not in text, text
