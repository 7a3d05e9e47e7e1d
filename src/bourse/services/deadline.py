"""Deadline orders (issue 38, SPEC section 10): "start me by this deadline, as cheaply
as you can, never above this price".

A request sends ``deadline_s`` with ``max_price`` as its ceiling. It keeps a **reserve**
(:func:`reserve_s`): the time it needs at its ceiling to start, as the market predicts
it now (:data:`RESERVE` times the wait predicted at the ceiling with the arrivals at
their mean rate, and the wait at the newest arrivals' rate once, each plus a tick for a
raise to take effect; the last stretch of its deadline, :func:`last_stretch_s`, at
least: :func:`reserve_of`). Its order enters the book at the lowest bid the market
predicts will be admitted before the reserve begins (:data:`PATIENCE`)
(:meth:`~bourse.services.market.Market.bid_for` for the deadline less the reserve,
``steady``: with the arrivals at their mean rate over the recent minutes, not a burst's,
and the wait as predicted, not stretched by the score's margin: a burst passes, and a
low bid waits it out to be admitted as the book clears, at a low price; if it is not,
the reserve is its margin), and while it waits :func:`raise_bids` prices it again every
tick (:func:`tick_s`) the same way for the time left (:func:`price`), each new bid a
raise of the last (:func:`next_bid`: never lower, never above the ceiling). In its
reserve (and the last stretch) it bids the ceiling itself, and it enters at the ceiling
when its reserve is its whole deadline: it pays the second price, set by the others,
never by its own bid, so it saves only by being admitted at a cheaper moment, a lull
after a burst; where none is predicted before its deadline, a bid under the ceiling
buys nothing (the bids between it and the ceiling go first, and it is admitted later,
at the top of a book as busy or busier) and it behaves as a fixed order at its ceiling
does. So an order bids low while the book is predicted to clear in time (and is
admitted at that bid if a slot comes to it: it pays at most its bid), and in the time a
fixed order would need, the ceiling. Each raise re-ranks
the order at its new price with its arrival kept
(:meth:`~bourse.ports.book.BookPort.rebid`). At the deadline the order has been admitted
or ends, as any order at its timeout, with 408 ``book_timeout``. It pays the second
price, as every order does: what it took to beat the next order, never more than the bid
it cleared at.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

from bourse.domain.book import Admission, Order
from bourse.domain.errors import GatewayError
from bourse.domain.policy import Policy

log = logging.getLogger("bourse.market")


class Market(Protocol):
    """What a deadline order needs of its :class:`~bourse.services.market.Market`."""

    policy: Policy

    async def bid_for(
        self, within_s: float, ceiling: float, order: Order | None = None, *, steady: bool = False
    ) -> float: ...

    async def rebid(self, order: Order, bid: float) -> bool: ...

    async def wait_at(self, bid: float, *, steady: bool = False) -> float | None: ...


MIN_TICK_S = 0.05
"""A deadline order is priced again at most this often."""
TICKS_PER_DEADLINE = 10
"""... and at least this many times over its deadline."""
LAST_STRETCH = 0.2
"""The share of its deadline (at least one tick) at the end of which a deadline order
bids its ceiling: a slot frees only when a generation ends, so the order must rank
first a while before its deadline to take one in time."""
RESERVE = 1.5
"""A deadline order keeps this many times the wait predicted at its ceiling (and a
tick) for the ceiling: a prediction is a median, and a wait longer than predicted is
not rare. A longer reserve has the order raised to its ceiling more often, and an order
raised to its ceiling is admitted at the top of a busy book (it waited low because bids
between it and its ceiling were there), paying about its ceiling; a shorter one misses
more deadlines (market bench, 0.8x bursty, 124 pairs a run: 1.0 with a :data:`PATIENCE`
of 2, 3 points under the fixed bids' met share; 1.5 and 2.0 within the noise of each
other, in met share and price)."""
PATIENCE = 1.0
"""Before its reserve a deadline order bids the lowest price whose predicted wait (at
the arrivals' mean rate) is this many times the time left before the reserve: a price
the market predicts will clear before then, a lull it predicts, not one it does not
(more than 1 bets on a wait longer than predicted: lost, the order is raised to its
ceiling in a busy book)."""


def tick_s(deadline_s: float, quiet_interval_s: float) -> float:
    """How often a deadline order is priced again: every quiet interval of its product
    (the interval of its progress frames), and at least :data:`TICKS_PER_DEADLINE` times
    over its deadline."""
    return max(MIN_TICK_S, min(quiet_interval_s, deadline_s / TICKS_PER_DEADLINE))


def last_stretch_s(deadline_s: float, tick: float) -> float:
    """The time before its deadline from which a deadline order bids its ceiling."""
    return max(tick, LAST_STRETCH * deadline_s)


def next_bid(current: float, proposed: float, left_s: float, stretch_s: float, ceiling: float) -> float:
    """The bid from now of an order bidding ``current`` with ``left_s`` seconds to its
    deadline: the market's ``proposed`` price for that time, raised only (never below
    ``current``) and never above ``ceiling``; the ceiling in the last stretch
    (``stretch_s`` or less left)."""
    if left_s <= stretch_s:
        return ceiling
    return min(ceiling, max(current, proposed))


def reserve_of(steady_s: float | None, now_s: float | None, stretch: float, tick: float) -> float:
    """The reserve of a deadline order whose wait at its ceiling is predicted
    ``steady_s`` with the arrivals above at their mean rate and ``now_s`` at the newest
    ones' (None: no slot predicted to come to it): :data:`RESERVE` times the steady wait
    (a burst passes) and the wait at the newest rate once (it may not pass soon), each
    with a tick for the raise to take effect; the last ``stretch`` at least; infinite
    when no slot is predicted to come to the ceiling even at the mean rate."""
    if steady_s is None:
        return math.inf
    reserve = max(stretch, RESERVE * steady_s + tick)
    return reserve if now_s is None else max(reserve, now_s + tick)


async def reserve_s(market: Market, ceiling: float, stretch: float, tick: float) -> float:
    """The time before its deadline from which a deadline order bids its ceiling: what
    it needs at the ceiling to start as the market predicts it now (:func:`reserve_of`);
    it bids the ceiling at once when that is its whole deadline."""
    steady = await market.wait_at(ceiling, steady=True)
    now = await market.wait_at(ceiling) if steady is not None else None
    return reserve_of(steady, now, stretch, tick)


async def price(
    market: Market,
    order: Order | None,
    current: float,
    left_s: float,
    ceiling: float,
    tick: float,
    stretch: float,
) -> float:
    """The bid from now of an order bidding ``current`` (0: a new one) with ``left_s``
    to its deadline, raised only (:func:`next_bid`): before its reserve
    (:func:`reserve_s`), the lowest bid predicted to start before the reserve begins,
    a burst waited out (``steady``); in its reserve and its last stretch, the ceiling
    (no quote asked): no cheaper moment is predicted before its deadline, and what it
    pays (the second price) does not fall with its own bid."""
    reserve = await reserve_s(market, ceiling, stretch, tick)
    if left_s <= max(stretch, reserve):
        return ceiling
    proposed = await market.bid_for(PATIENCE * (left_s - reserve), ceiling, order, steady=True)
    return next_bid(current, proposed, left_s, stretch, ceiling)


async def start_bid(market: Market, deadline_s: float, ceiling: float) -> float:
    """The bid a deadline order enters the book at."""
    tick = tick_s(deadline_s, market.policy.quiet_interval_s)
    return await price(market, None, 0.0, deadline_s, ceiling, tick, last_stretch_s(deadline_s, tick))


async def raise_bids(market: Market, order: Order, fut: asyncio.Future[Admission], deadline: float) -> None:
    """Price a waiting deadline order again every tick until it is admitted, its deadline
    (loop time) passes, or it bids its ceiling; each higher price is a raise in the book.
    A raise the book cannot take (a shared book unreachable) is tried again at the next
    tick; the order's wait itself fails if the book stays unreachable."""
    ceiling = order.ceiling
    assert ceiling is not None, "a deadline order has a ceiling"
    loop = asyncio.get_running_loop()
    deadline_s = deadline - order.arrived_at
    tick = tick_s(deadline_s, market.policy.quiet_interval_s)
    stretch = last_stretch_s(deadline_s, tick)
    while not fut.done() and order.bid < ceiling:
        left = deadline - loop.time()
        # to the next tick, or to the start of the last stretch; in it, a raise not made
        # (the book busy with its admission, or unreachable) is tried again shortly
        if left > stretch:
            await asyncio.sleep(min(tick, left - stretch))
        else:
            await asyncio.sleep(min(MIN_TICK_S, max(left, 0.0)))
        left = deadline - loop.time()
        if fut.done() or left <= 0:
            return
        bid = await price(market, order, order.bid, left, ceiling, tick, stretch)
        if bid > order.bid:
            try:
                await market.rebid(order, bid)
            except GatewayError as exc:
                log.debug("raise of %s to %g not made: %s", order.id, bid, exc.message)
