"""What a product's market predicts (issue 38): its :class:`~bourse.services.market_forecast.Forecaster`
with the book's state read for it, the waits of the ``: queued`` frames, the quotes,
and the bid a deadline order needs (:meth:`Outlook.bid_for`).

The book in process says its slots in use exactly and at once; the shared book only
through a view (a Redis call): the last one read is kept and read again, in the
background, once it is :data:`VIEW_FRESH_S` old, so the frames of many waiting orders
cost one view between them. An order's own wait, as it rests (the prediction that is
scored) and in its frames, is predicted from a view at most :data:`WAIT_VIEW_FRESH_S`
old (:meth:`Outlook.wait_state`): in a view half a second old, an order of another
replica that has ended since, its slot taken again at once, still looks about to end,
and the order is told it starts then.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence

from bourse.domain.book import Deployment, Order
from bourse.domain.forecast_score import Score
from bourse.domain.market_quote import Quote
from bourse.ports.book import BookPort, BookUnavailable, BookView
from bourse.services.market_forecast import BookState, Forecaster, SlotState

log = logging.getLogger("bourse.market")

VIEW_FRESH_S = 0.5
"""The shared book's view is read again once it is this old (seconds)."""
WAIT_VIEW_FRESH_S = 0.05
"""An order waiting in the shared book (as it rests, and in its frames) is predicted
from a view at most this old, or one whose read began at most this long ago (one read
serves the orders predicted together)."""


class Outlook:
    """One product's predictions on this replica."""

    def __init__(
        self, book: BookPort, deployments: Callable[[], Sequence[Deployment]], default_cap: int
    ) -> None:
        self.book = book
        self._deployments = deployments
        self.forecast = Forecaster(default_cap)
        self._view: BookView | None = None
        self._view_at = -math.inf
        self._view_asked = -math.inf
        """When the read of the view kept began (an older read ending later is not kept)."""
        self._reading: asyncio.Task[None] | None = None
        self._reading_asked = -math.inf

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    # -- the book's state ----------------------------------------------------------------

    def state(self) -> BookState:
        """The book now, as known without waiting (a shared book's view is read again
        in the background when it is stale)."""
        now = self.now()
        busy = self.book.occupancy()
        deps = self._deployments()
        if busy is not None:
            return BookState(
                tuple(SlotState(d.name, d.floor, d.slots, busy.get(d.name, 0), d.can_take(now)) for d in deps)
            )
        if now - self._view_at > VIEW_FRESH_S:
            self._read_soon()
        view = self._view
        seen = {} if view is None else {v.name: v for v in view.deployments}
        out = []
        for d in deps:
            v = seen.get(d.name)
            in_use = self.book.held_on(d.name) if v is None else v.busy
            cooling = v is not None and not v.healthy
            out.append(SlotState(d.name, d.floor, d.slots, in_use, d.can_take(now) and not cooling))
        return BookState(tuple(out), view)

    async def fresh_state(self, max_age: float = VIEW_FRESH_S) -> BookState:
        """The book now, a shared book's view read first if it is more than ``max_age``
        old (a quote); a read begun at most ``max_age`` ago is waited for instead."""
        if self.book.occupancy() is None and self.now() - self._view_at > max_age:
            task = self._reading
            if task is not None and self.now() - self._reading_asked <= max_age:
                await asyncio.shield(task)
            else:
                await self._read(self.now())
        return self.state()

    async def wait_state(self) -> BookState:
        """The book as a waiting order's own wait is predicted from (as it rests, and in
        its frames): a shared book's view at most :data:`WAIT_VIEW_FRESH_S` old."""
        return await self.fresh_state(WAIT_VIEW_FRESH_S)

    def seen(self, view: BookView, asked: float | None = None) -> None:
        """A view of the book just read (the market views; ``asked``: when its read
        began, None: now): kept for the forecast, unless a later read's is kept already."""
        now = self.now()
        asked = now if asked is None else asked
        if asked >= self._view_asked:
            self._view, self._view_at, self._view_asked = view, now, asked

    def _read_soon(self) -> None:
        if self._reading is None:
            self._reading_asked = self.now()
            self._reading = asyncio.get_running_loop().create_task(self._read_in_background())

    async def _read_in_background(self) -> None:
        try:
            await self._read(self._reading_asked)
        finally:
            self._reading = None

    async def _read(self, asked: float) -> None:
        try:
            self.seen(await self.book.view(), asked)
        except BookUnavailable as exc:  # the last view stands; the frames go on
            log.debug("book view for the forecast of %s: %s", self.book.product, exc)
            self._view_at = max(self._view_at, self.now())

    # -- predictions -----------------------------------------------------------------------

    async def wait(self, order: Order, position: int, *, read: bool = True) -> float | None:
        """The predicted wait of ``order``, waiting with ``position`` orders ahead
        (``read``: a shared book's view read first unless just read, :meth:`wait_state`;
        false: the book is unreachable, the last view stands)."""
        state = await self.wait_state() if read else self.state()
        return self.forecast.predict(order, position, self.now(), state)

    def wait_now(self, bid: float) -> float | None:
        """The predicted wait of a new order at ``bid``, from the book's state as known now."""
        return self.forecast.wait_at(bid, self.now(), self.state())

    def score(self) -> Score:
        return self.forecast.score(self.now())

    async def quote(self, within_s: float, order: Order | None = None, *, steady: bool = False) -> Quote:
        """The lowest bid predicted to start within ``within_s`` (``order``: one waiting
        already, priced again: left out of the orders ahead; ``steady``: with the
        arrivals at their mean rate, :meth:`~bourse.services.market_forecast.Forecaster.quote`)."""
        state = await self.fresh_state()
        return self.forecast.quote(within_s, self.now(), state, exclude=order, steady=steady)

    async def wait_at(self, bid: float, *, steady: bool = False) -> float | None:
        """The predicted wait of a new order at ``bid`` (``steady``: with the arrivals
        above at their mean rate)."""
        state = await self.fresh_state()
        return self.forecast.wait_at(bid, self.now(), state, steady=steady)

    async def bid_for(
        self, within_s: float, ceiling: float, order: Order | None = None, *, steady: bool = False
    ) -> float:
        """The quote's bid for ``within_s`` (``steady``: its steady quote), clamped to
        [the lowest floor of the deployments taking orders, ``ceiling``]: ``ceiling``
        when no bid is predicted to start in time (and when ``ceiling`` is under that floor)."""
        q = await self.quote(within_s, order, steady=steady)
        now = self.now()
        floors = [d.floor for d in self._deployments() if d.can_take(now)]
        low = min(floors) if floors else self.book.min_floor
        bid = ceiling if q.bid is None else q.bid
        return min(ceiling, max(low, bid))
