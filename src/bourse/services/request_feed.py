"""Finished requests as they are recorded: the dashboard's live tail.

The feed listens to the completion service's finish hook. When a request of this
process finishes and someone watches, it waits for the request's settlement (the
usage record is written with the charge, in the ledger's transaction) and hands the
stored record to every watcher whose filter takes it. Each watcher has a bounded
queue: a watcher too slow to keep up loses the oldest records, never blocks a
request. The page lists earlier records (and those of other replicas) from the
store; the tail adds this process's new ones as they land.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

from bourse.ports.stores import UsageRecord, UsageStore
from bourse.services.completion import CompletionService, Finished, Run

log = logging.getLogger("bourse.dashboard")

Match = Callable[[UsageRecord], bool]


class RequestFeed:
    def __init__(self, completions: CompletionService, usage: UsageStore, *, queue_max: int = 256) -> None:
        self._completions = completions
        self._usage = usage
        self._queue_max = queue_max
        self._watchers: list[tuple[Match, asyncio.Queue[UsageRecord]]] = []
        completions.on_finish.append(self._finished)

    def _finished(self, run: Run, fin: Finished) -> None:
        if self._watchers and run.account_id is not None:
            self._completions.spawn(self._publish(run))

    async def _publish(self, run: Run) -> None:
        if run.settle_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(run.settle_task)
        if run.account_id is None:
            return
        try:
            record = await self._usage.usage(run.account_id, run.request_id)
        except Exception as exc:  # the tail is best effort; the list reads the store
            log.warning("request feed: usage record of %s not read: %s", run.request_id, exc)
            return
        if record is not None:
            self.publish(record)

    def publish(self, record: UsageRecord) -> None:
        for match, queue in list(self._watchers):
            if not match(record):
                continue
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(record)

    @contextlib.contextmanager
    def subscribe(self, match: Match) -> Iterator[asyncio.Queue[UsageRecord]]:
        """A queue of each new record ``match`` takes, while the block runs."""
        entry: tuple[Match, asyncio.Queue[UsageRecord]] = (match, asyncio.Queue(self._queue_max))
        self._watchers.append(entry)
        try:
            yield entry[1]
        finally:
            self._watchers.remove(entry)
