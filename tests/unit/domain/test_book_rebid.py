"""A deadline order's raise in the book (:meth:`ProductBook.rebid`, issue 38): the
order is ranked again at its new bid with its arrival kept, never above its ceiling,
never lowered; and the book's rules hold with raises among random arrivals,
cancels, timeouts, releases and requeues."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bourse.domain.book import Deployment, Order, ProductBook, check_raise
from tests.unit.domain.test_book import BID_CHOICES, _Run, deployments_st


def book(*deps: tuple[str, float, int]) -> ProductBook:
    return ProductBook("p", [Deployment(n, f, s) for n, f, s in deps], max_waiting=1000)


def order(b: ProductBook, oid: str, bid: float, ceiling: float | None = None) -> Order:
    return Order(id=oid, bid=bid, seq=b.next_seq(), arrived_at=0.0, ceiling=ceiling)


def busy_book() -> ProductBook:
    """One slot, taken."""
    b = book(("d", 0.1, 1))
    b.add(order(b, "running", 5.0))
    assert len(b.dispatch(0.0)) == 1
    return b


def ids(b: ProductBook) -> list[str]:
    return [o.id for o in b.waiting_orders()]


def test_a_raised_order_overtakes_the_lower_bids_and_keeps_its_arrival_among_equal_ones() -> None:
    b = busy_book()
    early = order(b, "early", 1.0)
    low = order(b, "low", 0.5)
    dl = order(b, "dl", 0.2, ceiling=2.0)
    late = order(b, "late", 1.0)
    for o in (early, low, dl, late):
        b.add(o)
    assert ids(b) == ["early", "late", "low", "dl"]
    # raised to an equal bid: behind the one that arrived earlier, ahead of the later one
    assert b.rebid(dl, 1.0)
    assert dl.bid == 1.0 and dl.seq == 4  # its arrival kept
    assert ids(b) == ["early", "dl", "late", "low"]
    assert b.position(dl) == 1
    b.check()
    # raised over everyone: first
    assert b.rebid(dl, 2.0)
    assert ids(b) == ["dl", "early", "late", "low"] and b.level(0.0) == 2.0
    b.check()
    # the next slot is its, at the second price (the best bid still waiting)
    b.release("d")
    [adm] = b.dispatch(0.0)
    assert adm.order is dl and adm.price == 1.0
    b.check()


def test_a_raise_is_never_above_the_ceiling_nor_a_cut_nor_of_a_fixed_bid() -> None:
    b = busy_book()
    dl = order(b, "dl", 0.5, ceiling=1.0)
    fixed = order(b, "fixed", 0.5)
    b.add(dl)
    b.add(fixed)
    with pytest.raises(ValueError, match="ceiling"):
        b.rebid(dl, 1.01)
    with pytest.raises(ValueError, match="ceiling"):
        b.rebid(dl, 0.4)
    with pytest.raises(ValueError, match="fixed bid"):
        b.rebid(fixed, 0.6)
    assert dl.bid == 0.5 and ids(b) == ["dl", "fixed"]  # nothing changed
    assert b.rebid(dl, 1.0)  # the ceiling itself
    assert b.rebid(dl, 1.0)  # the same bid again: still waiting, nothing to do
    assert dl.bid == 1.0
    b.check()
    with pytest.raises(ValueError):
        check_raise(dl, 1.5)


def test_a_raise_that_reaches_a_free_slot_is_admitted_at_once() -> None:
    b = book(("cheap", 0.1, 1), ("dear", 1.0, 1))
    b.add(order(b, "running", 0.5))
    [first] = b.dispatch(0.0)
    assert first.deployment == "cheap"
    dl = order(b, "dl", 0.5, ceiling=3.0)
    b.add(dl)
    assert b.dispatch(0.0) == []  # 'dear' is free, above its bid
    assert b.rebid(dl, 1.0)
    [adm] = b.dispatch(0.0)
    assert adm.order is dl and adm.deployment == "dear" and adm.price == 1.0  # the floor
    # admitted: a raise comes too late and changes nothing (it cleared at 1.0)
    assert not b.rebid(dl, 3.0)
    assert dl.bid == 1.0
    b.check()


def test_an_order_not_in_the_book_is_not_raised() -> None:
    b = busy_book()
    dl = order(b, "dl", 0.5, ceiling=1.0)
    assert not b.rebid(dl, 0.8)
    assert dl.bid == 0.5 and b.waiting == 0


# -- raises among random arrivals, cancels, timeouts, releases and requeues ---------------

ops_raise = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(BID_CHOICES), st.floats(0.5, 20.0)),
        st.tuples(st.just("deadline"), st.sampled_from(BID_CHOICES), st.floats(0.5, 20.0)),
        st.tuples(st.just("raise"), st.integers(0, 50), st.sampled_from(BID_CHOICES)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0.0)),
        st.tuples(st.just("tick"), st.just(0), st.floats(0.0, 6.0)),
        st.tuples(st.just("release"), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("requeue"), st.integers(0, 50), st.just(0.0)),
    ),
    min_size=30,
    max_size=200,
)


class _RaiseRun(_Run):
    """The random sequences of ``test_book`` with deadline orders (the lowest bid, up
    to a ceiling) and their raises."""

    def arrive_deadline(self, arg: float | int, extra: float | bool) -> None:
        b = self.b
        o = Order(
            id=str(b._seq), bid=min(BID_CHOICES), seq=b.next_seq(), arrived_at=self.now, ceiling=float(arg)
        )
        self.deadline[o.seq] = self.now + float(extra)
        b.add(o)

    def raise_bid(self, arg: float | int, extra: float | bool) -> None:
        b = self.b
        raisable = [w for w in b.waiting_orders() if w.ceiling is not None]
        if not raisable:
            return
        o = raisable[int(arg) % len(raisable)]
        assert o.ceiling is not None
        new = min(o.ceiling, max(o.bid, float(extra)))
        seq = o.seq
        assert b.rebid(o, new)
        assert o.bid == new and o.seq == seq
        # ranked at its new bid: exactly the better bids, and the equal ones that came earlier, are ahead
        assert b.position(o) == sum(1 for w in b.waiting_orders() if (-w.bid, w.seq) < (-o.bid, o.seq))


@settings(max_examples=300, deadline=None)
@given(deployments_st, ops_raise)
def test_random_sequences_with_raises_keep_every_book_rule(
    deps: list[tuple[float, int]], seq: list[tuple[str, float | int, float | bool]]
) -> None:
    run = _RaiseRun(deps)
    ops = {"arrive": run.arrive, "deadline": run.arrive_deadline, "raise": run.raise_bid, "cancel": run.cancel,
           "tick": run.tick, "release": run.release, "requeue": run.requeue}  # fmt: skip
    for op, arg, extra in seq:
        ops[op](arg, extra)
        run.dispatch()
        run.check()
