"""The live book of one product: a :class:`~bourse.domain.book.ProductBook` with
futures, timers and engines around it.

Admission is two steps so a streaming request can answer 200 the moment its order
rests in the book: :meth:`Market.submit` (synchronous; may admit at once) and
:meth:`Market.wait` (await the slot, bounded by the order's deadline). Every slot
given is given back exactly once through :meth:`release` or :meth:`requeue`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from bourse.domain.book import Admission, BookFull, Order, ProductBook
from bourse.domain.errors import GatewayError, book_timeout, no_capacity
from bourse.domain.policy import Policy
from bourse.ports.engine import Engine, TokenCounter


@dataclass(slots=True)
class Clear:
    """A record of one admission, for the market view."""

    at: float
    price: float
    bid: float
    deployment: str


class Market:
    """One product: its book, its deployments' engines, and the orders' futures."""

    def __init__(
        self,
        product: str,
        book: ProductBook,
        engines: dict[str, Engine],
        policy: Policy,
        *,
        default_bid: float,
        context_length: int,
        max_output_tokens: int,
        supports_tools: bool,
        description: str | None = None,
    ) -> None:
        self.product = product
        self.book = book
        self.engines = engines
        self.policy = policy
        self.default_bid = default_bid
        self.context_length = context_length
        self.max_output_tokens = max_output_tokens
        self.supports_tools = supports_tools
        self.description = description
        self._futures: dict[Order, asyncio.Future[Admission]] = {}
        self._wakeup: asyncio.TimerHandle | None = None
        self.recent: deque[Clear] = deque(maxlen=32)
        self.admitted_total = 0

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    # -- admission ---------------------------------------------------------------

    def new_order(self, order_id: str, bid: float) -> Order:
        return Order(id=order_id, bid=bid, seq=self.book.next_seq(), arrived_at=self.now())

    def submit(self, order: Order) -> asyncio.Future[Admission]:
        """Rest ``order`` in the book and run a clear; the future is done if admitted at once."""
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        try:
            pos = self.book.add(order)
        except BookFull:
            raise no_capacity(
                f"The book of '{self.product}' holds its maximum of {self.book.max_waiting} waiting orders; "
                "retry later or bid higher.",
                retry_after_s=2,
            ) from None
        if order.requeues == 0:
            order.position_at_entry = pos
        self._futures[order] = fut
        self._dispatch()
        return fut

    async def wait(self, order: Order, fut: asyncio.Future[Admission], deadline: float) -> Admission:
        """The order's admission; 408 ``book_timeout`` at ``deadline`` (loop time)."""
        if fut.done():
            return fut.result()
        try:
            async with asyncio.timeout_at(deadline):
                return await fut
        except TimeoutError:
            self._futures.pop(order, None)
            if self.book.remove(order):
                self._dispatch()
                raise book_timeout(self.now() - order.arrived_at) from None
            if fut.done() and not fut.cancelled():  # admitted at the deadline
                return fut.result()
            raise book_timeout(self.now() - order.arrived_at) from None
        except asyncio.CancelledError:
            self.withdraw(order, fut)
            raise

    def withdraw(self, order: Order, fut: asyncio.Future[Admission]) -> None:
        """The order's client left: take it out of the book, or give back its slot."""
        self._futures.pop(order, None)
        if self.book.remove(order):
            self._dispatch()
        elif fut.done() and not fut.cancelled():
            self.release(fut.result())

    def release(self, admission: Admission) -> None:
        """Give the admission's slot back and clear the book."""
        self.book.release(admission.deployment)
        self._dispatch()

    def requeue(self, order: Order, admission: Admission) -> asyncio.Future[Admission]:
        """The engine failed before any output: cool the deployment, give the slot
        back and put the order in the book again with its original arrival."""
        self.book.report_failure(admission.deployment, self.now())
        self.book.release(admission.deployment)
        order.avoid = admission.deployment
        order.requeues += 1
        return self.submit(order)

    def report_success(self, deployment: str) -> None:
        self.book.report_success(deployment)

    def report_failure(self, deployment: str) -> None:
        self.book.report_failure(deployment, self.now())

    def _dispatch(self) -> None:
        now = self.now()
        again = True
        while again:
            again = False
            for adm in self.book.dispatch(now):
                fut = self._futures.pop(adm.order, None)
                if fut is None or fut.done():
                    # the waiter is gone (cancelled at this instant): the slot goes back
                    self.book.release(adm.deployment)
                    again = True
                    continue
                fut.set_result(adm)
                self.admitted_total += 1
                self.recent.append(Clear(now, adm.price, adm.order.bid, adm.deployment))
        if self.book.waiting and self._wakeup is None:
            at = self.book.next_recovery(now)
            if at is not None:
                self._wakeup = asyncio.get_running_loop().call_at(at + 0.001, self._on_wakeup)

    def _on_wakeup(self) -> None:
        self._wakeup = None
        self._dispatch()

    # -- views -------------------------------------------------------------------

    def level(self) -> float:
        return self.book.level(self.now())

    def position(self, order: Order) -> int:
        return self.book.position(order)

    def healthy(self) -> bool:
        return self.broken_reason() is None and self.book.healthy(self.now())

    def broken_reason(self) -> str | None:
        """Why no deployment of this product can run at all (e.g. its model failed to load)."""
        reasons = [getattr(e, "broken", None) for e in self.engines.values()]
        if reasons and all(reasons):
            return "; ".join(str(r) for r in reasons)
        return None

    def token_counter(self) -> TokenCounter | None:
        for e in self.engines.values():
            if hasattr(e, "count_prompt_tokens") and getattr(e, "loaded", False):
                return e  # type: ignore[return-value]
        return None

    def failure_after_requeues(self, last: str) -> GatewayError:
        if not self.healthy():
            return no_capacity(
                f"No healthy deployment of '{self.product}' is available (last error: {last}); retry later."
            )
        return GatewayError(
            502,
            "upstream_error",
            f"The engine failed before producing output on every attempt (last error: {last}).",
        )

    def close(self) -> None:
        if self._wakeup is not None:
            self._wakeup.cancel()
            self._wakeup = None
