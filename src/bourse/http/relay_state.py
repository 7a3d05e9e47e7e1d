"""A relay's two states, each only moving forward by its table: its answer's
:class:`Stage` (nothing written, the head out, the end being written) and its
client's :class:`Presence` (there, or gone). They are independent: a client may leave
at any stage, and under the ``drain`` policy the relay goes on reading the engine, to
its end, for a client that is gone."""

from __future__ import annotations

from enum import IntEnum


class Stage(IntEnum):
    """Where a relay's answer is."""

    OPEN = 0
    """Nothing written yet: a failure can still be an error response."""
    STARTED = 1
    """A stream's head is out: its frames follow, and a failure is an in-band error frame."""
    CLOSING = 2
    """The end is being written (a stream's tail; a whole answer, head and body), or the
    relay is done: no more quiet-interval frames, and a client leaving no longer stops it."""


STAGE_MOVES: frozenset[tuple[Stage, Stage]] = frozenset(
    {
        (Stage.OPEN, Stage.STARTED),
        (Stage.OPEN, Stage.CLOSING),  # a relay that ended before any write
        (Stage.STARTED, Stage.CLOSING),
        (Stage.CLOSING, Stage.CLOSING),  # every way out closes: the first one counts
    }
)
"""The only moves of a :class:`Stage`."""


class Presence(IntEnum):
    """Whether the relay's client is still there."""

    THERE = 0
    GONE = 1
    """Disconnected: nothing more is written to it."""


PRESENCE_MOVES: frozenset[tuple[Presence, Presence]] = frozenset(
    {(Presence.THERE, Presence.GONE), (Presence.GONE, Presence.GONE)}
)
"""The only moves of a :class:`Presence` (a connection lost is heard of once per way)."""


class IllegalMove(RuntimeError):
    """A relay state asked to move where its table has no move."""


def moved(table: frozenset[tuple[Stage, Stage]] | frozenset[tuple[Presence, Presence]],
          now: Stage | Presence, to: Stage | Presence) -> None:  # fmt: skip
    """Check the move ``now -> to`` against its ``table``; IllegalMove if it is not there."""
    if (now, to) not in table:
        raise IllegalMove(f"{now.__class__.__name__}: {now.name} -> {to.name}")
