"""Housekeeping: the periodic clean-up no request waits for.

Two chores, each on its own interval:

- expired idempotency keys are deleted
  (:meth:`~bourse.ports.stores.IdempotencyStore.purge_idempotency`), so the table holds
  about one TTL's worth of keys instead of growing without bound. A key past its TTL
  is already treated as new by ``idem_begin``; the purge frees the rows nobody reuses.
  It runs once at start and then every ``interval_s``, in batches of ``batch`` rows
  (each batch its own short transaction, so the single SQLite writer is never held
  for long).
- the sweeps (every ``sweep_interval_s``, ``[storage] hold_sweep_interval_s``): what
  the store refused while it was unavailable is written once it takes it again, and
  this gateway's holds that no run holds are closed
  (:meth:`~bourse.services.hold_sweep.HoldSweeper.sweep`, then the jobs' refused states,
  :meth:`~bourse.services.jobs.JobService.sweep`). :meth:`Housekeeping.sweep_once` is
  also what the drain runs before the gateway exits. A sweep that finds nothing to do
  only reads: it writes no row (so an idle SQLite store stays idle and empties its WAL).

A failed pass is logged and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from bourse.ports.stores import IdempotencyStore, StoreUnavailable

log = logging.getLogger("bourse.housekeeping")

Sweep = Callable[[], Awaitable[int]]
"""One sweep: what it closed or wrote; raises the store's failure (the next pass retries)."""


class Housekeeping:
    """Started and stopped with the application (see :class:`bourse.container.Container`)."""

    def __init__(
        self,
        store: IdempotencyStore,
        *,
        interval_s: float,
        batch: int = 1000,
        clock: Callable[[], float] = time.time,
        sweeps: Sequence[Sweep] = (),
        sweep_interval_s: float = 5.0,
    ) -> None:
        if interval_s <= 0 or batch < 1 or sweep_interval_s <= 0:
            raise ValueError("housekeeping needs positive intervals and batch")
        self.store = store
        self.interval_s = interval_s
        self.batch = batch
        self.clock = clock
        self.sweeps = tuple(sweeps)
        """In order: each runs once the one before it went through (holds before job states)."""
        self.sweep_interval_s = sweep_interval_s
        self.passes = 0
        """Purge passes completed (successful or not): what tests and operators can watch."""
        self.sweep_passes = 0
        """Sweep passes completed (successful or not)."""
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def purge_once(self) -> int:
        """Delete every idempotency key expired by now; how many were deleted."""
        now = self.clock()
        total = 0
        while True:
            n = await self.store.purge_idempotency(now, self.batch)
            total += n
            if n < self.batch:
                return total

    async def sweep_once(self) -> int:
        """Every sweep once, in order; what they closed or wrote. Raises the store's
        failure (the sweeps after the failing one wait for the next pass)."""
        total = 0
        for sweep in self.sweeps:
            total += await sweep()
        return total

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="bourse-housekeeping")
        if self._sweeper is None and self.sweeps:
            self._sweeper = asyncio.create_task(self._sweep(), name="bourse-sweeps")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._sweeper) if t is not None]
        self._task = self._sweeper = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self) -> None:
        while True:
            try:
                purged = await self.purge_once()
                if purged:
                    log.info("housekeeping: %d expired idempotency keys deleted", purged)
            except Exception:
                log.exception("housekeeping: purging expired idempotency keys failed; next pass retries")
            self.passes += 1
            await asyncio.sleep(self.interval_s)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep_once()
            except StoreUnavailable as exc:  # what it could not write waits, in memory
                log.warning("sweep: the database is still unavailable (%s); the next pass retries", exc)
            except Exception:
                log.exception("sweep failed; the next pass retries")
            self.sweep_passes += 1
