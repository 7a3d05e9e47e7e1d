"""Request ids: ``chatcmpl-…`` for chat, ``cmpl-…`` for legacy completions, ``req-…`` else;
and the random hex of the ids made for every request (the request's, its hold's).

The randomness is the operating system's (``os.urandom``), drawn a few kilobytes at a
time rather than 12 bytes per id: each draw is a system call that lets the event loop's
thread give up the interpreter lock to another thread (the database's) mid-request. The
unused bytes are dropped in a forked child, which would otherwise repeat its parent's ids.
"""

from __future__ import annotations

import os
import threading

_DRAW_BYTES = 4096


class _Entropy:
    """Bytes of ``os.urandom``, handed out once each (any thread)."""

    __slots__ = ("_buf", "_lock", "_pos")

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bytes:
        with self._lock:
            pos = self._pos
            end = pos + n
            if end > len(self._buf):
                self._buf, pos, end = os.urandom(max(n, _DRAW_BYTES)), 0, n
            self._pos = end
            return self._buf[pos:end]

    def forget(self) -> None:
        """Drop what is left (a forked child: its parent hands out the same bytes)."""
        self._buf, self._pos, self._lock = b"", 0, threading.Lock()


_ENTROPY = _Entropy()
os.register_at_fork(after_in_child=_ENTROPY.forget)


def random_hex(n_bytes: int = 12) -> str:
    """``n_bytes`` random bytes from ``os.urandom``, as hex (each byte used once)."""
    return _ENTROPY.take(n_bytes).hex()


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-" if kind == "completion" else kind + "-"
    return prefix + _ENTROPY.take(12).hex()
