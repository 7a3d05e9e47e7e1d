"""The book port's raise of a deadline order (:meth:`~bourse.ports.book.BookPort.rebid`,
issue 38) over both adapters, and on Redis across two replicas: the order is ranked
again at its new bid with its arrival kept (equal bids: arrival order stands), an
order admitted meanwhile is not raised and is admitted once, at the bid it cleared at.
"""

from __future__ import annotations

import asyncio

import pytest

from bourse.coordination.book_redis import RedisBook
from bourse.domain.book import Admission, Order
from tests.contract import test_book
from tests.contract.test_book import Books, admitted, next_admission, now_admitted, quiet, settled, submit

book_backend = test_book.book_backend
make_book = test_book.make_book
redis_books = test_book.redis_books
"""The fixtures of the book contract: each adapter, and Redis replicas."""

pytestmark = pytest.mark.anyio


async def deadline_order(
    book: object, oid: str, bid: float, ceiling: float
) -> tuple[Order, asyncio.Future[Admission]]:
    order: Order = book.new_order(oid, bid)  # type: ignore[attr-defined]
    order.ceiling, order.start_bid = ceiling, bid
    fut = await book.submit(order)  # type: ignore[attr-defined]
    return order, fut


async def test_a_raised_order_is_ranked_at_its_new_bid_with_its_arrival_kept(make_book: Books) -> None:
    book = await make_book([("d", 0.1, 1)])
    _, hf = await submit(book, "holder", 10.0)
    holder = now_admitted(hf)
    early = await submit(book, "early", 1.0)
    low = await submit(book, "low", 0.5)
    dl, dl_fut = await deadline_order(book, "dl", 0.2, 2.0)
    late = await submit(book, "late", 1.0)
    assert (await book.view()).bids == [1.0, 1.0, 0.5, 0.2]
    assert (await book.standing(dl))[1] == 3

    # raised to an equal bid: behind the equal bid that came before it, ahead of the later one
    assert await book.rebid(dl, 1.0)
    assert dl.bid == 1.0
    assert (await book.standing(dl))[1] == 1
    assert (await book.view()).bids == [1.0, 1.0, 1.0, 0.5]

    pending = {o.id: (o, f) for o, f in (early, low, (dl, dl_fut), late)}
    order = []
    for _ in range(4):
        book.release(holder)
        holder = await next_admission(pending)
        order.append((holder.order.id, holder.price))
    # early, then the raised one (its arrival before 'late'), then late, then low; second prices
    assert order == [("early", 1.0), ("dl", 1.0), ("late", 0.5), ("low", 0.1)]
    # admitted: a raise now is too late, and changes nothing
    assert not await book.rebid(dl, 2.0)
    assert dl.bid == 1.0
    book.release(holder)
    view = await settled(book, waiting=0, busy_total=0)
    assert [(c.price, c.bid) for c in view.recent][:4] == [(0.1, 0.5), (0.5, 1.0), (1.0, 1.0), (1.0, 1.0)]


async def test_a_raise_that_reaches_a_free_slot_admits_the_order(make_book: Books) -> None:
    book = await make_book([("cheap", 0.1, 1), ("dear", 1.0, 1)])
    _, hf = await submit(book, "holder", 0.5)
    holder = now_admitted(hf)
    assert holder.deployment == "cheap"
    dl, fut = await deadline_order(book, "dl", 0.5, 3.0)
    assert not fut.done()  # 'dear' is free, above its bid
    assert await book.rebid(dl, 1.5)
    adm = await admitted(book, dl, fut)
    assert (adm.deployment, adm.price, adm.order.bid) == ("dear", 1.0, 1.5)
    for a in (holder, adm):
        book.release(a)
    await settled(book, waiting=0, busy_total=0)


@pytest.mark.redis
async def test_a_raise_on_one_replica_reranks_the_order_for_both(redis_books: Books) -> None:
    r1 = await redis_books([("d", 0.1, 1)])
    r2 = await redis_books([("d", 0.1, 1)])
    _, hf = await submit(r1, "holder", 10.0)
    holder = now_admitted(hf)
    low, low_fut = await submit(r1, "low", 0.5)
    dl, dl_fut = await deadline_order(r2, "dl", 0.2, 2.0)
    assert (await r1.view()).bids == [0.5, 0.2]
    assert await r2.rebid(dl, 2.0)
    view = await r1.view()  # the other replica sees it ranked first
    assert view.bids == [2.0, 0.5] and view.level == 2.0
    assert (await r2.standing(dl))[1] == 0 and (await r1.standing(low))[1] == 1
    r1.release(holder)  # r1's slot goes to r2's raised order, at the second price
    adm = await admitted(r2, dl, dl_fut)
    assert (adm.price, dl.bid) == (0.5, 2.0)
    assert not low_fut.done()
    view = await settled(r1, waiting=1, busy_total=1)
    assert (view.recent[0].price, view.recent[0].bid) == (0.5, 2.0)
    r1.withdraw(low, low_fut)
    r2.release(adm)
    await settled(r1, waiting=0, busy_total=0)


@pytest.mark.redis
async def test_an_order_offered_a_slot_as_it_is_raised_is_admitted_once_at_the_bid_it_cleared_at(
    redis_books: Books,
) -> None:
    r1 = await redis_books([("d", 0.1, 1)])
    r2 = await redis_books([("d", 0.1, 1)])
    _, hf = await submit(r1, "holder", 10.0)
    holder = now_admitted(hf)
    dl, fut = await deadline_order(r2, "dl", 0.2, 2.0)
    before = (await r1.view()).admitted_total
    held = await redis_books.replicas.pause(r2.hub)  # type: ignore[union-attr]
    r1.release(holder)  # the slot is offered to r2's order; r2 has not taken it up yet
    await quiet(r1)
    for _ in range(200):
        if held:
            break
        await asyncio.sleep(0.01)
    assert held, "the offer never reached r2"
    assert not await r2.rebid(dl, 2.0)  # on offer: admitted at the bid it had, not raised
    assert dl.bid == 0.2
    await redis_books.replicas.resume(r2.hub)  # type: ignore[union-attr]
    adm = await admitted(r2, dl, fut)
    assert (adm.price, dl.bid) == (0.1, 0.2)
    view = await settled(r1, waiting=0, busy_total=1)
    assert view.admitted_total == before + 1  # once
    r2.release(adm)
    await settled(r1, waiting=0, busy_total=0)


@pytest.mark.redis
async def test_a_raise_racing_the_admission_counts_the_order_once_at_the_bid_it_cleared_at(
    redis_books: Books,
) -> None:
    """r1 gives its slot back while r2 raises its order, at the same moment, again and
    again: whichever comes first in Redis, the order is admitted once, the slot counted
    once, and the bid its admission reports is the one the book cleared it at."""
    r1 = await redis_books([("d", 0.1, 1)])
    r2 = await redis_books([("d", 0.1, 1)])
    raised_first = 0
    for i in range(12):
        _, hf = await submit(r1, f"h{i}", 10.0)
        holder = now_admitted(hf)
        before = (await r1.view()).admitted_total
        dl, fut = await deadline_order(r2, f"dl{i}", 0.2, 2.0)
        r1.release(holder)
        if i % 3 == 1:
            await quiet(r1)  # the release has cleared the book: the order is on offer, or taken
        elif i % 3 == 2:
            await asyncio.sleep(0.0005 * i)  # a race: either may come first
        raised = await r2.rebid(dl, 2.0)
        adm = await admitted(r2, dl, fut)
        view = await settled(r1, waiting=0, busy_total=1)
        assert view.admitted_total == before + 1  # once
        clear = view.recent[0]
        assert (clear.bid, clear.price) == (dl.bid, adm.price)  # the bid it cleared at, as Redis has it
        assert dl.bid == (2.0 if raised else 0.2)
        assert adm.price == 0.1  # nobody else waiting: the floor
        raised_first += raised
        r2.release(adm)
        await settled(r1, waiting=0, busy_total=0)
    assert 0 < raised_first < 12, raised_first  # both ways were taken
    assert isinstance(r2, RedisBook)
