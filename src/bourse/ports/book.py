"""The book port: where one product's orders wait and its slots are given out.

Two adapters implement it:

- :class:`bourse.coordination.book_local.LocalBook` — the in-process book of one gateway
  (the embedded default);
- :class:`bourse.coordination.book_redis.RedisBook` — one book shared by every replica
  through Redis (``[cluster] redis_url``).

The contract (``tests/contract/test_book.py`` runs it over both):

- :meth:`submit` rests an order (ranked by bid, then arrival) and clears the book;
  the returned future is already done when the order was admitted at once.
  :class:`~bourse.domain.book.BookFull` when the book holds its maximum.
- :meth:`wait` awaits the admission until ``deadline`` (loop time), then raises
  :class:`TimeoutError` with the order taken out of the book.
- Every slot given is given back exactly once: :meth:`release`, :meth:`requeue`,
  or :meth:`withdraw` (client gone; gives back a slot granted at that instant).
- :meth:`requeue` (the engine failed before any output) gives the slot back and rests
  the order again with its arrival kept, in one step; it and :meth:`report_failure` of
  an order count a failure on the deployment's breaker once per request and
  deployment (:func:`~bourse.domain.book.counts_against`).
- :meth:`attempt_failed`: the admission's run ended before any output (its engine
  failed or did not answer in time; requeued or not): its clear is marked ``failed``
  in the view's ``recent``. Nobody paid it: it is a failed attempt, not a clear.
- :meth:`rebid` raises a waiting deadline order's bid (never lowers it, never above
  its ceiling: :func:`~bourse.domain.book.check_raise`): it is ranked again at its new
  price with its arrival kept (equal bids: arrival order stands) and the book is
  cleared; False if it was not waiting (admitted at its old bid, or gone). An order
  admitted at the same moment on another replica is admitted once, at the bid the
  book had when it cleared.
- The client is asked at admission (:meth:`~bourse.domain.book.Order.still_wanted`):
  an order whose client has left is not admitted; its wait raises :class:`ClientGone`
  and the slot goes to the next order.
- :meth:`level`, :meth:`position` and :meth:`pace` are cheap and may be a second
  stale; :meth:`standing` (progress frames) and :meth:`view` (market views) are exact.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from bourse.domain.book import Admission, Deployment, Order
from bourse.domain.forecast_score import Score
from bourse.domain.values import immutable


class BookUnavailable(Exception):
    """The shared book cannot be reached (Redis down); the request gets a 503."""


class ClientGone(Exception):
    """The order's client had left when a slot came to it: not admitted (nothing started)."""


@immutable
class Pace:
    """The recent admissions of a book: ``count`` of them over the last ``span_s``
    seconds (from the oldest of them to now), for wait estimates."""

    count: int
    span_s: float


@dataclass(slots=True)
class DeploymentView:
    name: str
    floor: float
    slots: int
    busy: int
    healthy: bool
    breaker: str
    available: bool = True
    """Its probes pass (:mod:`bourse.domain.availability`); false: it takes no order."""
    reason: str | None = None
    """Why it is unavailable (one line), else None."""
    flavor: str | None = None
    """The kind of server an ``openai`` deployment fronts (probed or configured), else None."""


@dataclass(slots=True)
class Clear:
    """A record of one admission, for the market view."""

    at: float
    """Wall-clock seconds (time.time())."""
    price: float
    bid: float
    deployment: str
    waited_s: float | None = None
    """How long the order waited in the book (``None`` when the adapter does not know)."""
    order_id: str = ""
    attempt: int = 0
    """The order and its attempt (its requeues then) the clear admitted ("" and 0 when
    the adapter does not know, as in a shared book's entries written before)."""
    failed: bool = False
    """The admission's run ended before any output (:meth:`BookPort.attempt_failed`):
    a failed attempt, which nobody paid; it does not count as cleared."""


@dataclass(slots=True)
class BookView:
    level: float
    waiting: int
    best_bid: float | None
    admitted_total: int
    deployments: list[DeploymentView]
    bids: list[float] = field(default_factory=list)
    """The waiting bids, best first (capped by the adapter)."""
    recent: list[Clear] = field(default_factory=list)
    """The last admissions, newest first, failed attempts among them (marked ``failed``):
    :func:`cleared` gives the ones that count as cleared."""
    parked: int = 0
    """Waiting orders of a replica gone silent (shared book): kept in their place,
    admitted to nobody until it speaks again; not counted in ``waiting``."""
    forecast: Score | None = None
    """How well this replica's wait forecast did lately (set by the market, not the book)."""
    running: list[tuple[str, str, int | None]] | None = None
    """(order id, deployment, output cap or None) of each order holding a slot, every
    replica's (the shared book's; None from a book in process, which knows its own
    exactly, and from a book that does not say)."""


def cleared(recent: list[Clear]) -> list[Clear]:
    """The admissions of ``recent`` that count as cleared: every one but the failed attempts."""
    return [c for c in recent if not c.failed]


class BookPort(Protocol):
    product: str
    min_floor: float
    max_waiting: int

    def new_order(self, order_id: str, bid: float) -> Order: ...

    async def submit(self, order: Order) -> asyncio.Future[Admission]: ...

    async def wait(self, order: Order, fut: asyncio.Future[Admission], deadline: float) -> Admission: ...

    async def rebid(self, order: Order, bid: float) -> bool: ...

    def withdraw(self, order: Order, fut: asyncio.Future[Admission]) -> None: ...

    def release(self, admission: Admission) -> None: ...

    async def requeue(self, order: Order, admission: Admission) -> asyncio.Future[Admission]: ...

    def report_success(self, deployment: str) -> None: ...

    def attempt_failed(self, admission: Admission) -> None:
        """``admission``'s run ended before any output: its clear is a failed attempt
        (call it before a :meth:`requeue` of the order)."""
        ...

    def report_failure(self, deployment: str, order: Order | None = None) -> None: ...

    def deployment_changed(self, deployment: str) -> None:
        """A deployment's availability or slots changed (its probes): clear the book
        again, and in a shared book tell the other replicas (an unavailable deployment
        is held out for its ``availability.hold_s``, renewed by each call)."""
        ...

    def add_deployment(self, deployment: Deployment) -> None:
        """A deployment from now on (a name new to the book, or one retired whose
        running orders have not all finished: their slots count against it)."""
        ...

    def retire_deployment(self, deployment: str, *, replacing: bool = False) -> None:
        """No order goes to ``deployment`` from now on; the ones running there finish.
        ValueError for the last deployment, unless ``replacing`` (one of that name is
        added at once)."""
        ...

    def waiting_here(self) -> int:
        """Orders of this replica waiting in the book."""
        ...

    def held_on(self, deployment: str) -> int:
        """Slots this replica holds on ``deployment`` now (its engine may close at 0)."""
        ...

    def level(self) -> float: ...

    def position(self, order: Order) -> int: ...

    def pace(self) -> Pace: ...

    def occupancy(self) -> dict[str, int] | None:
        """Slots in use per deployment, exactly and now (the book in process); None
        when only a view can say (the shared book: :meth:`view`)."""
        ...

    async def standing(self, order: Order | None) -> tuple[float, int]: ...

    def healthy(self) -> bool: ...

    async def view(self) -> BookView: ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...
