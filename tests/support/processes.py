"""Real ``bourse serve`` processes for tests: free ports, a clean environment, a
context manager that starts one, waits for /healthz and stops it, the lines a
child process writes, collected as they come, and a ``redis-server`` of a test's
own (one it may kill; the suite's shared Redis is never touched)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

from tests.support.ledgers import watched

CLUSTER_ENV = {"BOURSE_SECRET_KEY": "rv1nq5VYGhk9op-B9sjbkU9e1JVaiCbjZigpynJ1qrw="}
"""What every replica of one test cluster shares besides the admin key, as
docs/replicas.md says (a replica with another key refuses to start)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


PYCACHE_PREFIX_VAR = "BOURSE_TEST_PYCACHE_PREFIX"
"""A folder where the ``bourse`` children write and read their bytecode when
``PYTHONDONTWRITEBYTECODE`` would have each compile every module again (set by the
suite's ``pytest_configure``, or by hand to keep one across runs)."""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without bourse's variables, and ``extra``. A gateway child stops
    at once when it is idle (``BOURSE_DRAIN_GRACE_S=0``, not the 5 s a load balancer is
    given): the suite stops hundreds; a test of the grace sets it (an empty value: the
    config's). Under ``PYTHONDONTWRITEBYTECODE``, with :data:`PYCACHE_PREFIX_VAR` set,
    the child caches its bytecode in that folder instead (``PYTHONPYCACHEPREFIX``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    prefix = os.environ.get(PYCACHE_PREFIX_VAR)
    if prefix and env.get("PYTHONDONTWRITEBYTECODE") and not env.get("PYTHONPYCACHEPREFIX"):
        del env["PYTHONDONTWRITEBYTECODE"]
        env["PYTHONPYCACHEPREFIX"] = prefix
    env["BOURSE_DRAIN_GRACE_S"] = "0"
    env.update(extra)
    return env


class OutputLines:
    """The lines a child process writes to one of its pipes, read by a thread as they
    come (so a test can wait for a line while the child runs)."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), name="output-lines", daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:  # closed at the end of the output
            for line in stream:
                self.lines.append(line.rstrip("\n"))

    def has(self, text: str) -> bool:
        """Whether a line read so far contains ``text``."""
        return any(text in line for line in list(self.lines))

    def join(self, timeout: float = 10.0) -> list[str]:
        """Every line, once the pipe is closed (the child ended)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the child's pipe is still open"
        return list(self.lines)


@contextmanager
def serve_process(
    tmp: Path,
    name: str,
    config_toml: str | None,
    data_dir: Path,
    admin_key: str,
    database: str | None = None,
    start_timeout_s: float = 20.0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``bourse serve`` on 127.0.0.1 as a child process; (base URL, process) once /healthz
    answers; SIGTERM (then SIGKILL) on exit if it still runs. ``env``: variables added to
    the child's environment (libfaketime's for a skewed clock; replicas of one database
    share ``BOURSE_SECRET_KEY``, :data:`CLUSTER_ENV`). ``config_toml`` None: no
    ``--config``, the built-in defaults (the README's first command)."""
    config_args: list[str] = []
    if config_toml is not None:
        config = tmp / f"{name}.toml"
        config.write_text(config_toml)
        config_args = ["--config", str(config)]
    last = ""
    with watched(data_dir, database):  # the suite's ledger check runs once it has stopped
        for attempt in range(3):
            port = free_port()
            args = [sys.executable, "-m", "bourse", "serve", *config_args, "--data-dir", str(data_dir),
                    "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
            if database:
                args += ["--database", database]
            args += extra_args
            log = tmp / f"{name}-{attempt}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=clean_env(BOURSE_ADMIN_KEY=admin_key, **(env or {})))  # fmt: skip
            url = f"http://127.0.0.1:{port}"
            try:
                deadline = time.monotonic() + start_timeout_s
                up = False
                while time.monotonic() < deadline and proc.poll() is None:
                    try:
                        up = httpx.get(url + "/healthz", timeout=1).status_code == 200
                    except httpx.HTTPError:
                        up = False
                    if up:
                        break
                    time.sleep(0.05)
                if up:
                    yield url, proc
                    return
                last = log.read_text()
            finally:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(timeout=15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(timeout=10)
        raise AssertionError(f"bourse serve did not start: {last}")


REDIS_SERVER = shutil.which("redis-server")
"""The ``redis-server`` binary, None when it is not installed (Debian: redis-server)."""


@contextmanager
def redis_server(port: int, folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A ``redis-server`` child on 127.0.0.1:``port`` without persistence, once it
    answers PING; killed on exit if it still runs."""
    assert REDIS_SERVER is not None, "redis-server is not installed"
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while (
            subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip()
            != b"PONG"
        ):
            assert time.monotonic() < deadline, "redis-server did not start"
            assert proc.poll() is None, "redis-server exited"
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
