"""The shared database's clock, as read from this process.

Replicas compare times that other replicas wrote: a job's ``expires_at`` against the
sweeper's now, a hold's spend-cap day, an idempotency key's claim (a replica whose
clock ran ahead would take another's live claim for expired, and run its request
twice), a stored response's expiry, an API key's expiry and grace, a dashboard
session's. One instance per gateway, shared by every service that writes or judges
such a time. Each replica's own ``time.time()`` may be
minutes off (no NTP, a VM resumed, a container on a skewed host), so these times are
taken on the database's clock instead: :meth:`DatabaseClock.now` is the local clock
plus the offset measured at each ledger heartbeat (the heartbeat returns the
database's time; the offset is its distance from the middle of the round trip, so
it is right to within half a round trip plus the drift between two heartbeats).
Leases and take-overs themselves are judged inside the database's SQL, not here
(:mod:`bourse.storage.sql`).

With SQLite (one process, one file) the database's clock is this process's: the
offset stays 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class DatabaseClock:
    """``now()`` on the database's clock; :meth:`observe` after each round trip that read it."""

    __slots__ = ("_local", "offset_s")

    def __init__(self, local: Callable[[], float] = time.time) -> None:
        self._local = local
        self.offset_s = 0.0
        """The database's clock minus this process's, in seconds."""

    def now(self) -> float:
        return self._local() + self.offset_s

    def local(self) -> float:
        """This process's own clock (for a round trip's ends, and times no replica compares)."""
        return self._local()

    def observe(self, database_now: float, sent_at: float, answered_at: float) -> None:
        """The database answered ``database_now`` to a call sent at ``sent_at`` and answered
        at ``answered_at`` (both :meth:`local`)."""
        self.offset_s = database_now - (sent_at + answered_at) / 2
