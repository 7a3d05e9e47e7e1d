"""Housekeeping: the periodic clean-up no request waits for.

Today one chore: expired idempotency keys are deleted
(:meth:`~bourse.ports.stores.IdempotencyStore.purge_idempotency`), so the table holds
about one TTL's worth of keys instead of growing without bound. A key past its TTL
is already treated as new by ``idem_begin``; the purge frees the rows nobody reuses.

It runs once at start and then every ``interval_s``, in batches of ``batch`` rows
(each batch its own short transaction, so the single SQLite writer is never held
for long). A failed pass is logged and the next one tries again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from bourse.ports.stores import IdempotencyStore

log = logging.getLogger("bourse.housekeeping")


class Housekeeping:
    """Started and stopped with the application (see :class:`bourse.container.Container`)."""

    def __init__(
        self,
        store: IdempotencyStore,
        *,
        interval_s: float,
        batch: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or batch < 1:
            raise ValueError("housekeeping needs a positive interval and batch")
        self.store = store
        self.interval_s = interval_s
        self.batch = batch
        self.clock = clock
        self.passes = 0
        """Passes completed (successful or not): what tests and operators can watch."""
        self._task: asyncio.Task[None] | None = None

    async def purge_once(self) -> int:
        """Delete every idempotency key expired by now; how many were deleted."""
        now = self.clock()
        total = 0
        while True:
            n = await self.store.purge_idempotency(now, self.batch)
            total += n
            if n < self.batch:
                return total

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="bourse-housekeeping")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

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
