"""The order book of one product: price priority, slots, clearing (SPEC section 10).

Pure and synchronous: no I/O, no clock of its own (callers pass ``now`` in seconds).

- Orders rank by bid (highest first), then by arrival sequence (earliest first). A
  requeued order keeps its sequence number, so it keeps its place. A deadline order's
  bid may be raised while it waits (:meth:`ProductBook.rebid`): it is ranked again at
  its new price with its sequence number kept, so among equal bids arrival stands.
- Each deployment has a ``floor`` and ``slots``; an order is eligible for a
  deployment whose floor is at or below its bid, that is available (its probes pass:
  :mod:`bourse.domain.availability`) and that is not cooling down.
- :meth:`ProductBook.dispatch` gives free slots to the best eligible orders: the best
  order goes to the cheapest eligible free deployment (ties: fewest busy slots), a
  deployment the order failed on last is avoided while another is free.
- The cleared price is ``max(floor, best bid still waiting)``, never above the bid
  (a second-price rule). The level is the lowest free floor when a slot is free,
  else the best bid waiting.

Because eligibility depends only on the floor, if the best waiting order fits no free
slot, no worse order does either: dispatch stops at the first order it cannot place,
and no slot stays idle while an eligible order waits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sortedcontainers import SortedKeyList

from bourse.domain.availability import Availability
from bourse.domain.breaker import CircuitBreaker
from bourse.domain.values import immutable


@dataclass(slots=True, eq=False)
class Order:
    """One request waiting for, or holding, a slot."""

    id: str
    bid: float
    """USD per million tokens."""
    seq: int
    """Arrival sequence number; kept on requeue."""
    arrived_at: float
    avoid: str | None = None
    """A deployment this order just failed on; used only when nothing else is free."""
    position_at_entry: int = 0
    """Orders ahead of it when it first entered the book (a requeue or a re-entry keeps it)."""
    requeues: int = 0
    present: Callable[[], bool] | None = None
    """Asks whether its client is still connected (None: nobody to ask, e.g. a job)."""
    failed_on: tuple[str, ...] = ()
    """The deployments whose breakers already counted a failure of this order."""
    ceiling: float | None = None
    """A deadline order's ceiling (its ``max_price``): its bid is raised as its deadline
    nears, never above this (None: a fixed bid, never raised)."""
    start_bid: float | None = None
    """The bid a deadline order entered the book at (None: a fixed bid, ``bid`` throughout)."""
    cap: int | None = None
    """Its output cap (``max_tokens``), where known: a shared book carries it to the other
    replicas' wait forecasts (how long its run will hold the slot)."""

    def rank(self) -> tuple[float, int]:
        return (-self.bid, self.seq)

    def still_wanted(self) -> bool:
        """False once its client is known to have left (asked when a slot comes to it)."""
        return self.present is None or self.present()


@dataclass(slots=True)
class Deployment:
    name: str
    floor: float
    slots: int
    busy: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    availability: Availability = field(default_factory=Availability)
    excess: int = 0
    """Slots in use above ``slots`` since they were lowered under load (:meth:`resize`):
    given back one by one, never given out again (the book's check: busy <= slots + excess)."""

    @property
    def free(self) -> int:
        return max(0, self.slots - self.busy)

    def resize(self, slots: int) -> None:
        """``slots`` from now on; the generations running above them go on (``excess``)."""
        if slots < 1:
            raise ValueError(f"deployment {self.name}: slots must be at least 1, not {slots}")
        self.slots = slots
        self.excess = max(0, self.busy - slots)

    def can_take(self, now: float) -> bool:
        """Available (probes pass) and its breaker closed, or cooled down for its one trial."""
        return self.availability.reason is None and self.breaker.available(now)


@immutable
class Admission:
    """An order given a slot on ``deployment`` at ``price`` (USD per 1M tokens)."""

    order: Order
    deployment: str
    price: float
    level: float
    """The product's level at the moment of the clear."""


def expected_wait_s(ahead: int, admissions: int, span_s: float) -> float | None:
    """The expected wait of an order with ``ahead`` orders ahead of it, from the
    recent pace (``admissions`` over the last ``span_s`` seconds): the time for
    ``ahead + 1`` admissions. None when the pace is unknown (fewer than two recent
    admissions). Orders that arrive later with a higher bid make the real wait
    longer; the market bench measures how far off it is."""
    if admissions < 2 or span_s <= 0:
        return None
    return (ahead + 1) * span_s / admissions


def counts_against(order: Order, deployment: str, breaker: CircuitBreaker) -> bool:
    """Whether a failure of ``order`` on ``deployment`` counts on its breaker: once per
    request and deployment, however many attempts the order made there (one request
    that keeps failing, say a prompt the engine cannot take, must not open the breaker
    for everyone by itself), and always when it was the half-open trial (the trial's
    verdict reopens it). Records the count on the order."""
    if deployment in order.failed_on:
        return breaker.trial_running
    order.failed_on = (*order.failed_on, deployment)
    return True


REQUEUE_BACKOFF_S = 0.05
"""The wait between an order's first failure and its requeue; it doubles with each
further requeue (0.05, 0.1, 0.2 s, ...)."""
REQUEUE_BACKOFF_MAX_S = 1.0
"""The longest wait before a requeue."""


def requeue_delay_s(requeues: int) -> float:
    """The wait before the requeue of an order requeued ``requeues`` times so far (its
    first attempt never waits): short, growing, bounded, so that a failing engine is
    not asked again within milliseconds (the market holds the order's slot meanwhile,
    so that the order keeps its place)."""
    return min(REQUEUE_BACKOFF_MAX_S, REQUEUE_BACKOFF_S * 2.0 ** min(requeues, 32))


def check_raise(order: Order, bid: float) -> None:
    """ValueError unless ``bid`` is a raise of ``order``'s bid that its ceiling allows:
    a bid in the book only ever rises, and only a deadline order's (up to its ceiling)."""
    if order.ceiling is None:
        raise ValueError(f"order {order.id} has a fixed bid; only a deadline order's bid is raised")
    if not order.bid <= bid <= order.ceiling:
        raise ValueError(
            f"order {order.id}: a new bid must be from its bid {order.bid:g} to its ceiling "
            f"{order.ceiling:g}, not {bid:g}"
        )


class BookFull(Exception):
    """The book holds its maximum number of waiting orders."""


class ProductBook:
    """The waiting orders and the slots of one product."""

    def __init__(
        self, product: str, deployments: Iterable[Deployment], *, max_waiting: int = 100_000
    ) -> None:
        self.product = product
        self.deployments: list[Deployment] = list(deployments)
        if not self.deployments:
            raise ValueError(f"product {product!r} has no deployment")
        self._by_name = {d.name: d for d in self.deployments}
        self._retired: dict[str, Deployment] = {}
        """Deployments taken out of the book whose running orders have not all finished:
        no order goes to them; each is forgotten when its last slot comes back."""
        self.max_waiting = max_waiting
        self._orders: SortedKeyList[Order, tuple[float, int]] = SortedKeyList(key=Order.rank)
        self._seq = 0
        self.min_floor = min(d.floor for d in self.deployments)

    def retuned(self) -> None:
        """A deployment's floor or slots changed: the lowest floor read again."""
        self.min_floor = min(d.floor for d in self.deployments)

    def add_deployment(self, d: Deployment) -> None:
        """A deployment from now on. Its name may be one retired with orders still
        running there: it takes their slots over (they count against its ``slots``)."""
        if any(x.name == d.name for x in self.deployments):
            raise ValueError(f"product {self.product!r} has a deployment {d.name!r} already")
        old = self._retired.pop(d.name, None)
        if old is not None:
            d.busy = old.busy
            d.excess = max(0, d.busy - d.slots)
        self.deployments.append(d)
        self._by_name[d.name] = d
        self.retuned()

    def retire_deployment(self, name: str, *, replacing: bool = False) -> Deployment:
        """Take ``name`` out: no order goes to it from now on; the ones running there
        finish (their slots come back through :meth:`release`). Not the last one, unless
        ``replacing``: a deployment of that name is added at once."""
        d = self._by_name[name]
        if d not in self.deployments:
            raise KeyError(name)
        if len(self.deployments) == 1 and not replacing:
            raise ValueError(f"product {self.product!r} keeps at least one deployment")
        self.deployments.remove(d)
        if d.busy:
            self._retired[name] = d
        else:
            del self._by_name[name]
        if self.deployments:
            self.retuned()
        return d

    # -- orders ---------------------------------------------------------------

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def add(self, order: Order) -> int:
        """Put ``order`` in the book; returns the number of orders ahead of it."""
        if len(self._orders) >= self.max_waiting:
            raise BookFull(self.product)
        self._orders.add(order)
        return self._orders.index(order)

    def remove(self, order: Order) -> bool:
        """Take ``order`` out of the book; False if it was not waiting."""
        try:
            self._orders.remove(order)
        except ValueError:
            return False
        return True

    def rebid(self, order: Order, bid: float) -> bool:
        """Raise a waiting deadline order's bid to ``bid`` (:func:`check_raise`): it is
        ranked again at its new price and keeps its sequence number, so it passes the
        lower bids and stays behind the equal bids that arrived before it. False, with
        nothing changed, if it is not waiting (admitted already: it cleared at its old
        bid). The caller dispatches after (a raise may make it eligible for a free slot)."""
        check_raise(order, bid)
        if bid == order.bid:
            return order in self._orders
        try:
            self._orders.remove(order)  # by its rank at its old bid: before the bid changes
        except ValueError:
            return False
        order.bid = bid
        self._orders.add(order)
        return True

    def position(self, order: Order) -> int:
        """Orders ahead of ``order`` (0 = next); -1 if it is not waiting."""
        try:
            return self._orders.index(order)
        except ValueError:
            return -1

    def __contains__(self, order: Order) -> bool:
        return order in self._orders

    @property
    def waiting(self) -> int:
        return len(self._orders)

    def best_bid(self) -> float | None:
        return self._orders[0].bid if self._orders else None

    def waiting_orders(self) -> list[Order]:
        return list(self._orders)

    # -- slots ----------------------------------------------------------------

    def deployment(self, name: str) -> Deployment:
        return self._by_name[name]

    def release(self, name: str) -> None:
        d = self._by_name[name]
        if d.busy <= 0:
            raise AssertionError(f"release of an idle slot on {name}")
        d.busy -= 1
        if d.excess:
            d.excess -= 1
        d.breaker.trial_running = False
        if self._retired and d.busy == 0 and self._retired.get(name) is d:
            del self._retired[name], self._by_name[name]

    def report_failure(self, name: str, now: float, order: Order | None = None) -> None:
        """A failure on ``name``; of ``order``: counted as :func:`counts_against` says. An
        unavailable deployment's failures are explained already: not counted."""
        d = self._by_name[name]
        if not d.availability.ok:
            return
        if order is None or counts_against(order, name, d.breaker):
            d.breaker.record_failure(now)

    def report_success(self, name: str) -> None:
        self._by_name[name].breaker.record_success()

    def healthy(self, now: float) -> bool:
        return any(d.can_take(now) for d in self.deployments)

    def available_floor(self, now: float) -> float | None:
        """The lowest floor among the deployments that can take an order now (None: none can)."""
        floors = [d.floor for d in self.deployments if d.can_take(now)]
        return min(floors) if floors else None

    def next_recovery(self, now: float) -> float | None:
        """When the next cooling deployment becomes available again (None if none cools)."""
        ends = [d.breaker.open_until for d in self.deployments if not d.breaker.available(now)]
        return min(ends) if ends else None

    def _free_for(self, order: Order, now: float) -> Deployment | None:
        best: Deployment | None = None
        best_key: tuple[bool, float, int] | None = None
        for d in self.deployments:
            if d.busy >= d.slots or d.floor > order.bid or not d.can_take(now):
                continue
            key = (d.name == order.avoid, d.floor, d.busy)
            if best_key is None or key < best_key:
                best, best_key = d, key
        return best

    def admit_at_once(self, order: Order, now: float) -> Admission | None:
        """``order``, arriving while no order waits, given a free slot without entering
        the book: what :meth:`add` then :meth:`dispatch` would do (its price its bid or
        the floor, none waiting behind it), without ranking it in the sorted list. None:
        it cannot be placed now (or the book takes no order at all), :meth:`add` it."""
        if self._orders or self.max_waiting <= 0:
            return None
        d = self._free_for(order, now)
        return None if d is None else self._place(order, d, 0.0, now)

    def dispatch(self, now: float) -> list[Admission]:
        """Give free slots to the best eligible waiting orders."""
        out: list[Admission] = []
        orders = self._orders
        while orders:
            order = orders[0]
            d = self._free_for(order, now)
            if d is None:
                break
            orders.pop(0)
            out.append(self._place(order, d, orders[0].bid if orders else 0.0, now))
        return out

    def _place(self, order: Order, d: Deployment, runner_up: float, now: float) -> Admission:
        """``order`` takes a slot of ``d``, at the second price: the best bid still
        waiting (``runner_up``, 0 for none) or the floor, never above its own bid."""
        d.busy += 1
        d.breaker.on_admit(now)
        return Admission(order, d.name, min(order.bid, max(d.floor, runner_up)), self.level(now))

    def level(self, now: float) -> float:
        """The price that would be next: the lowest free floor, else the best bid waiting."""
        free = [d.floor for d in self.deployments if d.busy < d.slots and d.can_take(now)]
        if free and not self._orders:
            return min(free)
        if self._orders:
            return max(self._orders[0].bid, self.min_floor)
        return self.min_floor

    def busy_on(self, name: str) -> int:
        """Slots in use on ``name`` (0 for a name this book does not know)."""
        d = self._by_name.get(name)
        return 0 if d is None else d.busy

    def busy_slots(self) -> int:
        """Slots in use, on retired deployments too."""
        return sum(d.busy for d in self._by_name.values())

    def total_slots(self) -> int:
        return sum(d.slots for d in self.deployments)

    def check(self) -> None:
        """Assert the book's invariants (used by tests and debug builds)."""
        for d in self.deployments:
            assert 0 <= d.busy <= d.slots + d.excess, (d.name, d.busy, d.slots, d.excess)
            assert d.excess == 0 or d.busy > d.slots, (d.name, d.busy, d.slots, d.excess)
        for name, d in self._retired.items():  # no order goes there; the running ones finish
            assert d.busy > 0 and self._by_name[name] is d and d not in self.deployments, name
        ranks = [o.rank() for o in self._orders]
        assert ranks == sorted(ranks)
