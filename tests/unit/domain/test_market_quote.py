"""Quotes (issue 38, item 2): the lowest bid predicted to start within a wait, over the
prices that matter; monotone in the wait; a deadline order's bid clamped."""

from __future__ import annotations

import asyncio

import pytest

from bourse.coordination.book_local import LocalBook
from bourse.domain.book import Deployment, Order, ProductBook
from bourse.domain.forecast import ArrivalHistory
from bourse.domain.market_quote import candidate_bids, just_above, lowest_bid
from bourse.services.market_forecast import BookState, Forecaster, SlotState
from bourse.services.market_outlook import Outlook

pytestmark = pytest.mark.anyio


def test_just_above_ranks_before_the_orders_at_a_price() -> None:
    assert just_above(0.9) == 0.901 and just_above(1.0) == 1.01 and just_above(12.5) == 12.6
    assert just_above(0.1) > 0.1 and just_above(0.0) == 0.001


def test_the_prices_that_matter_are_the_floors_the_bids_and_just_above_them() -> None:
    assert candidate_bids([0.5, 2.0], [1.0, 1.0, 0.3]) == [0.5, 1.0, 1.01, 2.0]  # 0.3 under the floor
    assert candidate_bids([], [1.0]) == []


def _book(fc: Forecaster) -> BookState:
    """One slot, 2 s runs, the one running with 1 s left; orders waiting at 1.0 (3) and 0.5 (2)."""
    for i in range(10):
        o = Order(f"past{i}", 1.0, i, 0.0)
        fc.entering(o, 0.0, None, 100)
        fc.admitted(o, "d", 0.0)
        fc.released(o.id, 2.0)
    running = Order("run", 1.0, 50, 9.0)
    fc.entering(running, 9.0, None, 100)
    fc.admitted(running, "d", 9.0)
    for i, bid in enumerate([1.0, 1.0, 1.0, 0.5, 0.5]):
        o = Order(f"w{i}", bid, 100 + i, 10.0)
        o.position_at_entry = i
        fc.entering(o, 10.0, None, 100)
        fc.rested(o, 10.0, BookState((SlotState("d", 0.1, 1, 1, True),)))
    fc.arrivals = ArrivalHistory()  # the book as it stands: no arrivals above counted
    return BookState((SlotState("d", 0.1, 1, 1, True),))


def test_the_quote_is_the_lowest_bid_whose_wait_fits() -> None:
    fc = Forecaster(default_cap=256)
    state = _book(fc)
    # the slot frees at 1, 3, 5, 7, 9, 11 s from now
    assert fc.wait_at(1.01, 10.0, state) == pytest.approx(1.0)  # before the three at 1.0
    assert fc.wait_at(1.0, 10.0, state) == pytest.approx(7.0)  # behind them
    assert fc.wait_at(0.501, 10.0, state) == pytest.approx(7.0)
    assert fc.wait_at(0.1, 10.0, state) == pytest.approx(11.0)  # behind all five
    q = fc.quote(2.0, 10.0, state)
    assert q.bid == 1.01 and q.wait_s == pytest.approx(1.0)
    q = fc.quote(8.0, 10.0, state)
    assert q.bid == 0.501 and q.wait_s == pytest.approx(7.0)
    q = fc.quote(0.5, 10.0, state)
    assert q.bid is None and q.top_bid == 1.01 and q.top_wait_s == pytest.approx(1.0)


def test_the_quote_stretches_the_predicted_waits_by_the_margin() -> None:
    fc = Forecaster(default_cap=256)
    state = _book(fc)
    for _ in range(30):  # lately the waits were twice as long as predicted
        fc.scores.add(10.0, 1.0, 2.0)
    q = fc.quote(8.0, 10.0, state)
    assert q.bid == 1.01 and q.wait_s == pytest.approx(1.0) and q.within_s == 8.0  # 7 s * 2 is over 8


def test_a_longer_wait_never_needs_a_higher_bid() -> None:
    fc = Forecaster(default_cap=256)
    state = _book(fc)
    bids = [fc.quote(s / 4, 10.0, state).bid for s in range(1, 60)]
    known = [b for b in bids if b is not None]
    assert known == sorted(known, reverse=True), bids
    assert sorted(set(known)) == [0.1, 0.501, 1.01], bids  # 1.0 waits as long as 0.501, 0.5 as 0.1
    assert bids.index(known[0]) == len(bids) - len(known)  # none, then bids only


def test_the_search_over_many_prices_finds_the_same_bid() -> None:
    prices = [0.1 * i for i in range(1, 200)]

    def wait_at(bid: float) -> float:
        return 100.0 / bid

    for within in (10.0, 50.0, 600.0, 2000.0):
        q = lowest_bid(prices, wait_at, within)
        best = min((p for p in prices if wait_at(p) <= within), default=None)
        assert q.bid == best, within


async def test_a_deadline_orders_bid_is_clamped_to_the_floor_and_the_ceiling() -> None:
    dep = Deployment("d", 0.2, 1)
    book = LocalBook(ProductBook("p", [dep]))
    outlook = Outlook(book, lambda: [dep], 256)
    fc = outlook.forecast
    loop = asyncio.get_running_loop()
    for i in range(10):
        o = Order(f"past{i}", 1.0, i, 0.0)
        fc.entering(o, 0.0, None, 100)
        fc.admitted(o, "d", 0.0)
        fc.released(o.id, 2.0)
    assert await outlook.bid_for(5.0, ceiling=3.0) == 0.2  # a free slot: the floor
    holder = book.new_order("holder", 1.0)
    fut = await book.submit(holder)
    assert fut.done()
    fc.entering(holder, loop.time(), None, 100)
    fc.admitted(holder, "d", loop.time() - 1.5)  # 0.5 s of its 2 s left
    waiting = book.new_order("w", 2.0)
    fc.entering(waiting, loop.time(), None, 100)
    await book.submit(waiting)
    fc.rested(waiting, loop.time(), outlook.state())
    fc.arrivals = ArrivalHistory()  # the book as it stands: no arrivals above counted
    # to go first it must bid over 2.0; to start within 1 s it must go first
    assert await outlook.bid_for(1.0, ceiling=3.0) == 2.01
    assert await outlook.bid_for(1.0, ceiling=1.5) == 1.5  # never above the ceiling
    assert await outlook.bid_for(10.0, ceiling=3.0) == 0.2  # behind it in time: the floor
    assert await outlook.bid_for(0.01, ceiling=3.0) == 3.0  # no bid in time: the ceiling
    # priced again, an order waiting is not ahead of itself
    assert await outlook.bid_for(1.0, ceiling=3.0, order=waiting) == 0.2
    await book.aclose()


def test_a_steady_quote_waits_out_a_burst_of_arrivals_above() -> None:
    """A deadline order with time to spare is priced with the arrivals at their mean
    rate over the window: a burst of arrivals above (10 a second, more than the slot
    takes) passes, and a lower bid fits in the time."""
    fc = Forecaster(default_cap=256)
    state = _book(fc)
    for i in range(10):  # one arrival above every bid every 10 s for 100 s
        fc.arrivals.add(-100.0 + 10.0 * i, 2.0)
    for i in range(30):  # then a burst: 10 a second for 3 s
        fc.arrivals.add(7.0 + 0.1 * i, 2.0)
    assert fc.quote(8.0, 10.0, state).bid is None  # at the burst's rate none starts in time
    steady = fc.quote(8.0, 10.0, state, steady=True)
    assert steady.bid == 1.01 and steady.wait_s == pytest.approx(1.0)  # 40 in 110 s: 0.36 a second
    calm = ArrivalHistory()
    for t, bid in [(-100.0 + 10.0 * i, 2.0) for i in range(10)] + [(7.0 + 0.1 * i, 2.0) for i in range(30)]:
        calm.add(t, bid)
    assert calm.rate_above(1.0, 10.0) == pytest.approx(10.0, rel=0.05)
    assert calm.rate_above(1.0, 10.0, steady=True) == pytest.approx(40 / 110.0)


def test_a_steady_quote_is_not_stretched_by_the_margin() -> None:
    fc = Forecaster(default_cap=256)
    state = _book(fc)
    for _ in range(30):  # lately the waits were twice as long as predicted
        fc.scores.add(10.0, 1.0, 2.0)
    assert fc.quote(8.0, 10.0, state).bid == 1.01  # 7 s stretched to 14 s
    # a deadline order keeps a reserve of its own for its ceiling: the bid it tries
    # before it is the one predicted to fit, 7 s at 0.501
    q = fc.quote(8.0, 10.0, state, steady=True)
    assert q.bid == 0.501 and q.wait_s == pytest.approx(7.0)
