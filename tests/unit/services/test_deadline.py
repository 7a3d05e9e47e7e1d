"""A deadline order's bid schedule (:mod:`bourse.services.deadline`): raised only,
never above its ceiling, the ceiling in the last stretch; and on a market's in-process
book, the order raised while it waits overtakes the lower bids and is admitted before
its deadline, or ends 408 at it."""

from __future__ import annotations

import asyncio
import math
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bourse.coordination.book_local import LocalBook
from bourse.domain.book import Admission, Deployment, Order, ProductBook
from bourse.domain.errors import GatewayError
from bourse.domain.policy import resolve_policy
from bourse.services.deadline import (
    LAST_STRETCH,
    PATIENCE,
    RESERVE,
    last_stretch_s,
    next_bid,
    price,
    raise_bids,
    reserve_of,
    start_bid,
    tick_s,
)
from bourse.services.market import Market

pytestmark = pytest.mark.anyio

FLOOR = 0.1


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


prices = st.floats(0.1, 100.0)


@given(prices, prices, st.floats(0.0, 60.0), st.floats(0.05, 10.0), prices)
def test_a_new_bid_is_a_raise_within_the_ceiling(
    current: float, proposed: float, left: float, stretch: float, ceiling: float
) -> None:
    current = min(current, ceiling)
    bid = next_bid(current, proposed, left, stretch, ceiling)
    assert current <= bid <= ceiling
    if left <= stretch:
        assert bid == ceiling  # the last stretch: the ceiling itself
    else:
        assert bid == min(ceiling, max(current, proposed))


def test_ticks_and_the_last_stretch() -> None:
    assert tick_s(60.0, 2.0) == 2.0  # every quiet interval
    assert tick_s(5.0, 2.0) == 0.5  # at least ten times over its deadline
    assert tick_s(0.1, 2.0) == 0.05  # never more often than every 50 ms
    assert last_stretch_s(60.0, 2.0) == LAST_STRETCH * 60.0
    assert last_stretch_s(0.1, 0.05) == 0.05  # at least one tick


def _market(slots: int = 1) -> tuple[Market, LocalBook]:
    deps = [Deployment("d", FLOOR, slots)]
    book = LocalBook(ProductBook("p", deps))
    policy = resolve_policy("default", {})
    market = Market(
        "p", book, {}, policy, default_bid=None, context_length=8192, max_output_tokens=16,
        supports_tools=True, sim_overrides=False, stall_timeout_s=10, deployments=deps,
    )  # fmt: skip
    return market, book


async def _submit(market: Market, oid: str, bid: float, ceiling: float | None = None) -> tuple[Order, Any]:
    order = market.new_order(oid, bid)
    order.ceiling = ceiling
    return order, await market.submit(order)


async def test_a_deadline_order_starts_low_is_raised_and_overtakes_the_lower_bids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    market, book = _market()

    async def floor_while_there_is_time(
        within_s: float, ceiling: float, order: Order | None = None, *, steady: bool = False
    ) -> float:
        return FLOOR  # the schedule under test, not the forecast: it raises only in the last stretch

    async def a_short_wait_at_the_ceiling(bid: float, *, steady: bool = False) -> float:
        return 0.05  # a reserve shorter than the last stretch: the stretch stands

    monkeypatch.setattr(market, "bid_for", floor_while_there_is_time)
    monkeypatch.setattr(market, "wait_at", a_short_wait_at_the_ceiling)
    _, fut = await _submit(market, "running", 5.0)
    held: Admission = fut.result()
    low, low_fut = await _submit(market, "low", 0.5)
    deadline_s, ceiling = 1.0, 2.0
    first = await start_bid(market, deadline_s, ceiling)
    assert first == FLOOR
    order, fut = await _submit(market, "dl", first, ceiling)
    order.start_bid = first
    loop = asyncio.get_running_loop()
    waiter = asyncio.create_task(market.wait(order, fut, order.arrived_at + deadline_s))
    await asyncio.sleep(0.2)
    assert order.bid == FLOOR and book.position(order) == 1  # behind 'low', not raised yet
    while order.bid < ceiling:  # the last stretch: raised to its ceiling
        await asyncio.sleep(0.01)
        assert loop.time() < order.arrived_at + deadline_s, "not raised before its deadline"
    assert book.position(order) == 0  # ahead of 'low' now, its arrival earlier
    book.book.check()
    market.release(held)
    adm = await waiter
    assert adm.order is order and adm.price == 0.5  # the second price: the bid it beat
    assert order.bid == ceiling and not low_fut.done()
    market.withdraw(low, low_fut)
    market.release(adm)
    await market.aclose()


async def test_a_deadline_order_that_cannot_make_it_ends_408_at_its_deadline() -> None:
    market, book = _market()
    _, fut = await _submit(market, "running", 5.0)
    order, dl_fut = await _submit(market, "dl", FLOOR, 1.0)
    loop = asyncio.get_running_loop()
    with pytest.raises(GatewayError) as err:
        await market.wait(order, dl_fut, order.arrived_at + 0.3)
    assert err.value.status == 408 and err.value.code == "book_timeout"
    assert loop.time() >= order.arrived_at + 0.3
    assert order.bid == 1.0  # it bid its ceiling before the end
    assert book.book.waiting == 0
    await asyncio.sleep(0.1)  # its raiser is gone: nothing raises an order out of the book
    market.release(cast(Admission, fut.result()))
    await market.aclose()


async def test_a_deadline_order_with_a_free_slot_is_admitted_at_once_at_the_floor() -> None:
    market, _ = _market()
    first = await start_bid(market, 5.0, 2.0)
    order, fut = await _submit(market, "dl", first, 2.0)
    assert fut.done()
    adm = await market.wait(order, fut, order.arrived_at + 5.0)
    assert adm.price == FLOOR and order.bid == FLOOR
    market.release(adm)
    await market.aclose()


class _Planned:
    """A market whose predictions are given: the wait at the ceiling ``wait_s`` (at the
    arrivals' mean rate; ``now_s`` at the newest ones', the same unless given);
    ``bid_for`` the floor for ``floor_steady_s`` or more at the mean rate (any time
    unless given), and as the book is now for ``floor_now_s`` or more (else the
    ceiling); its raises are recorded with their loop time."""

    def __init__(
        self,
        wait_s: float | None,
        now_s: float | None = -1.0,
        floor_now_s: float = math.inf,
        floor_steady_s: float = 0.0,
    ) -> None:
        self.policy = resolve_policy("default", {})
        self.wait_s = wait_s
        self.now_s = wait_s if now_s == -1.0 else now_s
        self.floor_now_s = floor_now_s
        self.floor_steady_s = floor_steady_s
        self.asked: list[float] = []
        self.steady: list[bool] = []
        self.raises: list[tuple[float, float]] = []

    async def bid_for(
        self, within_s: float, ceiling: float, order: Order | None = None, *, steady: bool = False
    ) -> float:
        self.asked.append(within_s)
        self.steady.append(steady)
        if steady:
            return FLOOR if within_s >= self.floor_steady_s else ceiling
        return FLOOR if within_s >= self.floor_now_s else ceiling

    async def wait_at(self, bid: float, *, steady: bool = False) -> float | None:
        return self.wait_s if steady else self.now_s

    async def rebid(self, order: Order, bid: float) -> bool:
        self.raises.append((asyncio.get_running_loop().time(), bid))
        order.bid = bid
        return True


async def test_a_deadline_order_keeps_the_time_it_needs_at_its_ceiling() -> None:
    # 10 s to its deadline, 1 s predicted at the ceiling: it bids low for what the
    # book is predicted to clear before its reserve (2 x 1 s and a tick) begins
    market = _Planned(wait_s=1.0)
    assert await start_bid(market, 10.0, 2.0) == FLOOR
    assert market.asked == [
        pytest.approx(PATIENCE * (10.0 - RESERVE * 1.0 - tick_s(10.0, market.policy.quiet_interval_s)))
    ]
    # with time to spare, a burst is waited out: the quote with the arrivals at their
    # mean rate, not stretched by the score's margin (the reserve is the margin)
    assert market.steady == [True]
    # 6 s predicted at the ceiling: its reserve is past its deadline, it bids the ceiling
    # at once, as a fixed order at it would (the last stretch alone would have it bid low)
    assert await start_bid(_Planned(wait_s=6.0), 10.0, 2.0) == 2.0
    # no slot predicted to come to the ceiling: the ceiling
    assert await start_bid(_Planned(wait_s=None), 10.0, 2.0) == 2.0


def test_the_reserve_waits_out_a_burst_but_not_longer_than_it_may_last() -> None:
    tick, stretch = 0.1, 0.5
    # twice the wait at the arrivals' mean rate (a burst passes) ...
    assert reserve_of(1.0, 1.5, stretch, tick) == pytest.approx(RESERVE * 1.0 + tick)
    # ... and the wait at the burst's rate once, should it go on
    assert reserve_of(1.0, 5.0, stretch, tick) == pytest.approx(5.0 + tick)
    # no slot at the burst's rate: the mean rate's reserve; none at the mean rate either:
    # the ceiling at once
    assert reserve_of(1.0, None, stretch, tick) == pytest.approx(RESERVE * 1.0 + tick)
    assert reserve_of(None, 1.0, stretch, tick) == math.inf
    assert reserve_of(0.1, 0.2, stretch, tick) == stretch  # the last stretch at least


async def test_a_burst_predicted_to_pass_leaves_a_deadline_order_time_to_bid_low() -> None:
    # 6 s predicted at the ceiling at the burst's rate, 1 s at the mean rate: it bids the
    # ceiling only for the last 6 s and a tick of its 10, low before
    market = _Planned(wait_s=1.0, now_s=6.0)
    tick = tick_s(10.0, market.policy.quiet_interval_s)
    assert await start_bid(market, 10.0, 2.0) == FLOOR
    assert market.asked == [pytest.approx(PATIENCE * (10.0 - 6.0 - tick))]
    # 6 s at the mean rate too: its reserve (2 x 6 s) is past its deadline
    assert await start_bid(_Planned(wait_s=6.0, now_s=1.0), 10.0, 2.0) == 2.0


async def test_a_deadline_order_is_raised_to_its_ceiling_when_its_reserve_begins() -> None:
    deadline_s, wait_s = 2.0, 0.4
    market = _Planned(wait_s=wait_s)
    loop = asyncio.get_running_loop()
    order = Order("dl", FLOOR, 1, loop.time(), ceiling=1.0, start_bid=FLOOR)
    fut: asyncio.Future[Admission] = loop.create_future()
    await asyncio.wait_for(raise_bids(market, order, fut, order.arrived_at + deadline_s), 3.0)
    assert [b for _, b in market.raises] == [1.0]  # one raise: to the ceiling
    tick = tick_s(deadline_s, market.policy.quiet_interval_s)
    reserve = RESERVE * wait_s + tick  # 1 s, longer than the last stretch (0.4 s)
    assert reserve > last_stretch_s(deadline_s, tick)
    raised_at = market.raises[0][0] - order.arrived_at
    # at the first tick of its reserve (a tick's lateness allowed: a loaded machine's loop)
    assert deadline_s - reserve - tick <= raised_at <= deadline_s - reserve + tick


async def test_in_its_reserve_a_deadline_order_bids_its_ceiling_as_its_control_would() -> None:
    # the reserve is 2 x 1 s and a tick of its 5 s. Before it, it bids low (the steady
    # quote); from its start, the ceiling, though a lower bid is predicted, as the book is
    # now, to start within the time left: no lull is predicted before its deadline, so a
    # lower bid buys no cheaper moment (it pays the second price, set by the others, not
    # its own bid); it only lets the bids between it and the ceiling go first and be
    # admitted at the top of a busier book. It behaves as a fixed order at its ceiling.
    deadline_s, ceiling = 5.0, 1.0
    market = _Planned(wait_s=1.0, floor_now_s=0.0)  # the floor: predicted to start at once
    tick = tick_s(deadline_s, market.policy.quiet_interval_s)
    stretch = last_stretch_s(deadline_s, tick)
    reserve = RESERVE * 1.0 + tick
    assert reserve > stretch
    assert await price(market, None, 0.0, deadline_s, ceiling, tick, stretch) == FLOOR
    assert market.steady == [True]  # before the reserve: the burst waited out
    assert await price(market, None, FLOOR, reserve + 0.01, ceiling, tick, stretch) == FLOOR
    asked = len(market.asked)
    for left in (reserve, reserve / 2, stretch + 0.01, stretch):
        assert await price(market, None, FLOOR, left, ceiling, tick, stretch) == ceiling
    assert len(market.asked) == asked  # no quote asked in the reserve
    # an order whose reserve is its whole deadline enters at its ceiling, not under it
    assert await start_bid(_Planned(wait_s=3.0, floor_now_s=0.0), deadline_s, ceiling) == ceiling


async def test_before_its_reserve_a_deadline_order_bets_only_on_a_lull_the_market_predicts() -> None:
    # 10 s to its deadline, 1 s predicted at the ceiling: its reserve is 1.5 x 1 s and
    # a tick (1 s), 2.5 s; 7.5 s before it. It bids the floor when the floor is
    # predicted (at the arrivals' mean rate) to start within those 7.5 s, and its
    # ceiling when it is predicted to need 9 s: a bet on a wait longer than predicted
    # ends, more often than not, raised to the ceiling at the top of a busy book, paying
    # more than a fixed bid at the ceiling would have
    deadline_s, ceiling = 10.0, 2.0
    tick = tick_s(deadline_s, resolve_policy("default", {}).quiet_interval_s)
    assert tick == pytest.approx(1.0)
    assert reserve_of(1.0, 1.0, last_stretch_s(deadline_s, tick), tick) == pytest.approx(2.5)
    market = _Planned(wait_s=1.0, floor_steady_s=7.0)
    assert await start_bid(market, deadline_s, ceiling) == FLOOR
    assert market.asked == [pytest.approx(7.5)] and market.steady == [True]
    market = _Planned(wait_s=1.0, floor_steady_s=9.0)
    assert await start_bid(market, deadline_s, ceiling) == ceiling
