"""Finished requests as they are recorded: the dashboard's live tail.

The feed listens to the completion service's ``on_settled`` hook. When a request of
this process is settled and someone watches (the usage record is written with the
charge, in the ledger's transaction), it reads the record and hands the
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
from bourse.services.billing import Closing
from bourse.services.completion import CompletionService
from bourse.services.run_events import Finished

log = logging.getLogger("bourse.dashboard")

Match = Callable[[UsageRecord], bool]


class RequestFeed:
    def __init__(self, completions: CompletionService, usage: UsageStore, *, queue_max: int = 256) -> None:
        self._completions = completions
        self._usage = usage
        self._queue_max = queue_max
        self._watchers: list[tuple[Match, asyncio.Queue[UsageRecord]]] = []
        completions.on_settled.append(self._settled)

    def _settled(self, closing: Closing, fin: Finished) -> None:
        if self._watchers:
            self._completions.spawn(self._publish(closing.account_id, closing.request_id))

    async def _publish(self, account_id: str, request_id: str) -> None:
        try:
            record = await self._usage.usage(account_id, request_id)
        except Exception as exc:  # the tail is best effort; the list reads the store
            log.warning("request feed: usage record of %s not read: %s", request_id, exc)
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
