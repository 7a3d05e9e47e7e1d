"""The order book, without an event loop: priority, eligibility, clearing, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bourse.domain.book import BookFull, Deployment, Order, ProductBook, expected_wait_s, requeue_delay_s


def book(*deps: tuple[str, float, int], max_waiting: int = 1000) -> ProductBook:
    return ProductBook("p", [Deployment(n, f, s) for n, f, s in deps], max_waiting=max_waiting)


def order(b: ProductBook, oid: str, bid: float) -> Order:
    return Order(id=oid, bid=bid, seq=b.next_seq(), arrived_at=0.0)


def test_free_slot_and_empty_book_admits_at_once_at_the_floor() -> None:
    b = book(("d", 0.05, 1))
    o = order(b, "a", 0.5)
    assert b.add(o) == 0
    [adm] = b.dispatch(0.0)
    assert adm.order is o and adm.deployment == "d"
    assert adm.price == 0.05  # nobody else waiting: pays the floor
    assert b.level(0.0) == 0.05  # no free slot, empty book: the floor


def test_admission_in_bid_order_then_arrival_and_second_price() -> None:
    b = book(("d", 0.05, 1))
    first = order(b, "busy", 1.0)
    b.add(first)
    b.dispatch(0.0)
    bids = [0.3, 0.9, 0.1, 0.9, 0.6]
    orders = [order(b, f"o{i}", bid) for i, bid in enumerate(bids)]
    for o in orders:
        b.add(o)
    assert b.level(0.0) == 0.9
    admitted = []
    for _ in orders:
        b.release("d")
        [adm] = b.dispatch(0.0)
        admitted.append(adm)
    assert [a.order.id for a in admitted] == ["o1", "o3", "o4", "o0", "o2"]
    # each pays max(floor, best bid still waiting), never above its bid
    assert [a.price for a in admitted] == [0.9, 0.6, 0.3, 0.1, 0.05]


def test_eligibility_by_floor_and_cheapest_deployment_first() -> None:
    b = book(("cheap", 0.1, 1), ("dear", 1.0, 1))
    low = order(b, "low", 0.2)
    b.add(low)
    [adm] = b.dispatch(0.0)
    assert adm.deployment == "cheap"
    low2 = order(b, "low2", 0.2)
    b.add(low2)
    assert b.dispatch(0.0) == []  # 'dear' is free but above its bid
    high = order(b, "high", 2.0)
    b.add(high)
    [adm] = b.dispatch(0.0)
    assert adm.order is high and adm.deployment == "dear"
    assert adm.price == 1.0  # floor 1.0 beats the waiting 0.2


def test_ties_on_floor_go_to_the_fewest_busy_and_a_cheaper_floor_wins_over_idleness() -> None:
    b = book(("cheap", 0.1, 3), ("a", 0.5, 2), ("b", 0.5, 2))
    deps = []
    for i in range(7):
        b.add(order(b, str(i), 1.0))
        [adm] = b.dispatch(0.0)
        deps.append(adm.deployment)
        busy = {d.name: d.busy for d in b.deployments}
        if adm.deployment in ("a", "b"):
            other = "b" if adm.deployment == "a" else "a"
            # it went where fewer slots were busy (before this admission)
            assert busy[adm.deployment] - 1 <= busy[other], (deps, busy)
    # the cheap deployment fills first although the others are idle
    assert deps[:3] == ["cheap"] * 3
    assert sorted(deps[3:5]) == ["a", "b"] and sorted(deps[5:7]) == ["a", "b"], deps


def test_requeue_keeps_place_and_avoids_failed_deployment() -> None:
    b = book(("a", 0.0, 1), ("b", 0.0, 1))
    o = order(b, "o", 1.0)
    b.add(o)
    [adm] = b.dispatch(0.0)
    assert adm.deployment == "a"
    later = order(b, "later", 1.0)
    b.release("a")
    o.avoid = "a"
    b.add(o)
    b.add(later)
    assert b.position(o) == 0  # kept its arrival
    adms = b.dispatch(0.0)
    assert [(x.order.id, x.deployment) for x in adms] == [("o", "b"), ("later", "a")]


def test_breaker_cools_a_failing_deployment() -> None:
    b = ProductBook("p", [Deployment("a", 0.0, 1), Deployment("b", 0.0, 1)])
    b.deployment("a").breaker.threshold = 1
    b.deployment("a").breaker.cooldown_s = 5
    b.report_failure("a", 10.0)
    assert b.next_recovery(10.0) == 15.0
    o1, o2 = order(b, "1", 1), order(b, "2", 1)
    b.add(o1)
    b.add(o2)
    adms = b.dispatch(11.0)
    assert [a.deployment for a in adms] == ["b"]
    adms = b.dispatch(15.0)  # half-open: one trial
    assert [a.deployment for a in adms] == ["a"]


def test_bounded_book() -> None:
    b = book(("d", 0.0, 1), max_waiting=2)
    b.add(order(b, "1", 1))
    b.add(order(b, "2", 1))
    with pytest.raises(BookFull):
        b.add(order(b, "3", 1))


def test_release_of_idle_slot_is_a_bug() -> None:
    b = book(("d", 0.0, 1))
    with pytest.raises(AssertionError):
        b.release("d")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from([0.05, 0.1, 0.2, 0.5, 1.0, 2.0])),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, 50)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_sequences_keep_priority_and_no_idle_slot(seq: list[tuple[str, float | int]]) -> None:
    b = book(("cheap", 0.1, 2), ("dear", 0.5, 1))
    waiting: list[Order] = []
    running: list[tuple[Order, str]] = []
    for op, arg in seq:
        if op == "arrive":
            o = order(b, str(len(waiting)), float(arg))
            b.add(o)
            waiting.append(o)
        elif op == "cancel" and waiting:
            o = waiting.pop(int(arg) % len(waiting))
            assert b.remove(o)
        elif op == "release" and running:
            _, dep = running.pop(int(arg) % len(running))
            b.release(dep)
        for adm in b.dispatch(0.0):
            # no priority inversion: nobody still waiting and eligible for this
            # deployment ranks ahead of the admitted order
            floor = b.deployment(adm.deployment).floor
            for w in b.waiting_orders():
                if w.bid >= floor:
                    assert w.rank() > adm.order.rank()
            assert adm.price <= adm.order.bid
            assert adm.price >= floor
            waiting.remove(adm.order)
            running.append((adm.order, adm.deployment))
        b.check()
        # no slot idle while an eligible order waits
        for d in b.deployments:
            if d.busy < d.slots:
                assert all(w.bid < d.floor for w in b.waiting_orders())


# -- arrivals, cancels, timeouts, releases and requeues over several deployments --------------

FLOOR_CHOICES = [0.0, 0.1, 0.5, 1.0]
BID_CHOICES = [0.1, 0.2, 0.5, 1.0, 2.0]

deployments_st = st.lists(
    st.tuples(st.sampled_from(FLOOR_CHOICES), st.integers(1, 3)), min_size=1, max_size=4
).filter(lambda ds: min(f for f, _ in ds) <= min(BID_CHOICES))  # the gateway refuses bids below every floor

ops_full = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(BID_CHOICES), st.floats(0.5, 20.0)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0.0)),
        st.tuples(st.just("tick"), st.just(0), st.floats(0.0, 6.0)),
        st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("requeue"), st.integers(0, 50), st.just(0.0)),
    ),
    min_size=30,
    max_size=200,
)


class _Run:
    """One random sequence against a book: each op, then the book rules checked."""

    def __init__(self, deps: list[tuple[float, int]]) -> None:
        self.b = ProductBook(
            "p", [Deployment(f"d{i}", f, s) for i, (f, s) in enumerate(deps)], max_waiting=10_000
        )
        self.now = 0.0
        self.deadline: dict[int, float] = {}  # seq -> when its book timeout fires
        self.running: list[tuple[Order, str]] = []

    def arrive(self, arg: float | int, extra: float | bool) -> None:
        b = self.b
        o = Order(id=str(b._seq), bid=float(arg), seq=b.next_seq(), arrived_at=self.now)
        self.deadline[o.seq] = self.now + float(extra)
        ahead = b.add(o)
        assert ahead == sum(1 for w in b.waiting_orders() if w.rank() < o.rank())

    def cancel(self, arg: float | int, extra: float | bool) -> None:
        if self.b.waiting:
            waiting = self.b.waiting_orders()
            assert self.b.remove(waiting[int(arg) % len(waiting)])

    def tick(self, arg: float | int, extra: float | bool) -> None:
        self.now += float(extra)
        for w in self.b.waiting_orders():  # what Market.wait does at the deadline
            if self.deadline[w.seq] <= self.now:
                assert self.b.remove(w)

    def release(self, arg: float | int, extra: float | bool) -> None:
        if self.running:
            _, dep = self.running.pop(int(arg) % len(self.running))
            if extra:
                self.b.report_success(dep)
            self.b.release(dep)

    def requeue(self, arg: float | int, extra: float | bool) -> None:
        if not self.running:
            return
        # the engine failed before output: cool, give back, back into the book
        b = self.b
        o, dep = self.running.pop(int(arg) % len(self.running))
        b.report_failure(dep, self.now)
        b.release(dep)
        o.avoid = dep
        o.requeues += 1
        ahead = b.add(o)
        # it keeps its arrival: only better bids, or equal bids that came earlier, are ahead
        assert ahead == sum(1 for w in b.waiting_orders() if (-w.bid, w.seq) < (-o.bid, o.seq))

    def dispatch(self) -> None:
        b = self.b
        admissions = b.dispatch(self.now)
        for k, adm in enumerate(admissions):
            d = b.deployment(adm.deployment)
            still_waiting = [a.order for a in admissions[k + 1 :]] + b.waiting_orders()
            # no priority inversion: it ranked ahead of every order still waiting
            assert all(adm.order.rank() < w.rank() for w in still_waiting)
            # eligible where it runs
            assert d.floor <= adm.order.bid
            # second price: max(floor, best bid still waiting), never above its own bid
            runner_up = max((w.bid for w in still_waiting), default=0.0)
            assert adm.price == min(adm.order.bid, max(d.floor, runner_up))
            assert d.floor <= adm.price <= adm.order.bid
            self.running.append((adm.order, adm.deployment))

    def check(self) -> None:
        b, now = self.b, self.now
        b.check()
        assert b.busy_slots() == len(self.running)
        waiting = b.waiting_orders()
        # no slot idle while an eligible order waits
        for d in b.deployments:
            if d.busy < d.slots and d.breaker.available(now):
                assert all(w.bid < d.floor for w in waiting), (d, waiting)
        # the level: the lowest free floor with an empty book, else the best bid waiting
        free = [d.floor for d in b.deployments if d.busy < d.slots and d.breaker.available(now)]
        if waiting:
            assert b.level(now) == waiting[0].bid == max(w.bid for w in waiting)
        elif free:
            assert b.level(now) == min(free)


@settings(max_examples=300, deadline=None)
@given(deployments_st, ops_full)
def test_random_sequences_with_timeouts_and_requeues_keep_every_book_rule(
    deps: list[tuple[float, int]], seq: list[tuple[str, float | int, float | bool]]
) -> None:
    run = _Run(deps)
    ops = {"arrive": run.arrive, "cancel": run.cancel, "tick": run.tick, "release": run.release,
           "requeue": run.requeue}  # fmt: skip
    for op, arg, extra in seq:
        ops[op](arg, extra)
        run.dispatch()
        run.check()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0.05, 0.1, 0.5, 2.0]), st.integers(0, 2)), max_size=8),
    st.sampled_from([0.05, 0.1, 0.3, 0.5, 2.0]),
    st.sampled_from([None, "cheap", "dear"]),
    st.booleans(),
)
def test_admission_at_once_is_what_add_then_dispatch_gives(
    before: list[tuple[float, int]], bid: float, avoid: str | None, cooling: bool
) -> None:
    """The admission of an order arriving at an empty book, without entering it, is the
    one adding it and dispatching gives (slot, price, level, the deployments' state);
    and none at all when an order waits."""
    books = []
    for _ in range(2):
        b = book(("cheap", 0.1, 2), ("dear", 0.5, 1), ("far", 1.0, 1))
        if cooling:
            for _ in range(10):
                b.report_failure("cheap", 0.0)
        for i, (first, releases) in enumerate(before):  # slots taken and given back
            o = order(b, f"b{i}", first)
            b.add(o)
            for taken in b.dispatch(0.0)[:releases]:
                b.release(taken.deployment)
        books.append(b)
    at_once, added = books
    o1, o2 = order(at_once, "x", bid), order(added, "x", bid)
    o1.avoid = o2.avoid = avoid
    waits = added.waiting > 0
    adm = at_once.admit_at_once(o1, 1.0)
    added.add(o2)
    [*admitted] = added.dispatch(1.0)
    if waits:
        assert adm is None
        return
    if adm is None:
        assert admitted == []
        assert at_once.waiting == 0  # not in the book: the caller adds it
        return
    [other] = admitted
    assert (adm.deployment, adm.price, adm.level) == (other.deployment, other.price, other.level)
    assert [(d.busy, d.breaker.state) for d in at_once.deployments] == [
        (d.busy, d.breaker.state) for d in added.deployments
    ]
    assert at_once.waiting == added.waiting == 0
    at_once.check()


def test_no_admission_at_once_while_an_order_waits() -> None:
    b = book(("d", 0.5, 1))
    b.add(order(b, "low", 0.1))  # below the floor: it waits
    assert b.admit_at_once(order(b, "high", 1.0), 0.0) is None


def test_expected_wait_is_the_time_of_the_admissions_ahead_at_the_recent_pace() -> None:
    assert expected_wait_s(0, 0, 0.0) is None  # no pace yet
    assert expected_wait_s(3, 1, 5.0) is None  # one admission is no pace
    assert expected_wait_s(0, 10, 5.0) == 0.5  # 2 admissions a second: the next one in 0.5 s
    assert expected_wait_s(3, 10, 5.0) == 2.0  # four admissions


def test_a_request_counts_once_on_a_breaker_however_many_attempts_it_made() -> None:
    """One request that fails on every attempt (a prompt the engine cannot take) must not
    open the breaker for everyone by itself: its failures count once per deployment."""
    b = book(("a", 0.0, 1), ("b", 0.0, 1))
    breaker = b.deployment("a").breaker
    breaker.threshold = 3
    bad = order(b, "bad", 1)
    for t in range(4):  # the first attempt and three requeues, all on a
        b.report_failure("a", float(t), bad)
    assert breaker.failures == 1 and breaker.state == "closed"
    b.report_failure("b", 5.0, bad)  # once on each deployment it failed on
    assert (breaker.failures, b.deployment("b").breaker.failures) == (1, 1)
    for i in range(2):  # two other requests that fail there: three requests, it opens
        b.report_failure("a", 6.0, order(b, f"other{i}", 1))
    assert breaker.state == "open"


def test_a_failed_half_open_trial_always_counts() -> None:
    b = book(("a", 0.0, 1))
    breaker = b.deployment("a").breaker
    breaker.threshold, breaker.cooldown_s = 1, 5.0
    o = order(b, "o", 1)
    b.report_failure("a", 0.0, o)
    assert not breaker.available(1.0)
    b.add(o)
    [adm] = b.dispatch(5.0)  # the cool-down is over: o is the trial
    assert adm.order is o and breaker.trial_running
    b.report_failure("a", 5.0, o)  # o failed there before, but the trial's verdict counts
    assert not breaker.available(6.0)


def test_requeue_delays_grow_and_are_bounded() -> None:
    delays = [requeue_delay_s(n) for n in range(8)]
    assert delays[:4] == [0.05, 0.1, 0.2, 0.4]
    assert delays == sorted(delays) and max(delays) == 1.0
    assert requeue_delay_s(10_000) == 1.0
