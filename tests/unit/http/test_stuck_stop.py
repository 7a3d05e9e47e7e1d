"""A stop that hangs says where; an exit held after the server shut down is bounded.

``bourse serve`` under a service manager is killed (SIGKILL, exit 137) when its stop
outlasts the manager's timeout; the log then ended at the drain's last line and said
nothing of what held the process (a compose stop in CI: a name lookup in flight held
the loop's teardown, tests/faults/test_dns_stall.py). :class:`GatewayServer` arms
:mod:`faulthandler` once the drain has ended, so a process still stopping ``STUCK_S``
later prints every thread's stack; and, when the process is its own (``bound_exit``),
exits 0 ``EXIT_S`` after its serve returned if something still holds the exit. Each
test runs the real server in its own process (both are process-wide), with the bounds
shortened and an app whose lifespan shutdown blocks the loop, or returns at once.
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
import socket, sys, threading, time
import uvicorn
from bourse.http import server

MODE = sys.argv[1]
server.STUCK_S = 0.5
server.EXIT_S = 0.5 if MODE == "held" else 10.0
HANG = MODE == "hang"

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
config = uvicorn.Config(app, lifespan="on", log_config=None)
server.GatewayServer(config, Drain(), bound_exit=True).run(sockets=[sock])
if MODE == "held":  # the exit held after serve returned, as by a name lookup in flight
    threading.Event().wait()
time.sleep(1.5)  # past STUCK_S: a dump left armed would fire now
print("the child ends on its own", file=sys.stderr, flush=True)
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
    text = err.read_text()  # the child lived 1.5 s past STUCK_S after its serve returned
    assert "SIGTERM: draining, then stopping" in text and "the child ends on its own" in text, text
    assert "Thread 0x" not in text and "still held" not in text, text


def test_an_exit_held_after_the_server_shut_down_ends_with_status_0(tmp_path: Path) -> None:
    proc, err = _start(tmp_path, "held")
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=20)
    finally:
        proc.kill()
    text = err.read_text()
    assert rc == 0 and time.monotonic() - began < 10, text
    assert "the exit was still held 0.5 s after the server shut down" in text, text
    assert "Thread 0x" in text and "the child ends on its own" not in text, text
