"""One product on the exchange: its book (a :class:`~bourse.ports.book.BookPort`),
its deployments' engines, its policy and its limits.

Admission is two steps so a streaming request can answer 200 the moment its order
rests in the book: :meth:`Market.submit` (may admit at once) and :meth:`Market.wait`
(await the slot, bounded by the order's deadline). Every slot given is given back
exactly once through :meth:`release`, :meth:`requeue` or :meth:`withdraw`. The book
is in process by default and shared across replicas with ``[cluster] redis_url``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable

from bourse.domain.book import Admission, BookFull, Deployment, Order, requeue_delay_s
from bourse.domain.breaker import CircuitBreaker, cooling_for
from bourse.domain.errors import GatewayError, book_timeout, no_capacity
from bourse.domain.market_quote import Quote
from bourse.domain.policy import Policy
from bourse.domain.values import immutable
from bourse.ports.book import BookPort, BookUnavailable, BookView
from bourse.ports.engine import Engine, Probed, TokenCounter
from bourse.ports.observer import NULL_OBSERVER, Observer
from bourse.services.deadline import raise_bids
from bourse.services.market_outlook import Outlook


@immutable
class Progress:
    """Where a waiting order stands: the level, the orders ahead of it (-1: not
    waiting) and its predicted wait in seconds (None: unknown; :mod:`bourse.domain.forecast`)."""

    level: float
    position: int
    wait_s: float | None


class Market:
    """One product: its book, its deployments' engines, and its terms."""

    def __init__(
        self,
        product: str,
        book: BookPort,
        engines: dict[str, Engine],
        policy: Policy,
        *,
        default_bid: float | None,
        context_length: int,
        max_output_tokens: int,
        supports_tools: bool,
        sim_overrides: bool,
        stall_timeout_s: float,
        description: str | None = None,
        breakers: Iterable[CircuitBreaker] = (),
        deployments: Iterable[Deployment] = (),
        observer: Observer = NULL_OBSERVER,
    ) -> None:
        self.product = product
        self.book = book
        self.engines = engines
        self._counters = [e for e in engines.values() if isinstance(e, TokenCounter)]
        self.retired_engines: dict[str, Engine] = {}
        """Engines of deployments retired while orders ran there, until closed."""
        self.policy = policy
        self._default_bid = default_bid
        """The product's ``default_bid`` as set, or None: the lowest available floor."""
        self._deployments = tuple(deployments)
        """This replica's view of each deployment: its availability (the probes) and breaker."""
        self._context_length = context_length
        self._engine_contexts: dict[str, int] = {}
        """Each deployment's engine's own context, where its probe read one."""
        self.max_output_tokens = max_output_tokens
        self.supports_tools = supports_tools
        self.description = description
        self._breakers = tuple(breakers)
        """This replica's breaker of each deployment (the ones the book reads)."""
        self.observer = observer
        self.sim_overrides = sim_overrides
        """Whether a request may carry its own ``sim`` settings (else 400)."""
        self.stall_timeout_s = stall_timeout_s
        """A generation with no token for this long is ended (the run's stall clock)."""
        self.outlook = Outlook(book, lambda: self._deployments, max_output_tokens)
        """The wait forecast, its score and the quotes (issue 38)."""

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    @property
    def min_floor(self) -> float:
        return self.book.min_floor

    @property
    def default_bid(self) -> float:
        """The bid of an order that names none: ``default_bid`` as set, else the lowest
        floor among the deployments that can take an order now (probes pass, breaker
        closed or cooled down), read when the order arrives: a dead deployment's low
        floor does not draw the orders that name no price (else the lowest floor)."""
        if self._default_bid is not None:
            return self._default_bid
        return self.available_floor()

    def available_floor(self) -> float:
        """The lowest floor among the deployments that can take an order now (else the
        lowest floor)."""
        now = self.now()
        floors = [d.floor for d in self._deployments if d.can_take(now)]
        return min(floors) if floors else self.book.min_floor

    # -- admission ---------------------------------------------------------------

    def new_order(self, order_id: str, bid: float) -> Order:
        return self.book.new_order(order_id, bid)

    async def submit(
        self, order: Order, *, deadline: float | None = None, tokens: int | None = None
    ) -> asyncio.Future[Admission]:
        """Rest ``order`` in the book and run a clear; the future is done if admitted at
        once. ``deadline`` (loop time: its book timeout) and ``tokens`` (its output cap)
        feed the wait forecast."""
        forecast = self.outlook.forecast
        forecast.entering(order, self.now(), deadline, tokens)
        if tokens is not None:
            order.cap = tokens
        try:
            fut = await self.book.submit(order)
        except BookUnavailable as exc:
            forecast.gone(order)
            raise self.unavailable(exc) from None
        except BookFull:
            forecast.gone(order)
            raise no_capacity(
                f"The book of '{self.product}' holds its maximum of {self.book.max_waiting} waiting orders; "
                "retry later or bid higher.",
                retry_after_s=2,
            ) from None
        except BaseException:
            forecast.gone(order)
            raise
        if fut.done():
            if not fut.cancelled() and fut.exception() is None:
                forecast.admitted(order, fut.result().deployment, self.now())
        else:  # a shared book's view read first unless just read: its wait is scored
            forecast.rested(order, self.now(), await self.outlook.wait_state())
        return fut

    async def wait(self, order: Order, fut: asyncio.Future[Admission], deadline: float) -> Admission:
        """The order's admission; 408 ``book_timeout`` at ``deadline`` (loop time). A
        deadline order's bid is raised meanwhile (:func:`~bourse.services.deadline.raise_bids`)."""
        raiser = None
        if order.ceiling is not None and not fut.done():
            raiser = asyncio.create_task(raise_bids(self, order, fut, deadline))
        try:
            adm = await self.book.wait(order, fut, deadline)
        except TimeoutError:
            self.outlook.forecast.gone(order, self.now())
            raise book_timeout(self.now() - order.arrived_at) from None
        except BookUnavailable as exc:
            self.outlook.forecast.gone(order, self.now())
            raise self.unavailable(exc) from None
        except BaseException:  # its client left (or the run was cancelled)
            self.outlook.forecast.gone(order, self.now(), gave_up=True)
            raise
        finally:
            if raiser is not None:
                raiser.cancel()
        self.outlook.forecast.admitted(order, adm.deployment, self.now())
        return adm

    async def rebid(self, order: Order, bid: float) -> bool:
        """Raise a waiting deadline order's bid to ``bid``: re-ranked at its new price,
        its arrival kept; False if it was not waiting (admitted at its old bid, or gone).
        The forecast ranks it again from the bid it had."""
        was = order.bid
        try:
            raised = await self.book.rebid(order, bid)
        except BookUnavailable as exc:
            raise self.unavailable(exc) from None
        if raised:
            self.outlook.forecast.rebid(order, max(order.bid, bid), was=was)
        return raised

    def withdraw(self, order: Order, fut: asyncio.Future[Admission]) -> None:
        """The order's client left: take it out of the book, or give back its slot."""
        self.outlook.forecast.gone(order, self.now(), gave_up=True)
        self.book.withdraw(order, fut)

    def release(self, admission: Admission) -> None:
        """Give the admission's slot back and clear the book."""
        self.outlook.forecast.released(admission.order.id, self.now())
        self.book.release(admission)

    async def requeue(self, order: Order, admission: Admission) -> asyncio.Future[Admission]:
        """The engine failed before any output: count the failure on the deployment's
        breaker (once per request and deployment), back off (a short wait that grows with
        each requeue, :func:`~bourse.domain.book.requeue_delay_s`), then give the slot
        back and put the order in the book again with its original arrival, in one step.
        The slot is held through the wait so that the order keeps its place (no later
        order passes it) while the engine that failed is not asked again at once."""
        self.book.report_failure(admission.deployment, order)
        self.outlook.forecast.requeued(order)
        await asyncio.sleep(requeue_delay_s(order.requeues))
        try:
            return await self.book.requeue(order, admission)
        except BookUnavailable as exc:
            raise self.unavailable(exc) from None
        except BookFull:
            raise no_capacity(
                f"The book of '{self.product}' is full; the order could not be requeued.", retry_after_s=2
            ) from None

    def unavailable(self, exc: BaseException) -> GatewayError:
        self.observer.backend_error("redis", "book", exc)
        return no_capacity(f"{exc}; retry shortly.", retry_after_s=2)

    def report_success(self, deployment: str) -> None:
        self.book.report_success(deployment)

    # -- live terms (bourse.live_terms) --------------------------------------------

    def set_default_bid(self, bid: float | None) -> None:
        """The bid of an order that names none (None: the lowest available floor)."""
        self._default_bid = bid

    def set_floor(self, deployment: str, floor: float) -> None:
        """``deployment``'s floor from now on: orders admitted after it clear against it."""
        self._deployment(deployment).floor = floor
        self.book.deployment_changed(deployment)

    def set_slots(self, deployment: str, slots: int) -> None:
        """``deployment``'s slots from now on: fewer admit nothing new until the slots in
        use fall under them (nothing running is cut); more admit waiting orders at once."""
        d = self._deployment(deployment)
        d.resize(slots)
        self.book.deployment_changed(deployment)

    def retune(
        self,
        policy: Policy,
        *,
        context_length: int,
        max_output_tokens: int,
        supports_tools: bool,
        sim_overrides: bool,
        stall_timeout_s: float,
        max_waiting: int,
        description: str | None,
    ) -> None:
        """The product's terms from now on (a request already admitted keeps the ones it
        was admitted under where it read them already)."""
        self.policy = policy
        self._context_length = context_length
        self.max_output_tokens = max_output_tokens
        self.supports_tools = supports_tools
        self.sim_overrides = sim_overrides
        self.stall_timeout_s = stall_timeout_s
        self.book.max_waiting = max_waiting
        self.description = description

    def add_deployment(self, deployment: Deployment, engine: Engine) -> None:
        """A deployment from now on, with its engine (its name not in use here)."""
        self.engines[deployment.name] = engine
        self._deployments = (*self._deployments, deployment)
        self._breakers = (*self._breakers, deployment.breaker)
        self._counters = [e for e in self.engines.values() if isinstance(e, TokenCounter)]
        self.book.add_deployment(deployment)

    def replace_deployment(self, deployment: Deployment, engine: Engine) -> Engine:
        """``deployment`` (a new build of one of the same name) and its engine from now
        on; the old engine is returned (closed by the caller once nothing runs on it):
        the orders running there finish on it, and their slots count against the new."""
        old = self._deployment(deployment.name)
        self.book.retire_deployment(deployment.name, replacing=True)
        self.book.add_deployment(deployment)
        self._deployments = tuple(deployment if x is old else x for x in self._deployments)
        self._breakers = tuple(deployment.breaker if b is old.breaker else b for b in self._breakers)
        self._engine_contexts.pop(deployment.name, None)
        previous = self.engines[deployment.name]
        self.engines[deployment.name] = engine
        self.retired_engines[deployment.name] = previous
        self._counters = [e for e in self.engines.values() if isinstance(e, TokenCounter)]
        return previous

    def retire_deployment(self, name: str) -> Engine:
        """No order goes to ``name`` from now on; its running ones finish on its engine,
        returned (the caller closes it once :meth:`held_on` says nothing runs there)."""
        d = self._deployment(name)
        self.book.retire_deployment(name)  # ValueError for the last one: nothing changed
        self._deployments = tuple(x for x in self._deployments if x is not d)
        self._breakers = tuple(b for b in self._breakers if b is not d.breaker)
        self._engine_contexts.pop(name, None)
        engine = self.engines.pop(name)
        self.retired_engines[name] = engine
        self._counters = [e for e in self.engines.values() if isinstance(e, TokenCounter)]
        return engine

    def held_on(self, deployment: str) -> int:
        """Slots this replica holds on ``deployment``."""
        return self.book.held_on(deployment)

    def engine_for(self, deployment: str) -> Engine:
        """The engine an order admitted on ``deployment`` runs on: its own, or the one it
        had when it was admitted if the deployment was retired since."""
        engine = self.engines.get(deployment)
        return self.retired_engines[deployment] if engine is None else engine

    def closed_engine(self, deployment: str, engine: Engine) -> None:
        """A retired engine was closed: forgotten."""
        if self.retired_engines.get(deployment) is engine:
            del self.retired_engines[deployment]

    @property
    def deployment_names(self) -> list[str]:
        return [d.name for d in self._deployments]

    def _deployment(self, name: str) -> Deployment:
        for d in self._deployments:
            if d.name == name:
                return d
        raise KeyError(f"{self.product} has no deployment {name!r}")

    def report_failure(self, deployment: str, order: Order | None = None) -> None:
        """A failure on ``deployment``; of ``order``: counted once per request and deployment."""
        self.book.report_failure(deployment, order)

    def attempt_failed(self, admission: Admission) -> None:
        """``admission``'s run ended before any output: a failed attempt, not a clear."""
        self.book.attempt_failed(admission)

    # -- views -------------------------------------------------------------------

    def level(self) -> float:
        return self.book.level()

    def position(self, order: Order) -> int:
        return self.book.position(order)

    async def standing(self, order: Order | None) -> tuple[float, int]:
        """The level now and the orders ahead of ``order`` (-1 if it is not waiting)."""
        return (await self._standing(order))[:2]

    async def _standing(self, order: Order | None) -> tuple[float, int, bool]:
        """:meth:`standing`, and whether the book answered."""
        try:
            level, pos = await self.book.standing(order)
            return level, pos, True
        except BookUnavailable as exc:  # the last known view, for progress frames and job status
            self.observer.backend_error("redis", "book", exc)
            return self.book.level(), -1 if order is None else self.book.position(order), False

    async def progress(self, order: Order) -> Progress:
        """The order's standing and its predicted wait at this bid (progress frames; a
        shared book unreachable: from its last view)."""
        level, pos, answered = await self._standing(order)
        return Progress(level, pos, None if pos < 0 else await self.outlook.wait(order, pos, read=answered))

    async def quote(self, within_s: float) -> Quote:
        """The lowest bid predicted to start within ``within_s`` (a prediction, not a promise)."""
        return await self.outlook.quote(within_s)

    async def bid_for(
        self, within_s: float, ceiling: float, order: Order | None = None, *, steady: bool = False
    ) -> float:
        """The bid a deadline order needs to start within ``within_s``: the quote's,
        clamped to [the lowest floor of the deployments taking orders, ``ceiling``]
        (``ceiling`` when no bid is predicted to start in time). ``order``: an order
        waiting already, priced again (it is not counted ahead of itself); ``steady``:
        the arrivals at their mean rate, the wait not stretched by the score's margin
        (:meth:`~bourse.services.market_forecast.Forecaster.quote`)."""
        return await self.outlook.bid_for(within_s, ceiling, order, steady=steady)

    async def wait_at(self, bid: float, *, steady: bool = False) -> float | None:
        """The predicted wait of a new order at ``bid`` (None: no slot predicted to come to
        it; ``steady``: with the arrivals above at their mean rate, not the newest ones')."""
        return await self.outlook.wait_at(bid, steady=steady)

    async def view(self) -> BookView:
        try:
            view = await self.book.view()
        except BookUnavailable as exc:
            raise self.unavailable(exc) from None
        for d in view.deployments:  # this replica's probes say these
            engine = self.engines.get(d.name)
            if isinstance(engine, Probed):
                d.flavor = engine.flavor
        self.outlook.seen(view)
        view.forecast = self.outlook.score()
        return view

    def unavailable_deployments(self) -> list[tuple[str, str]]:
        """(deployment, why) of each deployment that cannot serve: its probes fail, or its
        engine is broken."""
        out = []
        for d in self._deployments:
            engine = self.engines.get(d.name)
            why = d.availability.reason or (engine.broken if engine is not None else None)
            if why is not None:
                out.append((d.name, why))
        return out

    def healthy(self) -> bool:
        return self.broken_reason() is None and self.book.healthy()

    def broken_reason(self) -> str | None:
        """Why no deployment of this product can run at all (e.g. its model failed to
        load, or every one is unavailable: its probes fail). Read for every request: the
        common answer, None, is found at the first deployment that can serve."""
        engines = self.engines
        for d in self._deployments:
            if d.availability.reason is None:
                engine = engines.get(d.name)
                if engine is not None and engine.broken is None:  # not every engine is broken
                    return None
        reasons = [e.broken for e in self.engines.values()]
        if reasons and all(reasons):
            return "; ".join(str(r) for r in reasons)
        out = self.unavailable_deployments()
        if self._deployments and len(out) == len(self._deployments):
            return "; ".join(f"deployment {name} is unavailable: {why}" for name, why in out)
        return None

    def cooling(self) -> GatewayError | None:
        """503 ``no_capacity`` when every deployment's breaker is open (with ``retry-after``
        the cool-down left, rounded up), or every one is unavailable or broken (with the
        reasons), so the request need not wait; None otherwise."""
        broken = self.broken_reason()
        if broken is not None:  # e.g. the deployment just failed turned out set up wrong
            return no_capacity(f"'{self.product}' cannot serve: {broken}", retry_after_s=30)
        left = cooling_for(self._breakers, self.now())
        if left is None:
            return None
        return no_capacity(
            f"Every deployment of '{self.product}' is cooling down after failures (circuit breaker "
            f"open); retry in {left:.1f} s.",
            retry_after_s=max(1, math.ceil(left)),
        )

    @property
    def context_length(self) -> int:
        """The product's context length: as configured, or less when the engine of every
        deployment said its own (the largest of those: a prompt that fits one of them can
        be served). It bounds the pre-check and is what ``/v1/models`` lists."""
        known = self._engine_contexts
        if self.engines and len(known) == len(self.engines):
            return min(self._context_length, max(known.values()))
        return self._context_length

    def engine_bounds_output(self) -> bool:
        """Whether every deployment's engine said its own context and none is over the
        product's output limit: such an engine cannot generate past what a quote counts
        (``max_output_tokens``), so a request that names no output limit needs none sent
        (vLLM refuses a ``max_tokens`` over its ``max_model_len``, or over what its
        context leaves after the prompt, with a 400)."""
        known = self._engine_contexts
        return (
            bool(self.engines)
            and len(known) == len(self.engines)
            and max(known.values()) <= self.max_output_tokens
        )

    def engine_context(self, deployment: str, tokens: int | None) -> None:
        """What a probe read of ``deployment``'s engine's context (None: it does not say)."""
        if tokens is None or tokens <= 0:
            self._engine_contexts.pop(deployment, None)
        else:
            self._engine_contexts[deployment] = tokens

    def token_counter(self) -> TokenCounter | None:
        """An engine of this product that counts prompt tokens exactly and is loaded (an
        ``openai`` engine is a counter only with a tokenizer and its upstream's context)."""
        for e in self._counters:
            if e.loaded and e.context_length > 0:
                return e
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

    async def aclose(self) -> None:
        await self.book.aclose()
