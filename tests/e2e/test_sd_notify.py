"""``bourse serve`` under a ``Type=notify`` service manager (issue 39): a real datagram
socket stands in for systemd's ``$NOTIFY_SOCKET``. ``READY=1`` comes only once
``/readyz`` answers 200 (a gateway whose one upstream is down says nothing until the
upstream is up), ``RELOADING=1`` then ``READY=1`` around SIGHUP, ``STOPPING=1`` when
SIGTERM starts the drain, then exit 0; an abstract socket (``@name``) too; a socket
that is gone never stops ``serve``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.processes import clean_env, free_port, serve_process

ADMIN_KEY = "bk_admin_sd_notify"
SIM = """
[products.chat]
[[products.chat.deployments]]
engine = "sim"
slots = 2
"""
UPSTREAM = """
[products.late]
[[products.late.deployments]]
engine = "openai"
name = "late-a"
base_url = "http://127.0.0.1:{port}/v1"
model = "sim"
probe_interval_s = 0.5
"""


@contextmanager
def notify_socket(address: str | bytes) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(address)
        sock.settimeout(0.2)
        yield sock
    finally:
        sock.close()


def messages(sock: socket.socket, until: str, timeout_s: float = 15.0) -> list[dict[str, str]]:
    """The messages received, each as its fields, up to the first with the field ``until``."""
    seen: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        seen.append(fields)
        if until in fields:
            return seen
    raise AssertionError(f"no {until} within {timeout_s} s; received {seen}")


def pending(sock: socket.socket) -> list[bytes]:
    """What arrived and was not read yet."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(0.2)


def test_ready_only_once_readyz_answers_200_then_reloading_and_stopping(tmp_path: Path) -> None:
    up_port = free_port()
    config = UPSTREAM.format(port=up_port)
    with (
        notify_socket(str(tmp_path / "notify")) as sock,
        serve_process(
            tmp_path,
            "late",
            config,
            tmp_path / "data",
            ADMIN_KEY,
            env={"NOTIFY_SOCKET": str(tmp_path / "notify")},
        ) as (url, proc),
    ):
        # listening, the upstream down: /readyz 503, and no READY=1 for as long
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            assert httpx.get(url + "/readyz", timeout=5).status_code == 503
            time.sleep(0.1)
        assert not [m for m in pending(sock) if b"READY=1" in m]
        upstream = subprocess.Popen(
            [sys.executable, "-m", "bourse", "sim-upstream", "--port", str(up_port)],
            env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            ready = messages(sock, "READY")[-1]
            assert httpx.get(url + "/readyz", timeout=5).status_code == 200  # ready when told
            assert ready["STATUS"] == f"serving late on {url}/v1", ready

            (tmp_path / "late.toml").write_text(
                config.replace("probe_interval_s = 0.5", "probe_interval_s = 0.6")
            )
            proc.send_signal(signal.SIGHUP)
            reload = messages(sock, "READY")
            assert reload[0]["RELOADING"] == "1" and int(reload[0]["MONOTONIC_USEC"]) > 0, reload
            assert reload[-1]["READY"] == "1" and not [m for m in reload[1:] if "RELOADING" in m], reload

            proc.send_signal(signal.SIGTERM)
            stopping = messages(sock, "STOPPING")[-1]
            assert stopping["STOPPING"] == "1" and stopping["STATUS"].startswith("draining"), stopping
            assert proc.wait(timeout=20) == 0
        finally:
            upstream.terminate()
            upstream.wait(timeout=10)


def test_an_abstract_socket_gets_ready_and_stopping(tmp_path: Path) -> None:
    name = f"bourse-test-{os.getpid()}-{time.monotonic_ns()}"
    with (
        notify_socket(b"\0" + name.encode()) as sock,
        serve_process(
            tmp_path, "abs", SIM, tmp_path / "data", ADMIN_KEY, env={"NOTIFY_SOCKET": "@" + name}
        ) as (
            url,
            proc,
        ),
    ):
        assert messages(sock, "READY")[-1]["READY"] == "1"
        assert httpx.get(url + "/readyz", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert messages(sock, "STOPPING")[-1]["STOPPING"] == "1"
        assert proc.wait(timeout=20) == 0


def test_a_socket_that_is_gone_never_stops_serve(tmp_path: Path) -> None:
    gone = str(tmp_path / "nobody-listens")
    with serve_process(tmp_path, "gone", SIM, tmp_path / "data", ADMIN_KEY, env={"NOTIFY_SOCKET": gone}) as (
        url,
        proc,
    ):
        assert httpx.get(url + "/readyz", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    log = (tmp_path / "gone-0.log").read_text()
    assert f"NOTIFY_SOCKET={gone}: cannot notify the service manager" in log, log
    assert log.count("cannot notify") == 1, log  # once, however many messages
