"""One engine attempt's stall clock: a generation that gives no chunk for the
product's ``stall_timeout_s`` is ended, whatever the engine."""

from __future__ import annotations

import asyncio

STALL_TICKS = 4
"""The stall clock looks every ``stall_timeout_s / STALL_TICKS`` seconds, so a stall is
ended between ``stall_timeout_s`` and ``(1 + 1 / STALL_TICKS) * stall_timeout_s`` after
the engine was asked for a chunk it never gave."""


class StallClock:
    """One engine attempt's stall clock: a generation that gives no chunk for the
    product's ``stall_timeout_s`` is ended, whatever the engine.

    One timer handle per attempt, rescheduled each tick, never per chunk. The run marks
    in :attr:`pull` whether it waits on the engine: 0 while its consumer holds the last
    chunk (a slow client is not the engine's stall), 1 and up while the engine is asked;
    each chunk sets it back to 0. Each tick that finds the run waiting counts one more;
    past ``STALL_TICKS`` whole ticks the clock cancels the task iterating the engine (as
    :func:`asyncio.timeout` does) and :meth:`caused` tells the run that this cancellation
    was the clock's, which the run turns into an :class:`EngineFailure`. ``stall_s``
    None: no clock (an engine that bounds a whole answer's wait itself)."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_loop", "_task", "_tick", "pull", "stall_s")

    def __init__(self, stall_s: float | None) -> None:
        self.pull = 0
        self.stall_s = stall_s
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None
        if stall_s is None:
            return
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._tick = stall_s / STALL_TICKS
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self._tick, self._check)

    def _check(self) -> None:
        if self.pull:
            self.pull += 1
            if self.pull > STALL_TICKS + 1:  # waited STALL_TICKS whole ticks at least
                self._fired = True
                self._handle = None
                self._task.cancel()
                return
        self._handle = self._loop.call_later(self._tick, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def caused(self) -> bool:
        """Whether the cancellation being handled is the clock's alone (then it is
        taken back, as :func:`asyncio.timeout` does); another one is the consumer's."""
        return self._fired and self._task.uncancel() <= self._cancelling
