"""Finished requests as they are recorded, and the requests refused before the book:
the dashboard's live tail.

The feed listens to the completion service's ``on_settled`` hook. When a request of
this process is settled and someone watches (the usage record is written with the
charge, in the ledger's transaction), it reads the record and hands the
stored record to every watcher whose filter takes it. Each watcher has a bounded
queue: a watcher too slow to keep up loses the oldest records, never blocks a
request. The page lists earlier records (and those of other replicas) from the
store; the tail adds this process's new ones as they land.

A request refused before it became a run (401, 402, 403, 404, 429, a full book's
503, …: the observer's ``refused``) has no usage record: it never reached the book,
holds no money and is written to no table. The feed keeps the last ``keep_refused``
of this process in memory, as records of outcome ``refused`` (cost 0, the status and
the error code in ``record``), lists them (:meth:`refusals`) and hands each new one
to the watchers like a finished request. With replicas (``[cluster]``) each refusal
is also written to the list they share (:class:`~bourse.ports.refusals.SharedRefusals`,
Redis), so every replica lists every replica's; that list unreadable, a replica lists
its own. Without one they are per process (a worker of ``serve --workers`` lists the
refusals it answered), and forgotten when it stops. The ledger never sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

from bourse.ports.observer import Caller
from bourse.ports.refusals import SharedRefusals
from bourse.ports.stores import UsageRecord, UsageStore
from bourse.services.billing import Closing
from bourse.services.completion import CompletionService
from bourse.services.run_events import Finished

log = logging.getLogger("bourse.dashboard")

Match = Callable[[UsageRecord], bool]

REFUSED = "refused"
"""The outcome of a request refused before the book (never a usage record's)."""


class RequestFeed:
    def __init__(
        self,
        completions: CompletionService,
        usage: UsageStore,
        *,
        queue_max: int = 256,
        keep_refused: int = 1000,
        shared: SharedRefusals | None = None,
    ) -> None:
        self._completions = completions
        self._usage = usage
        self._queue_max = queue_max
        self._watchers: list[tuple[Match, asyncio.Queue[UsageRecord]]] = []
        self._refused: deque[UsageRecord] = deque(maxlen=keep_refused)
        self._shared = shared
        self._keep = keep_refused
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

    def refused(self, caller: Caller, status: int, code: str) -> None:
        """The observer's word of a request refused before it became a run: kept, and
        handed to the watchers."""
        created = time.time() - max(0.0, time.perf_counter() - caller.started)
        doc = {"id": caller.request_id, "object": "bourse.refusal", "created": int(created),
               "model": caller.product, "endpoint": caller.route, "outcome": REFUSED, "status": status,
               "error": {"code": code}, "key_id": caller.key_id}  # fmt: skip
        if caller.correlation_id is not None:
            doc["correlation_id"] = caller.correlation_id
        rec = UsageRecord(
            caller.request_id, caller.account_id or "", caller.product or "", created, REFUSED, 0, doc
        )
        self._refused.append(rec)
        self.publish(rec)
        if self._shared is not None:
            self._shared.add(json.dumps({"account": rec.account_id, "at": created, "doc": doc}))

    async def refusals(self, match: Match, limit: int) -> list[UsageRecord]:
        """The refusals kept that ``match`` takes, newest first (at most ``limit``):
        every replica's where they are shared, with this process's own not yet written."""
        kept: list[UsageRecord] = list(reversed(self._refused))
        if self._shared is not None:
            try:
                lines = await self._shared.recent()
            except Exception as exc:  # the shared list away: this process's own
                log.warning("refusals: the shared list not read (%s); this replica's own", type(exc).__name__)
            else:
                seen = {r.request_id for r in kept}
                kept += [r for r in map(_record, lines) if r is not None and r.request_id not in seen]
                kept.sort(key=lambda r: r.created_at, reverse=True)
                del kept[self._keep :]
        out: list[UsageRecord] = []
        for rec in kept:
            if match(rec):
                out.append(rec)
                if len(out) >= limit:
                    break
        return out

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


def _record(line: str) -> UsageRecord | None:
    """A refusal as :meth:`RequestFeed.refused` wrote it to the shared list (None: a
    line this version cannot read, skipped)."""
    try:
        entry = json.loads(line)
        doc = entry["doc"]
        return UsageRecord(str(doc["id"]), str(entry["account"]), str(doc.get("model") or ""),
                           float(entry["at"]), REFUSED, 0, doc)  # fmt: skip
    except (ValueError, KeyError, TypeError):
        return None
