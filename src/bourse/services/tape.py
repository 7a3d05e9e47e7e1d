"""The market tape: each product's book sampled over time, for the dashboard.

A product is sampled (one :meth:`Market.view`) every ``interval_s`` (half a second)
while someone watches it, and for ``linger_s`` after the last watcher left, so a page
opened again soon finds its charts filled. Each product keeps its last ``keep``
samples (ten minutes) and its last admissions (the book's recent clears, taken once
each: the growth of ``admitted_total`` between two samples says how many of the
newest are new). An admission whose run then fails before any output is marked a
failed attempt in the book's later views; each sample carries the mark over to the
admission kept (by its order and attempt), so the page shows it apart. Nothing runs for a product nobody watches. Per process: every
replica samples the book it sees (the shared book, with ``[cluster] redis_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field

from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.ports.book import BookView, Clear
from bourse.services.market import Market

log = logging.getLogger("bourse.dashboard")


@immutable
class Sample:
    t: float
    """Wall-clock seconds."""
    view: BookView


@dataclass(slots=True, eq=False)
class _Feed:
    market: Market
    samples: deque[Sample]
    clears: deque[Clear]
    tick: asyncio.Event = field(default_factory=asyncio.Event)
    watchers: int = 0
    left_at: float = 0.0
    admitted: int | None = None
    task: asyncio.Task[None] | None = None


class MarketTape:
    def __init__(
        self,
        markets: Mapping[str, Market],
        *,
        interval_s: float = 0.5,
        keep: int = 1200,
        keep_clears: int = 300,
        linger_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._markets = markets
        self.interval_s = interval_s
        self._keep = keep
        self._keep_clears = keep_clears
        self._linger = linger_s
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}

    def _feed(self, product: str) -> _Feed:
        feed = self._feeds.get(product)
        if feed is None:
            market = self._markets[product]
            feed = _Feed(market, deque(maxlen=self._keep), deque(maxlen=self._keep_clears))
            self._feeds[product] = feed
        return feed

    def history(self, product: str) -> tuple[list[Sample], list[Clear]]:
        """The samples (oldest first) and admissions (newest first) kept for ``product``."""
        feed = self._feeds.get(product)
        if feed is None:
            return [], []
        return list(feed.samples), list(feed.clears)

    async def watch(self, product: str) -> AsyncGenerator[Sample, None]:
        """Each new sample of ``product`` as it is taken (a view that fails gives none),
        until the caller stops iterating. KeyError for an unknown product."""
        feed = self._feed(product)
        feed.watchers += 1
        try:
            if feed.task is None or feed.task.done():
                feed.task = asyncio.create_task(self._sample(product, feed))
            while True:
                await feed.tick.wait()
                yield feed.samples[-1]
        finally:
            feed.watchers -= 1
            feed.left_at = self._clock()

    async def _sample(self, product: str, feed: _Feed) -> None:
        while True:
            live = self._markets.get(product)
            if live is not None and live is not feed.market:  # the product was added again live
                feed.market, feed.admitted = live, None
            try:
                view = await feed.market.view()
            except GatewayError as exc:  # the shared book is unreachable: no sample this time
                log.debug("market tape: no view of %s: %s", product, exc)
            except Exception:  # never leave the watchers waiting on a dead sampler
                log.exception("market tape: sampling %s failed", product)
            else:
                self._record(feed, view)
                tick, feed.tick = feed.tick, asyncio.Event()
                tick.set()
            if feed.watchers == 0 and self._clock() - feed.left_at >= self._linger:
                return
            await asyncio.sleep(self.interval_s)

    def _record(self, feed: _Feed, view: BookView) -> None:
        new = len(view.recent) if feed.admitted is None else view.admitted_total - feed.admitted
        feed.admitted = view.admitted_total
        fresh = max(0, min(new, len(view.recent)))
        for clear in reversed(view.recent[:fresh]):
            feed.clears.appendleft(clear)
        _mark_failed(feed.clears, view.recent[fresh:])
        feed.samples.append(Sample(self._clock(), view))

    async def aclose(self) -> None:
        tasks = [f.task for f in self._feeds.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _mark_failed(kept: deque[Clear], seen: list[Clear]) -> None:
    """Carry the failed marks of the admissions ``seen`` again (newest first) over to
    the copies ``kept`` (newest first; the same objects with the in-process book)."""
    failed = {(c.order_id, c.attempt) for c in seen if c.failed and c.order_id}
    if not failed:
        return
    for clear in kept:  # a few hundred, and only while the book shows a failed attempt
        if not clear.failed and (clear.order_id, clear.attempt) in failed:
            clear.failed = True
