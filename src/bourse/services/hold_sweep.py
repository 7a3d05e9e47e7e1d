"""The hold sweeper: no hold stays open on a live gateway after its store comes back.

A run's hold is closed when the run ends (:meth:`~bourse.services.billing.Billing.settle`),
retried for a few seconds. A store that stays unavailable longer (a full disk, a
database that refuses connections) used to leave the hold open, its amount kept from
the balance with nothing running, until the gateway's next start. :class:`HoldSweeper`
keeps what this gateway knows of its holds, in memory and bounded:

- the holds **in flight**: placed (or being placed) by a run that has not closed them;
- the **closes the store refused**: each run's own decision (settle with its charge and
  usage record, release, reconcile), kept as :class:`HoldClose` and written by the
  next sweep, so the balance comes back as the run decided;
- the holds whose **placement failed** (or was cancelled): such a hold may have been
  placed after all (a cancelled caller's transaction stands; a connection lost during
  COMMIT has an unknown outcome), and no run ever held it.

:meth:`HoldSweeper.sweep` (every ``[storage] hold_sweep_interval_s``, from
:class:`~bourse.services.housekeeping.Housekeeping`, and once more by the drain before
the gateway exits) writes the refused closes, then reads this gateway's own open holds
(``owner`` is this instance; another replica's are the lease's business, see
``Billing._beat``) and closes each that is neither in flight nor waiting for its close:
one whose placement failed is released (nothing ran), any other is reconciled, as the
start-up reconciliation does with a previous life's holds (the same statement,
narrowed to these holds), and waits for an operator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from bourse.domain.charging import Action
from bourse.domain.values import immutable
from bourse.ports.stores import HoldNotOpen, LedgerStore, StoreUnavailable, UsageRecord

log = logging.getLogger("bourse.billing")

MAX_KEPT = 100_000
"""Refused closes (and failed placements) kept for the sweeper. Past it a hold left open
is reconciled by the sweep as one no run holds (its amount then waits for an operator)."""
CONCURRENCY = 64
"""Refused closes a sweep writes at once."""
SCAN_LIMIT = 10_000
"""Open holds of this gateway one sweep looks at (oldest first)."""
MAX_FAILURES = 3
"""Sweeps that may fail to write a kept close for another reason than the store's
unavailability (a fault of the gateway) before its hold is reconciled instead."""
UNPLACED_KEEP_S = 60.0
"""How long a failed placement is remembered: a cancelled caller's transaction may still
commit a moment after the caller gave up on it."""


@immutable
class HoldClose:
    """A hold's close as its run decided it."""

    hold_id: str
    action: Action
    cost_micros: int
    usage: UsageRecord | None
    now: float


class HoldSweeper:
    """This gateway's holds that the store has not closed yet, and their sweep."""

    def __init__(
        self,
        store: LedgerStore,
        owner: str,
        write: Callable[[HoldClose, bool], Awaitable[None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.owner = owner
        self.clock = clock
        """The time written on a hold it closes (the billing's database clock)."""
        self._write = write
        """Writes one close (the second argument: written by a sweep, not its run)."""
        self.in_flight: set[str] = set()
        """Holds placed, or being placed, by runs that have not closed them yet."""
        self.refused: dict[str, HoldClose] = {}
        """The closes the store refused, by hold id."""
        self._unplaced: dict[str, float] = {}
        """Holds whose placement failed, by id: when (monotonic)."""
        self._failures: dict[str, int] = {}
        """Sweeps whose write of a refused close failed otherwise than by unavailability."""
        self._lock = asyncio.Lock()

    # -- what the runs tell it (no I/O) -------------------------------------------------

    def placing(self, hold_id: str) -> None:
        self.in_flight.add(hold_id)

    def not_placed(self, hold_id: str) -> None:
        """The placement failed or was cancelled: it may have been placed all the same."""
        self.in_flight.discard(hold_id)
        if len(self._unplaced) < MAX_KEPT:
            self._unplaced[hold_id] = time.monotonic()

    def done(self, hold_id: str) -> None:
        """The run is done with its hold (closed, or its close kept by :meth:`keep`)."""
        self.in_flight.discard(hold_id)

    def keep(self, close: HoldClose, exc: BaseException) -> None:
        """Writing ``close`` failed with ``exc``: the sweeper writes it."""
        trace = None if isinstance(exc, StoreUnavailable | asyncio.CancelledError) else exc
        if len(self.refused) < MAX_KEPT:
            self.refused[close.hold_id] = close
            log.error("hold %s stays open (its %s failed: %s); the hold sweeper writes it once the "
                      "database takes it", close.hold_id, close.action, exc, exc_info=trace)  # fmt: skip
        else:
            log.error("hold %s stays open (its %s failed: %s) and %d closes wait already; the hold "
                      "sweeper will reconcile it", close.hold_id, close.action, exc, MAX_KEPT, exc_info=trace)  # fmt: skip

    # -- the sweep ----------------------------------------------------------------------

    async def sweep(self) -> int:
        """Write the refused closes, then close this gateway's open holds that no run
        holds; the number of holds closed. Raises the store's failure if it still
        refuses (what was not written waits for the next sweep)."""
        async with self._lock:
            closed = await self._write_refused()
            return closed + await self._close_unheld()

    async def _write_refused(self) -> int:
        written = 0
        pending = list(self.refused.values())
        for i in range(0, len(pending), CONCURRENCY):
            chunk = pending[i : i + CONCURRENCY]
            outcomes = await asyncio.gather(*(self._write(c, True) for c in chunk), return_exceptions=True)
            unavailable: StoreUnavailable | None = None
            for close, outcome in zip(chunk, outcomes, strict=True):
                if isinstance(outcome, StoreUnavailable):
                    unavailable = outcome
                elif isinstance(outcome, BaseException):
                    self._failed(close, outcome)
                elif self.refused.get(close.hold_id) is close:
                    del self.refused[close.hold_id]
                    self._failures.pop(close.hold_id, None)
                    written += 1
            if unavailable is not None:  # the rest waits for the next sweep
                if written:
                    log.warning("hold sweep: %d refused closes written, the rest wait", written)
                raise unavailable
        if written:
            log.warning(
                "hold sweep: %d holds closed as their runs decided (the database had refused it)", written
            )
        return written

    def _failed(self, close: HoldClose, exc: BaseException) -> None:
        """Writing ``close`` failed with something else than the store's unavailability (a
        fault of the gateway): tried again by the next sweeps, then given up, its hold then
        reconciled by the sweep after (it waits for an operator)."""
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        n = self._failures[close.hold_id] = self._failures.get(close.hold_id, 0) + 1
        if n < MAX_FAILURES:
            log.error("hold sweep: writing the %s of hold %s failed (%d of %d)", close.action, close.hold_id,
                      n, MAX_FAILURES, exc_info=exc)  # fmt: skip
            return
        log.error("hold sweep: the %s of hold %s failed %d times; the hold is reconciled instead",
                  close.action, close.hold_id, n, exc_info=exc)  # fmt: skip
        self.refused.pop(close.hold_id, None)
        self._failures.pop(close.hold_id, None)

    async def _close_unheld(self) -> int:
        looked = time.monotonic()
        ids = await self.store.open_hold_ids(self.owner, SCAN_LIMIT)
        unheld = [h for h in ids if h not in self.in_flight and h not in self.refused]
        unplaced = self._unplaced
        release = [h for h in unheld if h in unplaced]
        others = [h for h in unheld if h not in unplaced]
        closed = 0
        for hold_id in release:  # its placement failed: no run ever held it
            try:
                await self.store.release(hold_id, None, self.clock())
                closed += 1
            except HoldNotOpen:
                pass
        if others:
            n = await self.store.reconcile_orphans(self.owner, all_others=False, hold_ids=others)
            if n:
                log.warning("hold sweep: %d holds of this gateway that no run holds are now 'reconciling' "
                            "(see GET /admin/holds)", n)  # fmt: skip
            closed += n
        if release:
            log.warning("hold sweep: %d holds placed by a failed placement released", len(release))
        for hold_id, at in list(unplaced.items()):
            if at < looked - UNPLACED_KEEP_S:  # placed and released by now, or never placed
                del unplaced[hold_id]
        return closed
