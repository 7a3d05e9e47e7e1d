"""Housekeeping: the periodic clean-up no request waits for.

Three chores, each on its own interval:

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
- retention (``[storage] retention_s``, off by default; :meth:`Housekeeping.prune_once`):
  usage records and closed holds past their age are deleted, request by request, their
  sums kept per account (:class:`~bourse.ports.stores.RetentionStore`). Each pass looks
  first with a read and writes only when something is old enough.

A failed pass is logged and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from bourse.ports.stores import IdempotencyStore, RetentionStore, StoreUnavailable

log = logging.getLogger("bourse.housekeeping")

Sweep = Callable[[], Awaitable[int]]
"""One sweep: what it closed or wrote; raises the store's failure (the next pass retries)."""


class HousekeepingStore(IdempotencyStore, RetentionStore, Protocol):
    """What the chores delete from."""


class Housekeeping:
    """Started and stopped with the application (see :class:`bourse.container.Container`)."""

    def __init__(
        self,
        store: HousekeepingStore,
        *,
        interval_s: float,
        batch: int = 1000,
        clock: Callable[[], float] = time.time,
        sweeps: Sequence[Sweep] = (),
        sweep_interval_s: float = 5.0,
        retention_s: float | None = None,
        retention_interval_s: float = 600.0,
        retention_batch: int = 500,
    ) -> None:
        if (
            interval_s <= 0
            or batch < 1
            or sweep_interval_s <= 0
            or retention_interval_s <= 0
            or retention_batch < 1
        ):
            raise ValueError("housekeeping needs positive intervals and batches")
        if retention_s is not None and retention_s <= 0:
            raise ValueError("retention_s must be positive (None: keep for ever)")
        self.store = store
        self.interval_s = interval_s
        self.batch = batch
        self.clock = clock
        self.sweeps = tuple(sweeps)
        """In order: each runs once the one before it went through (holds before job states)."""
        self.sweep_interval_s = sweep_interval_s
        self.retention_s = retention_s
        self.retention_interval_s = retention_interval_s
        self.retention_batch = retention_batch
        """Requests pruned per transaction (their holds and usage records: a few rows each)."""
        self.passes = 0
        """Purge passes completed (successful or not): what tests and operators can watch."""
        self.sweep_passes = 0
        """Sweep passes completed (successful or not)."""
        self.retention_passes = 0
        """Retention passes completed (successful or not)."""
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._retention_task: asyncio.Task[None] | None = None

    async def purge_once(self) -> int:
        """Delete every idempotency key expired by now; how many were deleted."""
        now = self.clock()
        total = 0
        while True:
            n = await self.store.purge_idempotency(now, self.batch)
            total += n
            if n < self.batch:
                return total

    async def prune_once(self) -> tuple[int, int]:
        """Delete the usage records and closed holds past ``retention_s``, in batches of
        ``retention_batch`` requests (each its own short transaction); (holds, usage
        records) deleted. Each batch is looked for with a read first: with nothing old
        enough, no write transaction is opened (an idle gateway writes nothing)."""
        age_s = self.retention_s
        holds = records = 0
        if age_s is None:
            return holds, records
        while True:
            request_ids = await self.store.prunable(age_s, self.retention_batch)
            if not request_ids:
                return holds, records
            h, r = await self.store.prune(request_ids, age_s)
            holds, records = holds + h, records + r
            if len(request_ids) < self.retention_batch or h == 0:  # the last batch (or a race: next pass)
                return holds, records

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
        if self._retention_task is None and self.retention_s is not None:
            self._retention_task = asyncio.create_task(self._retain(), name="bourse-retention")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._sweeper, self._retention_task) if t is not None]
        self._task = self._sweeper = self._retention_task = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _retain(self) -> None:
        while True:
            try:
                holds, records = await self.prune_once()
                if holds or records:
                    log.info(
                        "housekeeping: %d closed holds and %d usage records past the retention (%g s) deleted",
                        holds, records, self.retention_s,
                    )  # fmt: skip
            except Exception:
                log.exception(
                    "housekeeping: pruning the records past the retention failed; next pass retries"
                )
            self.retention_passes += 1
            await asyncio.sleep(self.retention_interval_s)

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
