"""The in-process adapter of the book port: a :class:`~bourse.domain.book.ProductBook`
with the waiters' futures and a wake-up timer for cooling deployments.

Everything runs on the event loop, so each clear is atomic without locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from bourse.domain.book import Admission, BookFull, Deployment, Order, ProductBook
from bourse.ports.book import BookView, Clear, ClientGone, DeploymentView, Pace


class LocalBook:
    """One product's book in this process."""

    def __init__(self, book: ProductBook) -> None:
        self.book = book
        self.product = book.product
        self.min_floor = book.min_floor
        self.max_waiting = book.max_waiting
        self._futures: dict[Order, asyncio.Future[Admission]] = {}
        self._wakeup: asyncio.TimerHandle | None = None
        self.recent: deque[Clear] = deque(maxlen=32)
        self.admitted_total = 0

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def new_order(self, order_id: str, bid: float) -> Order:
        arrived = asyncio.get_running_loop().time()  # self.now(), without its call (hot path)
        return Order(id=order_id, bid=bid, seq=self.book.next_seq(), arrived_at=arrived)

    async def submit(self, order: Order) -> asyncio.Future[Admission]:
        return self.submit_now(order)

    def submit_now(self, order: Order) -> asyncio.Future[Admission]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Admission] = loop.create_future()
        now = loop.time()
        adm = self.book.admit_at_once(order, now)  # nothing waits and a slot is free
        if adm is not None:
            if order.requeues == 0:
                order.position_at_entry = 0
            self._admit(adm, fut, now)
            return fut
        pos = self.book.add(order)  # BookFull propagates
        if order.requeues == 0:
            order.position_at_entry = pos
        self._futures[order] = fut
        self._dispatch()
        return fut

    async def wait(self, order: Order, fut: asyncio.Future[Admission], deadline: float) -> Admission:
        if fut.done():
            return fut.result()
        try:
            async with asyncio.timeout_at(deadline):
                return await fut
        except TimeoutError:
            self._futures.pop(order, None)
            if self.book.remove(order):
                self._dispatch()
                raise
            if fut.done() and not fut.cancelled():  # admitted at the deadline
                return fut.result()
            raise
        except asyncio.CancelledError:
            self.withdraw(order, fut)
            raise

    async def rebid(self, order: Order, bid: float) -> bool:
        if not self.book.rebid(order, bid):
            return False
        self._dispatch()  # a slot its old bid could not take may be its now
        return True

    def withdraw(self, order: Order, fut: asyncio.Future[Admission]) -> None:
        self._futures.pop(order, None)
        if self.book.remove(order):
            self._dispatch()
        elif fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())

    def release(self, admission: Admission) -> None:
        self.book.release(admission.deployment)
        self._dispatch()

    async def requeue(self, order: Order, admission: Admission) -> asyncio.Future[Admission]:
        self.book.report_failure(admission.deployment, self.now(), order)
        self.book.release(admission.deployment)
        order.avoid = admission.deployment
        order.requeues += 1
        try:
            return self.submit_now(order)
        except BookFull:
            self._dispatch()  # the slot it gave back goes to the orders waiting
            raise

    def report_success(self, deployment: str) -> None:
        self.book.report_success(deployment)

    def report_failure(self, deployment: str, order: Order | None = None) -> None:
        self.book.report_failure(deployment, self.now(), order)

    def attempt_failed(self, admission: Admission) -> None:
        oid, attempt = admission.order.id, admission.order.requeues
        for clear in reversed(self.recent):  # newest first: it was admitted lately
            if clear.order_id == oid and clear.attempt == attempt:
                clear.failed = True
                return

    def add_deployment(self, deployment: Deployment) -> None:
        self.book.add_deployment(deployment)
        self.min_floor = self.book.min_floor
        self._dispatch()

    def retire_deployment(self, deployment: str, *, replacing: bool = False) -> None:
        self.book.retire_deployment(deployment, replacing=replacing)
        self.min_floor = self.book.min_floor

    def waiting_here(self) -> int:
        return self.book.waiting

    def held_on(self, deployment: str) -> int:
        return self.book.busy_on(deployment)

    def deployment_changed(self, deployment: str) -> None:
        self.book.retuned()  # its floor may have changed
        self.min_floor = self.book.min_floor
        self._dispatch()  # back, or given more slots: orders waiting may go now

    def _dispatch(self) -> None:
        now = asyncio.get_running_loop().time()  # self.now(), without its call (twice per request)
        again = True
        while again:
            again = False
            for adm in self.book.dispatch(now):
                if not self._admit(adm, self._futures.pop(adm.order, None), now):
                    again = True
        if self.book.waiting and self._wakeup is None:
            at = self.book.next_recovery(now)
            if at is not None:
                self._wakeup = asyncio.get_running_loop().call_at(at + 0.001, self._on_wakeup)

    def _admit(self, adm: Admission, fut: asyncio.Future[Admission] | None, now: float) -> bool:
        """Give ``adm`` to its waiter; False if the waiter is gone (cancelled at this
        instant, or its client left unseen by the loop yet): the slot goes back, to the
        next order (the caller dispatches again)."""
        order = adm.order
        if fut is None or fut.done() or not order.still_wanted():
            self.book.release(adm.deployment)
            if fut is not None and not fut.done():
                fut.set_exception(ClientGone(order.id))
            return False
        fut.set_result(adm)
        self.admitted_total += 1
        self.recent.append(
            Clear(
                time.time(),
                adm.price,
                order.bid,
                adm.deployment,
                max(0.0, now - order.arrived_at),
                order.id,
                order.requeues,
            )
        )
        return True

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._dispatch()

    def level(self) -> float:
        return self.book.level(self.now())

    def position(self, order: Order) -> int:
        return self.book.position(order)

    def pace(self) -> Pace:
        if not self.recent:
            return Pace(0, 0.0)
        return Pace(len(self.recent), max(0.0, time.time() - self.recent[0].at))

    def occupancy(self) -> dict[str, int]:
        return {d.name: d.busy for d in self.book.deployments}

    async def standing(self, order: Order | None) -> tuple[float, int]:
        return self.level(), -1 if order is None else self.book.position(order)

    def healthy(self) -> bool:
        return self.book.healthy(self.now())

    async def view(self) -> BookView:
        now = self.now()
        b = self.book
        return BookView(
            level=b.level(now),
            waiting=b.waiting,
            best_bid=b.best_bid(),
            admitted_total=self.admitted_total,
            deployments=[self._deployment_view(d, now) for d in b.deployments],
            bids=[o.bid for o in b.waiting_orders()],
            recent=list(reversed(self.recent)),
        )

    @staticmethod
    def _deployment_view(d: Deployment, now: float) -> DeploymentView:
        return DeploymentView(
            d.name, d.floor, d.slots, d.busy, d.breaker.available(now), d.breaker.state,
            d.availability.ok, d.availability.reason,
        )  # fmt: skip

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
