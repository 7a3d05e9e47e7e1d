"""When a small SQLite transaction may run on the event loop's own thread (the
:class:`InlineGate`), rather than be handed to the commit thread and answered back.

At low load every hold and settlement handed to the commit thread costs two thread
wake-ups and GIL hand-offs, several times what its SQL costs (tens of µs in WAL with
``synchronous=NORMAL``: no fsync on commit). The gate lets at most ``per_turn`` of them
run inline in one turn of the loop, and none for ``backoff_s`` after ``slow_count`` of
the last ``slow_window`` took longer than ``slow_s`` (a slow disk, a checkpoint's I/O)
or after the store asked it to (:meth:`InlineGate.back_off`): the loop is never held
long (a disk slow on every other write, the settle's larger write say, closes it as
one slow on every write does). One slow write alone is not a slow disk: on a busy machine the loop's thread is preempted in the middle
of a few writes in ten thousand, and closing the gate for a second after each sent ~80 %
of the writes of a c=1 load to the commit thread (two wake-ups and GIL hand-offs each)
on this 2-core machine with other work running (``bench.ab --conns 1``: 0.89x the CPU
a request with the gate left open). Under load none runs
inline: once a write finds another still in flight or a turn asks for more than its
budget (:meth:`InlineGate.loaded`), the gate stays shut for ``load_s``, and the writes
go to the commit thread, group-committed as before, whose SQL runs beside the loop's
work on another core (inline, the loop would do both: bench.ab at c=64 measured 3 %
fewer requests a second with every first write of a turn inline).
"""

from __future__ import annotations

import asyncio
import time


class InlineGate:
    """A budget of inline transactions per loop turn, closed for a while after a slow one."""

    __slots__ = (
        "_backoff_s", "_closed_until", "_load_s", "_per_turn", "_recent", "_slow_count", "_slow_s",
        "_used", "_window",
    )  # fmt: skip

    def __init__(
        self,
        *,
        per_turn: int = 1,
        slow_s: float = 0.005,
        slow_count: int = 2,
        slow_window: int = 8,
        backoff_s: float = 1.0,
        load_s: float = 0.05,
    ) -> None:
        self._per_turn = per_turn
        self._slow_s = slow_s
        self._slow_count = max(1, slow_count)
        self._window = (1 << max(self._slow_count, slow_window)) - 1
        self._recent = 0
        """The last inline transactions, newest in the lowest bit: 1 for a slow one."""
        self._backoff_s = backoff_s
        self._load_s = load_s
        self._used = 0
        self._closed_until = 0.0

    def admit(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether one more transaction may run inline now (counted on this turn)."""
        if self._used >= self._per_turn:
            self.loaded()
            return False
        if self._closed_until and time.monotonic() < self._closed_until:
            return False
        if not self._used:
            loop.call_soon(self._new_turn)  # the next turn starts with its budget whole
        self._used += 1
        return True

    def _new_turn(self) -> None:
        self._used = 0

    def ran(self, seconds: float) -> None:
        """An inline transaction took ``seconds``: past ``slow_s``, and the
        ``slow_count``-th such of the last ``slow_window``, it closes the gate."""
        slow = seconds > self._slow_s
        self._recent = ((self._recent << 1) | slow) & self._window
        if slow and self._recent.bit_count() >= self._slow_count:
            self._recent = 0
            self.back_off()

    def back_off(self) -> None:
        """No inline transaction for ``backoff_s``."""
        self._closed_until = time.monotonic() + self._backoff_s

    def loaded(self) -> None:
        """Writes come faster than one at a time: none inline for ``load_s`` (or longer,
        if the gate is shut longer already)."""
        self._closed_until = max(self._closed_until, time.monotonic() + self._load_s)


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The loop running on this thread, or None (another thread's call)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
