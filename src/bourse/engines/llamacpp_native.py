"""llama-cpp-python's native side, for the ``llamacpp`` engine and the ``openai`` engine's
token counts: a GGUF loaded (:func:`load_model`, or its vocabulary alone,
:func:`load_vocab`), llama.cpp's C log lines routed to the ``bourse.llamacpp`` logger
(DEBUG, its errors at WARNING, so that a model load does not bury the start-up
messages), and the AMX workaround a load needs on a CPU with AMX tiles (:func:`has_amx`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("bourse.llamacpp")

_LOG_HOOK: list[Any] = []
"""Keeps llama.cpp's log callback alive (ctypes); set once, on first model load."""

_CONT = 5
"""llama.cpp's log level for the rest of the line before (``GGML_LOG_LEVEL_CONT``)."""
_LLAMA_LEVELS = {4: logging.WARNING}
"""llama.cpp's log levels as Python's: its ERROR (4) as WARNING; its DEBUG (1), INFO (2)
and WARN (3) lines, some 150 on every model load (the file's metadata, the load
progress, notes about the file such as a control token's type), at DEBUG."""


class _LlamaLog:
    """llama.cpp's C log lines as ``bourse.llamacpp`` records, at the level
    :data:`_LLAMA_LEVELS` gives; a line that comes in pieces is logged once, whole."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._level = logging.DEBUG
        self._partial = ""

    def __call__(self, level: int, text: str) -> None:
        with self._lock:
            if level != _CONT:
                self._emit(self._partial)
                self._partial = ""
                self._level = _LLAMA_LEVELS.get(level, logging.DEBUG)
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self._emit(line)

    def _emit(self, line: str) -> None:
        if line.strip():
            log.log(self._level, "%s", line.rstrip())


def has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU reports Intel AMX tiles (``amx_tile`` among its flags)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def model_params(llama_cpp: Any, *, extra_buffers: bool) -> Iterator[None]:
    """While a model loads: llama.cpp's "extra buffer types" (weights repacked for the
    CPU's matrix units) on or off. On a CPU with AMX, ggml's AMX matrix multiply
    crashed the process (SIGSEGV in ``ggml_backend_amx_mul_mat``, llama-cpp-python
    0.3.35 and 0.3.36, an Intel Xeon VM); without the extra buffers it runs the plain
    CPU kernels. ``Llama`` reads ``llama_model_default_params()`` once, while it loads."""
    low = llama_cpp.llama_cpp
    if extra_buffers:
        yield
        return
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def route_llama_logs(llama_cpp: Any) -> None:
    """Send llama.cpp's C log lines to Python logging (see :class:`_LlamaLog`)."""
    if _LOG_HOOK:
        return
    import ctypes

    lines = _LlamaLog()

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def hook(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines(level, text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(hook, ctypes.c_void_p(0))
    _LOG_HOOK.append(hook)


def load_vocab(path: str, chat_format: str | None = None) -> Any:
    """A GGUF's vocabulary only (no weights), as llama-cpp-python's ``Llama``, for counting
    tokens the way a server running that file counts them; ``chat_format`` as the
    server's ``--chat_format`` (None: its default). Blocking: call it off the event loop.
    Its log lines go where the engine's go (see :func:`route_llama_logs`)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    import llama_cpp

    route_llama_logs(llama_cpp)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):  # verbose=True: see load_model
        llm = llama_cpp.Llama(
            model_path=path, vocab_only=True, n_ctx=64, verbose=True, chat_format=chat_format
        )
    log.debug("%s", printed.getvalue())
    return llm  # still verbose: a quiet Llama swaps the process's stdout and stderr when it closes


def load_model(path: str, *, n_ctx: int, n_threads: int, vocab_only: bool = False) -> Any:
    """A GGUF as llama-cpp-python's ``Llama`` (weights and all unless ``vocab_only``); a
    missing file, llama-cpp-python not installed or a file llama.cpp refuses raise one
    clear message. Blocking: call it off the event loop."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError("llama-cpp-python is not installed (pip install 'bourse[local]')") from None
    route_llama_logs(llama_cpp)
    try:
        # verbose=True: llama-cpp-python's quiet mode swaps the process's stdout and
        # stderr file descriptors, which a server must not do; its log lines go to
        # the ``bourse.llamacpp`` logger instead (see route_llama_logs)
        printed = io.StringIO()
        with (
            contextlib.redirect_stderr(printed),  # its load-time prints (metadata) go to the log
            model_params(llama_cpp, extra_buffers=not has_amx()),
        ):
            llm = llama_cpp.Llama(
                model_path=path, n_ctx=n_ctx, n_threads=n_threads, n_batch=min(512, n_ctx),
                verbose=True, vocab_only=vocab_only,
            )  # fmt: skip
        log.debug("%s", printed.getvalue())
        llm.verbose = False  # no per-request prints from here on
        return llm
    except Exception as exc:
        raise RuntimeError(f"llama.cpp refused the file ({type(exc).__name__}: {exc})") from None


def size_mb(path: str) -> float:
    """The file's size in MB (0 when it is missing: its load then says so)."""
    return os.path.getsize(path) / 1e6 if os.path.exists(path) else 0.0
