"""The book port contract (``bourse.ports.book``), run over both adapters:
``local`` (:class:`~bourse.coordination.book_local.LocalBook`) and ``redis``
(:class:`~bourse.coordination.book_redis.RedisBook`, one hub per replica).

The Redis adapter is asynchronous where the local one is not (a release is a
fire-and-forget script call, an admission arrives on a channel), so the tests wait
for events with generous timeouts and read the exact state through ``view()`` and
``standing()``; they never assert on elapsed time except as a wide upper bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import types
from collections.abc import AsyncIterator, Iterable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from bourse.coordination.book_local import LocalBook
from bourse.coordination.book_redis import RedisBook
from bourse.domain.book import Admission, BookFull, Deployment, Order, ProductBook
from bourse.domain.breaker import CircuitBreaker
from bourse.ports.book import BookUnavailable, BookView, ClientGone, DeploymentView
from tests.contract.cluster import Replicas, eventually

PRODUCT = "prod"
Dep = tuple[str, float, int]
WAIT_S = 15.0
"""How long a test waits for an event that must happen (a loaded machine is slow)."""


class Books:
    """Builds books of one adapter. For ``redis`` every call is a new replica (its
    own hub) of the same product over the test's key prefix, so two calls give two
    views of one shared book; for ``local`` every call is an independent book."""

    def __init__(self, kind: str, url: str | None) -> None:
        self.kind = kind
        self.replicas = Replicas(url) if url is not None else None
        self.local: list[LocalBook] = []

    async def __call__(
        self, deps: Iterable[Dep], *, max_waiting: int = 10_000, lease_s: float = 3.0, **hub_kw: Any
    ) -> Any:
        deployments = [Deployment(name, floor, slots) for name, floor, slots in deps]
        book: Any
        if self.replicas is None:
            book = LocalBook(ProductBook(PRODUCT, deployments, max_waiting=max_waiting))
            self.local.append(book)
        else:
            hub = await self.replicas.hub(lease_s=lease_s, **hub_kw)
            book = RedisBook(hub, PRODUCT, deployments, max_waiting=max_waiting)
        await book.start()
        return book

    async def aclose(self) -> None:
        for book in self.local:
            await book.aclose()
        if self.replicas is not None:
            await self.replicas.aclose()


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def book_backend(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_service_url")
    return "local", None


@pytest.fixture
async def make_book(book_backend: tuple[str, str | None]) -> AsyncIterator[Books]:
    books = Books(*book_backend)
    try:
        yield books
    finally:
        await books.aclose()


@pytest.fixture
async def redis_books(redis_service_url: str) -> AsyncIterator[Books]:
    """Redis only: for the tests of replicas, leases and the admission channel."""
    books = Books("redis", redis_service_url)
    try:
        yield books
    finally:
        await books.aclose()


# -- helpers ------------------------------------------------------------------------


async def submit(book: Any, oid: str, bid: float) -> tuple[Order, asyncio.Future[Admission]]:
    order = book.new_order(oid, bid)
    fut = await book.submit(order)
    return order, fut


def now_admitted(fut: asyncio.Future[Admission]) -> Admission:
    """The admission of an order that must have been admitted at once (in submit)."""
    assert fut.done(), "the order should have been admitted at once"
    return fut.result()


async def admitted(
    book: Any, order: Order, fut: asyncio.Future[Admission], within: float = WAIT_S
) -> Admission:
    loop = asyncio.get_running_loop()
    try:
        adm: Admission = await book.wait(order, fut, loop.time() + within)
    except TimeoutError:
        raise AssertionError(
            f"order {order.id} (bid {order.bid}) was not admitted within {within} s"
        ) from None
    assert adm.order is order
    return adm


async def next_admission(pending: dict[str, tuple[Order, asyncio.Future[Admission]]]) -> Admission:
    """The one admission among ``pending`` orders (taken out of ``pending``)."""
    futs = {fut: oid for oid, (_, fut) in pending.items()}
    done, _ = await asyncio.wait(futs, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    assert done, f"none of {sorted(pending)} was admitted within {WAIT_S} s"
    await asyncio.sleep(0.05)  # a second admission (there must be none) would show now
    done = {f for f in futs if f.done()}
    assert len(done) == 1, f"more than one admission at once: {sorted(futs[f] for f in done)}"
    [fut] = done
    order, _ = pending.pop(futs[fut])
    adm = fut.result()
    assert adm.order is order
    return adm


def busy(view: BookView) -> dict[str, int]:
    return {d.name: d.busy for d in view.deployments}


async def settled(book: Any, *, waiting: int, busy_total: int) -> BookView:
    """The book's view once it shows ``waiting`` orders and ``busy_total`` busy slots
    (the Redis adapter gives slots back asynchronously)."""
    last: list[BookView] = []

    async def check() -> bool:
        v = await book.view()
        last[:] = [v]
        return v.waiting == waiting and sum(busy(v).values()) == busy_total

    try:
        await eventually(check, within=WAIT_S)
    except AssertionError:
        raise AssertionError(f"expected waiting={waiting} busy={busy_total}, last view {last}") from None
    return last[0]


async def quiet(book: Any) -> None:
    """Redis: let this replica's fire-and-forget calls (releases, withdrawals) finish."""
    if isinstance(book, RedisBook):
        await eventually(_no_background(book), within=WAIT_S, what="background calls")


def _no_background(book: RedisBook) -> Any:
    async def check() -> bool:
        return not book.hub._background

    return check


# -- 1. price-time priority ------------------------------------------------------------


@pytest.mark.anyio
async def test_orders_rank_by_bid_then_arrival(make_book: Books) -> None:
    book = await make_book([("d", 0.5, 1)])
    blocker = book.new_order("blocker", 10.0)
    blocker.cap = 100  # its output cap: a shared book's view says it (the wait forecast)
    holder = now_admitted(await book.submit(blocker))
    assert holder.deployment == "d"

    bids = [1.0, 3.0, 2.0, 3.0, 5.0]
    orders = [await submit(book, f"o{i}", bid) for i, bid in enumerate(bids)]
    assert not any(f.done() for _, f in orders)
    # orders ahead of each at its entry: 1 -> 0; 3 -> 0; 2 -> 1 (the 3); 3 -> 1 (the first 3); 5 -> 0
    assert [o.position_at_entry for o, _ in orders] == [0, 0, 1, 1, 0]
    # exact ranks now, best first: o4 (5), o1 (3), o3 (3, later), o2 (2), o0 (1)
    assert [(await book.standing(o))[1] for o, _ in orders] == [4, 1, 3, 2, 0]
    assert all(book.position(o) >= 0 for o, _ in orders)
    view = await book.view()
    assert view.waiting == 5
    assert view.bids == [5.0, 3.0, 3.0, 2.0, 1.0]
    # the shared book names the orders holding a slot (the wait forecast's other
    # replicas' runs); the book in process knows its own and says nothing
    assert view.running == ([("blocker", "d", 100)] if isinstance(book, RedisBook) else None)

    pending = {o.id: (o, f) for o, f in orders}
    sequence = []
    for _ in bids:
        book.release(holder)
        holder = await next_admission(pending)
        assert holder.deployment == "d"
        assert book.position(holder.order) == -1
        assert (await book.standing(holder.order))[1] == -1
        sequence.append(holder.order.id)
    assert sequence == ["o4", "o1", "o3", "o2", "o0"]
    book.release(holder)
    view = await settled(book, waiting=0, busy_total=0)
    assert view.admitted_total == 6


# -- 2. second price ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_cleared_price_is_the_second_price(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)])
    _, f0 = await submit(book, "first", 5.0)
    holder = now_admitted(f0)
    # nobody else waiting: pays the floor; the level is then the floor (no free slot, empty book)
    assert (holder.price, holder.level) == (1.0, 1.0)

    pending = {}
    for oid, bid in [("a", 4.0), ("b", 2.5), ("c", 7.0), ("d", 2.5), ("e", 0.5)]:
        o, f = await submit(book, oid, bid)
        pending[oid] = (o, f)
    expected = [
        # (admitted, price = min(bid, max(floor, best bid still waiting)), level after the clear)
        ("c", 4.0, 4.0),  # runner-up a=4.0
        ("a", 2.5, 2.5),  # runner-up b=2.5
        ("b", 2.5, 2.5),  # runner-up d=2.5 equals its bid
        ("d", 1.0, 1.0),  # runner-up e=0.5 is below the floor: pays the floor
    ]
    for oid, price, level in expected:
        book.release(holder)
        holder = await next_admission(pending)
        assert holder.order.id == oid
        assert (holder.price, holder.level) == (price, level), oid
        assert holder.price <= holder.order.bid
    book.release(holder)
    # e bids below every floor: it waits with the slot free
    view = await settled(book, waiting=1, busy_total=0)
    assert view.bids == [0.5]
    assert not pending["e"][1].done()
    assert [(c.price, c.bid) for c in view.recent] == [
        (1.0, 2.5),
        (2.5, 2.5),
        (2.5, 4.0),
        (4.0, 7.0),
        (1.0, 5.0),
    ]
    e, fe = pending.pop("e")
    book.withdraw(e, fe)
    await settled(book, waiting=0, busy_total=0)


# -- 3. eligibility, cheapest first, level ---------------------------------------------------


@pytest.mark.anyio
async def test_cheapest_eligible_deployment_and_level(make_book: Books) -> None:
    book = await make_book([("cheap", 1.0, 1), ("mid", 2.0, 1), ("dear", 3.0, 2)])
    # a free slot and an empty book: the lowest free floor
    assert book.level() == 1.0
    assert await book.standing(None) == (1.0, -1)

    _, f = await submit(book, "s1", 5.0)
    s1 = now_admitted(f)
    assert (s1.deployment, s1.price) == ("cheap", 1.0)
    assert book.level() == 2.0  # the cheapest is busy: the lowest *free* floor
    assert await book.standing(None) == (2.0, -1)

    w15, f15 = await submit(book, "w15", 1.5)  # below mid and dear, cheap is busy: waits
    assert not f15.done()
    assert book.level() == 1.5  # an order waits: max(best bid waiting, min floor)
    assert await book.standing(w15) == (1.5, 0)
    w05, f05 = await submit(book, "w05", 0.5)  # below every floor: waits
    assert not f05.done()
    assert await book.standing(w05) == (1.5, 1)

    _, f = await submit(book, "s2", 2.5)  # mid (2.0) and dear (3.0) are free: mid
    s2 = now_admitted(f)
    assert (s2.deployment, s2.price) == ("mid", 2.0)  # min(2.5, max(2.0, 1.5))
    _, f = await submit(book, "s3", 10.0)
    s3 = now_admitted(f)
    assert (s3.deployment, s3.price) == ("dear", 3.0)
    _, f = await submit(book, "s4", 10.0)
    s4 = now_admitted(f)
    assert (s4.deployment, s4.price) == ("dear", 3.0)
    view = await book.view()
    assert busy(view) == {"cheap": 1, "mid": 1, "dear": 2}
    assert view.bids == [1.5, 0.5]

    w9, f9 = await submit(book, "w9", 9.0)
    assert not f9.done()
    assert book.level() == 9.0
    assert await book.standing(w9) == (9.0, 0)
    assert await book.standing(w15) == (9.0, 1)

    book.release(s1)  # cheap frees: the best order takes it
    a9 = await admitted(book, w9, f9)
    assert (a9.deployment, a9.price) == ("cheap", 1.5)

    book.release(s2)  # mid frees, but 1.5 is below its floor: nobody is admitted there
    view = await settled(book, waiting=2, busy_total=3)
    assert busy(view) == {"cheap": 1, "mid": 0, "dear": 2}
    assert not f15.done()
    # a slot is free but the book is not empty: max(best bid waiting, min floor)
    assert view.level == 1.5
    assert await book.standing(w15) == (1.5, 0)

    book.release(a9)  # cheap frees: 1.5 is eligible there
    a15 = await admitted(book, w15, f15)
    assert (a15.deployment, a15.price) == ("cheap", 1.0)  # min(1.5, max(1.0, 0.5))

    book.withdraw(w05, f05)
    for adm in (a15, s3, s4):
        book.release(adm)
    await settled(book, waiting=0, busy_total=0)
    assert await book.standing(None) == (1.0, -1)


# -- 4. never more busy than slots --------------------------------------------------------


class _Crowd:
    """Clients of one book (or of two replicas of it), each in one mode: hold a slot
    a moment, time out, cancel its wait, or leave (withdraw). Records every admission
    a client holds, and any moment more are held than the slots."""

    def __init__(self, slots: int, rng: random.Random) -> None:
        self.slots = slots
        self.rng = rng
        self.holding: set[str] = set()
        self.given_back: set[str] = set()
        self.seen: set[str] = set()
        self.over: list[tuple[str, int]] = []
        self.maybe_unseen = 0  # withdrawals racing an admission nobody received (Redis)

    def hold(self, oid: str) -> None:
        self.seen.add(oid)
        if oid in self.given_back or oid in self.holding:
            return
        self.holding.add(oid)
        if len(self.holding) > self.slots:
            self.over.append((oid, len(self.holding)))

    def give_back(self, oid: str) -> None:
        self.holding.discard(oid)
        self.given_back.add(oid)

    def watch(self, oid: str, fut: asyncio.Future[Admission]) -> None:
        def done(f: asyncio.Future[Admission]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.hold(oid)

        fut.add_done_callback(done)

    async def use(self, book: Any, adm: Admission) -> None:
        self.hold(adm.order.id)
        await asyncio.sleep(self.rng.random() * 0.02)
        self.give_back(adm.order.id)
        book.release(adm)

    def _admitted(self, fut: asyncio.Future[Admission]) -> bool:
        return fut.done() and not fut.cancelled()

    async def client(self, oid: str, book: Any, mode: str, bid: float, start: float, patience: float) -> None:
        await asyncio.sleep(start)
        order = book.new_order(oid, bid)
        fut = await book.submit(order)
        self.watch(oid, fut)
        modes = {
            "hold": self._hold,
            "timeout": self._timeout,
            "cancel": self._cancel,
            "withdraw": self._withdraw,
        }
        await modes[mode](book, order, fut, patience)

    async def _hold(self, book: Any, order: Order, fut: asyncio.Future[Admission], patience: float) -> None:
        loop = asyncio.get_running_loop()
        await self.use(book, await book.wait(order, fut, loop.time() + 60))

    async def _timeout(
        self, book: Any, order: Order, fut: asyncio.Future[Admission], patience: float
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            adm = await book.wait(order, fut, loop.time() + patience)
        except TimeoutError:
            assert not self._admitted(fut), "timed out yet admitted"
            self.give_back(order.id)
        else:
            await self.use(book, adm)

    async def _cancel(self, book: Any, order: Order, fut: asyncio.Future[Admission], patience: float) -> None:
        loop = asyncio.get_running_loop()

        async def waiter() -> Admission:
            try:
                adm: Admission = await book.wait(order, fut, loop.time() + 60)
                return adm
            except asyncio.CancelledError:
                self.give_back(order.id)  # wait() withdrew the order or gave its slot back
                raise

        task = asyncio.create_task(waiter())
        await asyncio.sleep(patience)
        if not task.done():
            task.cancel()
        await asyncio.wait([task])
        if not task.cancelled():
            await self.use(book, task.result())
        elif not self._admitted(fut):
            self.maybe_unseen += 1

    async def _withdraw(
        self, book: Any, order: Order, fut: asyncio.Future[Admission], patience: float
    ) -> None:
        # the client left
        await asyncio.sleep(patience)
        if not self._admitted(fut):
            self.maybe_unseen += 1
        self.give_back(order.id)
        book.withdraw(order, fut)


@pytest.mark.anyio
async def test_never_more_busy_than_slots(make_book: Books) -> None:
    deps = [("a", 1.0, 1), ("b", 2.0, 2), ("c", 3.0, 1)]
    slots = 4
    books = [await make_book(deps)]
    if make_book.kind == "redis":
        books.append(await make_book(deps))  # a second replica of the same book
    rng = random.Random(20250601)
    crowd = _Crowd(slots, rng)

    plan = []
    for i in range(200):
        mode = rng.choice(["hold"] * 5 + ["timeout", "cancel", "withdraw"])
        bid = round(rng.uniform(1.0, 10.0), 2) if mode == "hold" else round(rng.uniform(0.5, 10.0), 2)
        plan.append((f"c{i}", books[i % len(books)], mode, bid, rng.random() * 0.2, rng.random() * 0.05))

    async with asyncio.timeout(120):
        await asyncio.gather(*(crowd.client(*p) for p in plan))
    for book in books:
        await quiet(book)
    assert not crowd.over, f"more admissions held than the {slots} slots: {crowd.over[:5]}"
    assert not crowd.holding
    view = await settled(books[0], waiting=0, busy_total=0)
    assert len(crowd.seen) >= 100
    if make_book.kind == "local":
        assert view.admitted_total == len(crowd.seen)
    else:
        # an admission granted in Redis just as its client left is given back unseen
        assert len(crowd.seen) <= view.admitted_total <= len(crowd.seen) + crowd.maybe_unseen
    assert len(view.recent) == 32
    for book in books[1:]:
        other = await book.view()
        assert (other.waiting, other.admitted_total, busy(other)) == (0, view.admitted_total, busy(view))


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_two_replicas_share_slots_and_bid_order(redis_books: Books) -> None:
    deps = [("d", 0.5, 1)]
    r1 = await redis_books(deps)
    r2 = await redis_books(deps)
    assert r1.hub.replica != r2.hub.replica
    _, f = await submit(r1, "blocker", 100.0)
    holder = now_admitted(f)
    o2, f2 = await submit(r2, "second", 100.0)  # the one slot is taken, through the other replica
    assert not f2.done()

    bids = [3.0, 7.0, 1.0, 5.0, 9.0, 2.0, 8.0, 4.0, 6.0]
    pending = {"second": (o2, f2)}
    where: dict[str, Any] = {"second": r2, "blocker": r1}
    for i, bid in enumerate(bids):
        book = (r1, r2)[i % 2]
        o, fut = await submit(book, f"o{bid:g}", bid)
        pending[o.id] = (o, fut)
        where[o.id] = book
    assert (await r1.view()).bids == [100.0, *sorted(bids, reverse=True)]

    sequence = []
    for _ in range(len(bids) + 1):
        where[holder.order.id].release(holder)
        holder = await next_admission(pending)
        sequence.append(holder.order.id)
        view = await r2.view()
        assert sum(busy(view).values()) == 1
    assert sequence == ["second"] + [f"o{b:g}" for b in sorted(bids, reverse=True)]
    where[holder.order.id].release(holder)
    view = await settled(r1, waiting=0, busy_total=0)
    assert view.admitted_total == len(bids) + 2


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_releases_of_one_moment_go_in_one_call(redis_books: Books) -> None:
    """Slots given back together (runs ending in the same turn of the loop, or while
    the last give-back is in flight) cost one script call between them, and each is
    free again; the order waiting behind them gets one at once."""
    book = await redis_books([("d", 0.5, 8)])
    held = [now_admitted((await submit(book, f"r{i}", 1.0))[1]) for i in range(8)]
    nxt, waiting = await submit(book, "next", 2.0)
    assert not waiting.done()
    calls: list[str] = []
    real = book.hub.call

    async def counted(name: str, keys: list[str], args: list[Any], head: Any = ()) -> Any:
        calls.append(name)
        return await real(name, keys, args, head)

    book.hub.call = counted
    for adm in held:
        book.release(adm)
    await quiet(book)
    assert calls.count("RELEASE") <= 2  # the first alone at most, the rest while it was in flight
    assert (await admitted(book, nxt, waiting)).order.id == "next"
    await settled(book, waiting=0, busy_total=1)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_a_script_cache_emptied_under_the_book_is_filled_again(redis_books: Books) -> None:
    """The scripts run by their SHA; when Redis does not know it (a restart emptied its
    script cache) the script is given again on that call, which succeeds."""
    book = await redis_books([("d", 0.5, 1)])
    adm = now_admitted((await submit(book, "before", 1.0))[1])
    book.release(adm)
    await quiet(book)
    for script in book.hub.script.values():  # as if Redis had forgotten them (SCRIPT FLUSH is the
        script.sha = "0" * 40  # whole server's, shared with other tests): an unknown SHA
    adm = now_admitted((await submit(book, "after", 1.0))[1])
    assert adm.order.id == "after"
    book.release(adm)
    await settled(book, waiting=0, busy_total=0)


# -- 5. deadlines, cancellation, withdrawal ------------------------------------------------


@pytest.mark.anyio
async def test_wait_deadline_takes_the_order_out(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)])
    _, f = await submit(book, "blocker", 5.0)
    holder = now_admitted(f)
    o, fo = await submit(book, "late", 2.0)
    assert (await book.view()).waiting == 1
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError):
        await book.wait(o, fo, loop.time() + 0.2)
    view = await book.view()
    assert (view.waiting, view.bids) == (0, [])
    assert await book.standing(o) == (1.0, -1)
    book.release(holder)
    view = await settled(book, waiting=0, busy_total=0)  # the slot is not given to the late order
    await quiet(book)
    assert not (fo.done() and not fo.cancelled())
    assert view.admitted_total == 1


@pytest.mark.anyio
async def test_cancelled_wait_withdraws_the_order(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)])
    _, f = await submit(book, "blocker", 5.0)
    holder = now_admitted(f)
    o, fo = await submit(book, "gone", 2.0)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(book.wait(o, fo, loop.time() + 60))
    await asyncio.sleep(0.1)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settled(book, waiting=0, busy_total=1)
    book.release(holder)
    view = await settled(book, waiting=0, busy_total=0)
    await quiet(book)
    assert (await book.view()).admitted_total == view.admitted_total == 1


@pytest.mark.anyio
@pytest.mark.parametrize("when", ["admitted", "in_flight"])
async def test_withdraw_of_an_order_admitted_at_that_instant_gives_the_slot_back(
    make_book: Books, when: str
) -> None:
    book = await make_book([("d", 1.0, 1)])
    _, f = await submit(book, "blocker", 5.0)
    holder = now_admitted(f)
    o, fo = await submit(book, "leaver", 2.0)
    book.release(holder)
    if when == "admitted":
        # the admission reached the waiter's future, but the client is gone
        await asyncio.wait([fo], timeout=WAIT_S)
        assert fo.done()
    # else: withdraw right after the release, before anything could be awaited
    book.withdraw(o, fo)
    await settled(book, waiting=0, busy_total=0)
    await quiet(book)

    # the slot really is free, and it was given back exactly once
    n, fn = await submit(book, "next", 3.0)
    a = await admitted(book, n, fn)
    x, fx = await submit(book, "extra", 3.0)
    await quiet(book)
    await settled(book, waiting=1, busy_total=1)
    assert not fx.done()
    book.release(a)
    book.release(await admitted(book, x, fx))  # "extra" takes it
    view = await settled(book, waiting=0, busy_total=0)
    # blocker, next, extra (+ leaver when it was admitted before it left)
    if when == "admitted" or make_book.kind == "local":
        assert view.admitted_total == 4
    else:
        assert view.admitted_total in (3, 4)


# -- 6. requeue -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_requeue_keeps_the_arrival(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)])
    o1, f1 = await submit(book, "first", 3.0)
    a1 = now_admitted(f1)
    o2, f2 = await submit(book, "second", 3.0)  # same bid, later
    assert not f2.done()
    seq = o1.seq
    fr = await book.requeue(o1, a1)  # the slot is given back and o1 rests again, ahead of o2
    r1 = await admitted(book, o1, fr)
    assert r1.deployment == "d"
    assert (o1.seq, o1.requeues, o1.position_at_entry) == (seq, 1, 0)
    assert not f2.done()
    assert await book.standing(o2) == (3.0, 0)
    book.release(r1)
    a2 = await admitted(book, o2, f2)
    book.release(a2)
    view = await settled(book, waiting=0, busy_total=0)
    assert view.admitted_total == 3


@pytest.mark.anyio
async def test_requeue_with_waiting_orders_of_equal_bid(make_book: Books) -> None:
    # two slots: the requeued order must come back before the later equal bids
    book = await make_book([("d", 1.0, 2)])
    o1, f1 = await submit(book, "first", 3.0)
    a1 = now_admitted(f1)
    _, f0 = await submit(book, "other", 9.0)
    a0 = now_admitted(f0)
    later = [await submit(book, f"later{i}", 3.0) for i in range(3)]
    fr = await book.requeue(o1, a1)
    r1 = await admitted(book, o1, fr)
    assert not any(f.done() for _, f in later)
    book.release(a0)
    pending = {o.id: (o, f) for o, f in later}
    nxt = await next_admission(pending)
    assert nxt.order.id == "later0"
    book.release(r1)
    n1 = await next_admission(pending)
    assert n1.order.id == "later1"
    book.release(nxt)
    n2 = await next_admission(pending)
    assert n2.order.id == "later2"
    book.release(n1)
    book.release(n2)
    await settled(book, waiting=0, busy_total=0)


@pytest.mark.anyio
async def test_requeue_avoids_the_failed_deployment_while_another_is_free(make_book: Books) -> None:
    book = await make_book([("a", 1.0, 1), ("b", 2.0, 1)])
    o1, f1 = await submit(book, "o1", 5.0)
    a1 = now_admitted(f1)
    assert a1.deployment == "a"  # the cheapest
    await asyncio.sleep(0.2)  # the engine ran a moment (see the next test for a requeue at once)
    r1 = await admitted(book, o1, await book.requeue(o1, a1))
    assert (r1.deployment, r1.price) == ("b", 2.0)  # a is free too, but o1 just failed there
    assert o1.avoid == "a"

    o2, f2 = await submit(book, "o2", 5.0)
    a2 = now_admitted(f2)
    assert a2.deployment == "a"
    await asyncio.sleep(0.2)
    r2 = await admitted(book, o2, await book.requeue(o2, a2))
    assert r2.deployment == "a"  # nothing else is free: the failed deployment after all
    view = await book.view()
    assert busy(view) == {"a": 1, "b": 1}
    for adm in (r1, r2):
        book.release(adm)
    view = await settled(book, waiting=0, busy_total=0)
    assert view.admitted_total == 4


@pytest.mark.anyio
async def test_requeue_at_once_after_the_admission_gets_the_new_terms(
    make_book: Books, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine can fail at once: the requeued order's admission is the new one (on
    the other deployment, at its price), not the first one it just failed on.

    Redis: the first admission's channel message, if any, is pinned to arrive while
    the requeue is on its way (pub/sub delivery is not ordered with script replies)."""
    book = await make_book([("a", 1.0, 1), ("b", 2.0, 1)])
    late: list[tuple[str, str, str, str, int]] = []
    if isinstance(book, RedisBook):
        real_on, real_call = book.on_admitted, book.hub.call

        def held_back(order_id: str, deployment: str, price: str, level: str, attempt: int) -> None:
            late.append((order_id, deployment, price, level, attempt))

        async def call(name: str, keys: list[str], args: list[Any], head: Any = ()) -> Any:
            if name == "SUBMIT" and args[0] == "o1" and book._waiting["o1"][0].requeues == 1:
                monkeypatch.setattr(book, "on_admitted", real_on)
                for msg in late:  # the first admission's message lands now
                    real_on(*msg)
            return await real_call(name, keys, args, head)

        monkeypatch.setattr(book, "on_admitted", held_back)
        monkeypatch.setattr(book.hub, "call", call)
    o1, f1 = await submit(book, "o1", 5.0)
    a1 = now_admitted(f1)
    assert a1.deployment == "a"
    if isinstance(book, RedisBook):

        async def message_arrived() -> bool:
            return bool(late)

        # (an adapter may not publish an admission it returns in the reply: then none comes)
        with contextlib.suppress(AssertionError):
            await eventually(message_arrived, within=0.5)
    r1 = await admitted(book, o1, await book.requeue(o1, a1))
    await quiet(book)
    view = await book.view()
    assert busy(view) == {"a": 0, "b": 1}
    assert (r1.deployment, r1.price) == ("b", 2.0), "the requeued order got its first admission again"
    # a is free for the next order; b is held by o1 until it gives it back
    _, f2 = await submit(book, "o2", 5.0)
    assert now_admitted(f2).deployment == "a"
    book.release(r1)
    book.release(f2.result())
    await settled(book, waiting=0, busy_total=0)


def breaker_of(book: Any, name: str) -> CircuitBreaker:
    deps = book.book.deployments if isinstance(book, LocalBook) else book.deployments
    [d] = [d for d in deps if d.name == name]
    b: CircuitBreaker = d.breaker
    return b


@pytest.mark.anyio
async def test_requeues_of_one_order_count_once_on_the_breaker(make_book: Books) -> None:
    """One request that fails on every attempt counts one failure on its deployment's
    breaker (threshold 3 here): requeued three times, the breaker stays closed."""
    book = await make_book([("d", 1.0, 1)])
    o, f = await submit(book, "bad", 3.0)
    adm = now_admitted(f)
    for _ in range(3):
        adm = await admitted(book, o, await book.requeue(o, adm))
    book.report_failure("d", o)  # its last attempt failed too: the run gives up
    assert (breaker_of(book, "d").failures, o.requeues) == (1, 3)
    book.release(adm)
    other, fo = await submit(book, "next", 3.0)  # the next client is admitted
    book.release(await admitted(book, other, fo))
    await settled(book, waiting=0, busy_total=0)


# -- 7. a full book --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_book_full(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)], max_waiting=3)
    assert book.max_waiting == 3
    _, f = await submit(book, "blocker", 5.0)
    holder = now_admitted(f)  # holds a slot: does not count as waiting
    waiting = [await submit(book, f"w{i}", 2.0 + i) for i in range(3)]
    with pytest.raises(BookFull):
        await submit(book, "refused", 10.0)
    view = await book.view()
    assert (view.waiting, view.bids) == (3, [4.0, 3.0, 2.0])
    o, fo = waiting.pop(0)
    book.withdraw(o, fo)
    await settled(book, waiting=2, busy_total=1)
    late, fl = await submit(book, "late", 10.0)  # room again
    assert (await book.standing(late))[1] == 0
    book.release(holder)
    a = await admitted(book, late, fl)  # the refused order left no trace
    book.release(a)
    for o, fo in reversed(waiting):  # best bid first
        book.release(await admitted(book, o, fo))
    view = await settled(book, waiting=0, busy_total=0)
    assert view.admitted_total == 4


@pytest.mark.anyio
async def test_requeue_into_a_full_book_still_gives_its_slot_away(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)], max_waiting=2)
    o1, f1 = await submit(book, "o1", 5.0)
    a1 = now_admitted(f1)
    o2, f2 = await submit(book, "o2", 3.0)
    o3, f3 = await submit(book, "o3", 2.0)
    with pytest.raises(BookFull):
        await book.requeue(o1, a1)
    # o1 gave its slot back and could not rest again: the slot goes to the best order waiting
    a2 = await admitted(book, o2, f2, within=5.0)  # Redis: at the latest by the next heartbeat
    view = await settled(book, waiting=1, busy_total=1)
    assert view.bids == [2.0]
    book.release(a2)
    book.release(await admitted(book, o3, f3))
    await settled(book, waiting=0, busy_total=0)


# -- 8-9. Redis: leases and lost admissions -----------------------------------------------------


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_crashed_replica_loses_its_slots_and_orders_after_its_lease(redis_books: Books) -> None:
    lease_s = 1.0
    deps = [("d", 1.0, 1)]
    dead = await redis_books(deps, lease_s=lease_s)
    alive = await redis_books(deps, lease_s=lease_s)
    _, f = await submit(dead, "dead-holds", 5.0)
    now_admitted(f)
    await submit(dead, "dead-waits", 9.0)  # outbids the survivor's order
    ob, fb = await submit(alive, "alive-waits", 3.0)
    assert (await alive.view()).bids == [9.0, 3.0]
    # one full heartbeat of the dying replica after its submits: all its leases end together
    beats = dead.hub.heartbeats
    await eventually(_beats(dead, beats + 2), within=WAIT_S, what="two heartbeats")

    assert redis_books.replicas is not None
    await redis_books.replicas.crash(dead.hub)
    crashed_at = time.monotonic()
    adm = await admitted(alive, ob, fb)
    elapsed = time.monotonic() - crashed_at
    # lease + one heartbeat of the survivor, with a wide margin for a loaded machine
    assert elapsed < lease_s + lease_s / 3 + 5.0, elapsed
    assert (adm.deployment, adm.price) == ("d", 1.0)  # nobody else waits: the floor
    view = await alive.view()
    assert (view.waiting, view.bids, busy(view)) == (0, [], {"d": 1})
    assert view.admitted_total == 2  # the dead replica's waiting order never got the slot
    alive.release(adm)
    await settled(alive, waiting=0, busy_total=0)


def _beats(book: RedisBook, n: int) -> Any:
    async def check() -> bool:
        return book.hub.heartbeats >= n

    return check


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_lost_admission_message_is_delivered_by_the_heartbeat(redis_books: Books) -> None:
    lease_s = 1.0
    deps = [("d", 1.0, 1)]
    deaf = await redis_books(deps, lease_s=lease_s)
    other = await redis_books(deps, lease_s=lease_s)
    _, f = await submit(other, "holder", 5.0)
    holder = now_admitted(f)
    o, fo = await submit(deaf, "waiter", 4.0)
    assert redis_books.replicas is not None
    await redis_books.replicas.kill_listener(deaf.hub)
    assert await redis_books.replicas.subscribers(deaf.hub) == 0  # the admission message will be lost
    released_at = time.monotonic()
    other.release(holder)
    adm = await admitted(deaf, o, fo)
    elapsed = time.monotonic() - released_at
    assert elapsed < lease_s / 3 + 5.0, elapsed  # one heartbeat, with a wide margin
    assert (adm.deployment, adm.price) == ("d", 1.0)
    view = await other.view()
    assert (view.waiting, busy(view)) == (0, {"d": 1})
    assert view.admitted_total == 2  # the admission found, not a second one
    deaf.release(adm)
    await settled(other, waiting=0, busy_total=0)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_admission_channel_comes_back_after_its_connection_drops(redis_books: Books) -> None:
    """The server closes the replica's subscriber connection: the hub subscribes again,
    and the next admission arrives on the channel (the heartbeat is far off)."""
    lease_s = 30.0  # a heartbeat every 10 s: an admission well before it came by message
    deps = [("d", 1.0, 1)]
    cut = await redis_books(deps, lease_s=lease_s)
    other = await redis_books(deps, lease_s=lease_s)
    replicas = redis_books.replicas
    assert replicas is not None
    clients = await replicas.admin.client_list(_type="pubsub")
    [victim] = [c["id"] for c in clients if c.get("name") == cut.hub.subscriber_name]
    await replicas.admin.client_kill_filter(_id=victim)

    async def resubscribed() -> bool:
        now = await replicas.admin.client_list(_type="pubsub")
        ours = [c for c in now if c.get("name") == cut.hub.subscriber_name]
        return len(ours) == 1 and ours[0]["id"] != victim and await replicas.subscribers(cut.hub) == 1

    await eventually(resubscribed, within=WAIT_S, what="the admission channel subscribed again")
    _, f = await submit(other, "holder", 5.0)
    holder = now_admitted(f)
    o, fo = await submit(cut, "waiter", 4.0)
    beats = cut.hub.heartbeats
    other.release(holder)
    adm = await admitted(cut, o, fo, within=lease_s / 3 - 1.0)
    assert cut.hub.heartbeats == beats  # delivered by the channel, not found by a heartbeat
    assert (adm.deployment, adm.price) == ("d", 1.0)
    cut.release(adm)
    await settled(other, waiting=0, busy_total=0)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_timeout_racing_an_admission_keeps_the_slot_counted(
    redis_books: Books, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter's deadline fires just as another replica's release admits it: wait()
    either returns the admission (and its slot stays busy until released) or raises
    TimeoutError (and the slot is free) -- never an admission whose slot is given
    back behind the client's back.

    The interleaving is pinned: the other replica's release (which admits the waiter)
    runs when the deadline's REMOVE is about to be sent; the admission message is
    then handled by the listener; this replica's fire-and-forget calls started
    meanwhile run once the REMOVE has answered (a legal order: nothing orders them)."""
    deps = [("d", 1.0, 1)]
    a = await redis_books(deps)
    b = await redis_books(deps)
    _, f = await submit(b, "holder", 5.0)
    holder = now_admitted(f)
    o, fo = await submit(a, "waiter", 4.0)
    real_call, real_spawn = a.hub.call, a.hub.spawn
    removed = asyncio.Event()
    spawned: list[str] = []

    def spawn(coro: Any) -> asyncio.Task[Any]:
        spawned.append(coro.__qualname__)

        async def after_remove() -> Any:
            await removed.wait()
            return await coro

        task: asyncio.Task[Any] = real_spawn(after_remove())
        return task

    async def call(name: str, keys: list[str], args: list[Any], head: Any = ()) -> Any:
        if name != "REMOVE" or args[-1] != o.id:
            return await real_call(name, keys, args, head)
        try:
            b.release(holder)  # the other replica's release lands at the deadline: it admits the waiter
            await asyncio.wait(list(b.hub._background))

            async def message_handled() -> bool:
                return fo.done() or bool(spawned)

            with contextlib.suppress(AssertionError):
                await eventually(message_handled, within=3.0)
            return await real_call(name, keys, args, head)
        finally:
            removed.set()

    monkeypatch.setattr(a.hub, "call", call)
    monkeypatch.setattr(a.hub, "spawn", spawn)
    loop = asyncio.get_running_loop()
    adm: Admission | None
    try:
        adm = await a.wait(o, fo, loop.time() + 0.1)
    except TimeoutError:
        adm = None
    removed.set()
    await quiet(a)
    await quiet(b)
    monkeypatch.undo()
    view = await b.view()
    if adm is None:
        assert not (fo.done() and not fo.cancelled())
        assert (view.waiting, busy(view)) == (0, {"d": 0})
        return
    assert (view.waiting, busy(view)) == (0, {"d": 1}), (
        f"wait() returned an admission whose slot was given back (spawned: {spawned})"
    )
    # and the slot is not handed to someone else while the client runs
    x, fx = await submit(b, "intruder", 9.0)
    assert not fx.done(), "a second order was admitted to the one slot the client holds"
    b.withdraw(x, fx)
    a.release(adm)
    await settled(b, waiting=0, busy_total=0)


# -- 10. the market view ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_view_fields(make_book: Books) -> None:
    book = await make_book([("a", 1.0, 1), ("b", 2.0, 2)])
    view = await book.view()
    assert (view.level, view.waiting, view.best_bid, view.admitted_total) == (1.0, 0, None, 0)
    assert view.deployments == [
        DeploymentView("a", 1.0, 1, 0, True, "closed"),
        DeploymentView("b", 2.0, 2, 0, True, "closed"),
    ]
    assert (view.bids, view.recent) == ([], [])

    started = time.time()
    held = []
    for oid, bid in [("x5", 5.0), ("x6", 6.0), ("x7", 7.0)]:
        _, f = await submit(book, oid, bid)
        held.append(now_admitted(f))
        await asyncio.sleep(0.01)  # distinct clear times
    waiting = {}
    for oid, bid in [("w4", 4.0), ("w3", 3.0), ("w45", 4.5)]:
        o, f = await submit(book, oid, bid)
        waiting[oid] = (o, f)
    view = await book.view()
    assert (view.level, view.waiting, view.best_bid, view.admitted_total) == (4.5, 3, 4.5, 3)
    assert [(d.name, d.busy, d.slots, d.floor) for d in view.deployments] == [
        ("a", 1, 1, 1.0),
        ("b", 2, 2, 2.0),
    ]
    assert view.bids == [4.5, 4.0, 3.0]
    assert [(c.price, c.bid, c.deployment) for c in view.recent] == [
        (2.0, 7.0, "b"),
        (2.0, 6.0, "b"),
        (1.0, 5.0, "a"),
    ]
    ats = [c.at for c in view.recent]
    assert ats == sorted(ats, reverse=True)
    assert all(started - 5 <= at <= time.time() + 5 for at in ats)

    book.release(held[0])  # a frees: 4.5 takes it, the runner-up 4.0 sets the price
    a45 = await admitted(book, *waiting.pop("w45"))
    assert (a45.deployment, a45.price, a45.level) == ("a", 4.0, 4.0)
    view = await book.view()
    assert (view.level, view.waiting, view.best_bid, view.admitted_total) == (4.0, 2, 4.0, 4)
    assert view.bids == [4.0, 3.0]
    assert (view.recent[0].price, view.recent[0].bid, view.recent[0].deployment) == (4.0, 4.5, "a")
    assert len(view.recent) == 4

    for o, f in waiting.values():
        book.withdraw(o, f)
    for adm in (a45, *held[1:]):
        book.release(adm)
    view = await settled(book, waiting=0, busy_total=0)
    assert (view.level, view.best_bid, view.bids) == (1.0, None, [])


# -- 11. the market under stress: a stopped replica, a departed client, a place kept ---------------


@pytest.mark.anyio
async def test_a_slot_never_goes_to_an_order_whose_client_left(make_book: Books) -> None:
    """The client is asked when a slot comes to its order: one that has left (the event
    loop has not seen the disconnect yet) is not admitted, and the slot goes to the
    next order at once."""
    book = await make_book([("d", 1.0, 1)])
    _, f = await submit(book, "holder", 9.0)
    holder = now_admitted(f)
    gone = book.new_order("gone", 5.0)
    asked: list[str] = []

    def present() -> bool:
        asked.append(gone.id)
        return False

    gone.present = present
    fg = await book.submit(gone)
    b, fb = await submit(book, "b", 3.0)
    assert not fg.done() and not fb.done()
    book.release(holder)
    adm = await admitted(book, b, fb)
    assert asked, "the client of the best order was not asked at its admission"
    assert (adm.deployment, adm.price) == ("d", 1.0)  # nobody else waits: the floor
    loop = asyncio.get_running_loop()
    with pytest.raises(ClientGone):
        await book.wait(gone, fg, loop.time() + WAIT_S)
    await quiet(book)
    view = await settled(book, waiting=0, busy_total=1)
    assert view.admitted_total == 2  # the holder and b: the departed client's order was never admitted
    assert [c.bid for c in view.recent] == [3.0, 9.0]
    book.release(adm)
    await settled(book, waiting=0, busy_total=0)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_an_admission_not_taken_up_goes_to_the_next_order(redis_books: Books) -> None:
    """A replica stopped (SIGSTOP) when a slot comes to its order does not keep the
    slot for its lease: past the take-up deadline the admission goes back, the slot to
    the next order, and the stopped replica's order keeps its place for its return."""
    take_up_s = 0.3
    deps = [("d", 1.0, 1)]
    stopped = await redis_books(deps, take_up_s=take_up_s)  # lease 3 s
    running = await redis_books(deps, take_up_s=take_up_s)
    replicas = redis_books.replicas
    assert replicas is not None
    _, f = await submit(running, "holder", 9.0)
    holder = now_admitted(f)
    a, fa = await submit(stopped, "a", 5.0)
    b, fb = await submit(running, "b", 3.0)
    held = await replicas.pause(stopped.hub)
    released_at = time.monotonic()
    running.release(holder)
    adm_b = await admitted(running, b, fb)
    waited = time.monotonic() - released_at
    assert held, "the slot was not offered to the stopped replica's order first"
    assert waited < 2.0, f"the slot idled {waited:.2f} s (take-up deadline {take_up_s} s, lease 3 s)"
    assert (adm_b.deployment, adm_b.price) == ("d", 1.0)  # a waits parked: nobody left to set the price
    view = await running.view()
    assert (view.waiting, view.parked, view.admitted_total) == (0, 1, 2)  # the returned offer is no admission
    c, fc = await submit(running, "c", 4.0)  # arrives while a's replica is stopped

    await replicas.resume(stopped.hub)  # its late word on the old offer finds a back in its place

    async def a_first() -> bool:
        return bool((await stopped.standing(a))[1] == 0)

    await eventually(a_first, within=WAIT_S, what="a back at the head of the book")
    running.release(adm_b)
    adm_a = await admitted(stopped, a, fa)
    assert (adm_a.deployment, adm_a.price) == ("d", 4.0)  # second price: c's bid
    assert not fc.done()
    stopped.release(adm_a)
    running.release(await admitted(running, c, fc))
    view = await settled(running, waiting=0, busy_total=0)
    assert (view.parked, view.admitted_total) == (0, 4)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_order_of_a_silent_replica_keeps_its_place(redis_books: Books) -> None:
    """A replica silent past its lease (stopped): its waiting order is admitted to
    nobody meanwhile but keeps its arrival; at the replica's first word it is back in
    its place (ahead of an equal bid that arrived later), its arrival, deadline and
    position at entry unchanged."""
    lease_s = 1.0
    deps = [("d", 1.0, 1)]
    silent = await redis_books(deps, lease_s=lease_s)
    other = await redis_books(deps, lease_s=lease_s)
    replicas = redis_books.replicas
    assert replicas is not None
    _, f = await submit(other, "holder", 9.0)
    holder = now_admitted(f)
    a, fa = await submit(silent, "a", 3.0)
    x, fx = await submit(other, "x", 5.0)  # arrives after a and outbids it
    assert (a.position_at_entry, x.position_at_entry) == (0, 0)
    seq, arrived = a.seq, a.arrived_at
    await replicas.pause(silent.hub)

    async def a_parked() -> bool:
        view = await other.view()
        return bool(view.parked == 1)

    await eventually(a_parked, within=WAIT_S, what="the silent replica's order parked")
    view = await other.view()
    assert (view.waiting, view.bids) == (1, [5.0])
    b, fb = await submit(other, "b", 3.0)  # the same bid as a, later

    ranks: list[int] = []

    async def first_word() -> None:
        if not ranks:
            ranks.append((await silent.standing(a))[1])

    silent.hub.on_beat(first_word)
    await replicas.resume(silent.hub)
    await silent.hub.beat()  # its first word after the pause
    assert ranks == [1], "the order was not back in its place at its replica's first word"
    assert (a.seq, a.arrived_at, a.position_at_entry) == (seq, arrived, 0)
    assert (await other.view()).parked == 0

    sequence = []
    other.release(holder)
    pending = {"a": (a, fa), "b": (b, fb), "x": (x, fx)}
    where = {"a": silent, "b": other, "x": other}
    for _ in range(3):
        adm = await next_admission(pending)
        sequence.append(adm.order.id)
        where[adm.order.id].release(adm)
    assert sequence == ["x", "a", "b"]
    assert a.position_at_entry == 0
    await settled(other, waiting=0, busy_total=0)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_forgetting_the_book_loses_no_order_and_no_slot(redis_books: Books) -> None:
    """Redis restarts empty: at their next heartbeat the replicas rest their waiting
    orders again with their arrival (position at entry unchanged) and count their
    running slots again, so a new order neither passes them nor takes a slot in use."""
    deps = [("d", 1.0, 1)]
    r1 = await redis_books(deps)
    r2 = await redis_books(deps)
    replicas = redis_books.replicas
    assert replicas is not None
    _, f = await submit(r1, "running", 9.0)
    running = now_admitted(f)
    a, fa = await submit(r1, "a", 3.0)
    x, fx = await submit(r2, "x", 5.0)
    seqs = (a.seq, x.seq)
    assert (a.position_at_entry, x.position_at_entry) == (0, 0)

    await replicas.admin.delete(*await replicas.keys())  # a restart without persistence
    await r1.hub.beat()
    await r2.hub.beat()
    await quiet(r1)
    view = await r2.view()
    assert (busy(view), view.bids) == ({"d": 1}, [5.0, 3.0]), view
    assert (a.seq, x.seq) == seqs
    assert (a.position_at_entry, x.position_at_entry) == (0, 0)

    b, fb = await submit(r2, "b", 3.0)  # after the restart, the same bid as a
    assert not fb.done(), "a new order took the slot a running request holds"
    assert b.seq > a.seq
    assert [(await bk.standing(o))[1] for bk, o in ((r2, x), (r1, a), (r2, b))] == [0, 1, 2]
    r1.release(running)
    pending = {"a": (a, fa), "b": (b, fb), "x": (x, fx)}
    where = {"a": r1, "b": r2, "x": r2}
    sequence = []
    for _ in range(3):
        adm = await next_admission(pending)
        sequence.append(adm.order.id)
        where[adm.order.id].release(adm)
    assert sequence == ["x", "a", "b"]
    await settled(r2, waiting=0, busy_total=0)


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_unreachable_for_a_lease_fails_the_waiting_orders(
    redis_books: Books, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No order waits on a book that may have forgotten it: once Redis has not answered
    for a lease, the orders waiting here fail with BookUnavailable (a 503 with
    retry-after), and the book forgets them once Redis answers again."""
    lease_s = 1.0
    book = await redis_books([("d", 1.0, 1)], lease_s=lease_s)
    _, f = await submit(book, "holder", 9.0)
    holder = now_admitted(f)
    o, fo = await submit(book, "waiter", 3.0)
    real_call = book.hub.call

    async def down(name: str, keys: list[str], args: list[Any], head: Any = ()) -> Any:
        raise RedisConnectionError("Error 111 connecting to Redis (test)")

    monkeypatch.setattr(book.hub, "call", down)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(BookUnavailable):
        await book.wait(o, fo, t0 + lease_s + 4.0)
    assert loop.time() - t0 < lease_s + 3.0
    monkeypatch.setattr(book.hub, "call", real_call)
    await book.hub.beat()
    await quiet(book)
    view = await settled(book, waiting=0, busy_total=1)
    assert view.bids == []
    book.release(holder)
    await settled(book, waiting=0, busy_total=0)


# -- availability (the probes) and slots from the engine ------------------------------


def _dep(book: Any, name: str) -> Deployment:
    """This replica's deployment object (what the probes mark)."""
    found: Deployment = book.book.deployment(name) if isinstance(book, LocalBook) else book._by_name[name]
    return found


@pytest.mark.anyio
async def test_an_unavailable_deployment_takes_no_order_until_a_probe_passes(make_book: Books) -> None:
    book = await make_book([("cheap", 1.0, 1), ("dear", 2.0, 1)])
    cheap = _dep(book, "cheap")
    cheap.availability.fail("the upstream is unreachable")
    book.deployment_changed("cheap")
    await quiet(book)
    _, f = await submit(book, "a", 5.0)
    assert now_admitted(f).deployment == "dear"  # the cheaper one is out
    b, fb = await submit(book, "b", 5.0)
    assert not fb.done()  # dear is busy; cheap is free but unavailable
    view = await book.view()
    by = {d.name: d for d in view.deployments}
    assert by["cheap"].available is False and by["cheap"].reason == "the upstream is unreachable"
    assert by["dear"].available is True and by["dear"].reason is None
    assert book.healthy()  # dear can still take orders
    cheap.availability.set(None)  # a probe passed
    book.deployment_changed("cheap")
    assert (await admitted(book, b, fb)).deployment == "cheap"


@pytest.mark.anyio
async def test_failures_on_an_unavailable_deployment_are_not_counted_by_its_breaker(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)])
    d = _dep(book, "d")
    d.breaker.threshold = 1
    d.availability.fail("the upstream has no route (HTTP 404)")
    book.deployment_changed("d")
    book.report_failure("d")
    assert d.breaker.failures == 0 and d.breaker.state == "closed"
    assert not book.healthy()
    await quiet(book)


@pytest.mark.anyio
async def test_slots_from_the_engine_apply_at_once(make_book: Books) -> None:
    book = await make_book([("d", 1.0, 1)])
    _, f1 = await submit(book, "a", 1.0)
    now_admitted(f1)
    b, fb = await submit(book, "b", 1.0)
    assert not fb.done()
    _dep(book, "d").slots = 2  # the probe read the engine's capacity
    book.deployment_changed("d")
    await admitted(book, b, fb)
    assert (await book.view()).deployments[0].slots == 2


@pytest.mark.anyio
async def test_redis_a_replica_that_finds_a_deployment_unavailable_holds_it_out_for_all(
    redis_books: Books,
) -> None:
    one = await redis_books([("cheap", 1.0, 1), ("dear", 2.0, 1)])
    two = await redis_books([("cheap", 1.0, 1), ("dear", 2.0, 1)])
    cheap = _dep(one, "cheap")
    cheap.availability.hold_s = 30
    cheap.availability.fail("the upstream is unreachable")
    one.deployment_changed("cheap")
    await quiet(one)
    _, f = await submit(two, "a", 5.0)
    assert now_admitted(f).deployment == "dear"
    cheap.availability.set(None)
    one.deployment_changed("cheap")
    await quiet(one)
    _, f = await submit(two, "b", 5.0)
    assert now_admitted(f).deployment == "cheap"


@pytest.mark.anyio
async def test_a_breakers_cooling_is_timed_on_redis_clock_not_the_replicas(
    redis_books: Books, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica whose own clock is 120 s ahead opens a deployment's breaker: the cooling
    it shares with the other replicas lasts the breaker's cooldown on Redis's clock, not
    two minutes more (issue 35, item 3: the replica sent its own clock's time, which Redis
    compared with its own)."""
    import bourse.coordination.book_redis as book_redis

    ahead = types.SimpleNamespace(time=lambda: time.time() + 120.0)
    monkeypatch.setattr(book_redis, "time", ahead)  # the module's wall clock, 120 s off
    skewed = await redis_books([("d", 1.0, 1)])
    other = await redis_books([("d", 1.0, 1)])
    breaker = breaker_of(skewed, "d")
    breaker.threshold, breaker.cooldown_s = 1, 1.0
    skewed.report_failure("d")
    redis = skewed.hub.redis
    key = next(k for k in skewed._keys if k.endswith(b":cool")).decode()
    deadline = time.monotonic() + WAIT_S
    while (until := await redis.hget(key, "d")) is None:
        assert time.monotonic() < deadline, "the cooling was never shared"
        await asyncio.sleep(0.01)
    sec, usec = await redis.time()
    left_s = (float(until) - (int(sec) * 1000 + int(usec) // 1000)) / 1000.0
    assert 0.0 < left_s <= 1.0, f"the deployment cools {left_s:.1f} s on Redis's clock, not its 1 s"
    # and the other replica's orders get the deployment back once it has cooled
    await asyncio.sleep(1.1)
    o, f = await submit(other, "after", 2.0)
    other.release(await admitted(other, o, f))
