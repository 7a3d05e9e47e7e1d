"""One request's run: admission, the engine attempts, metering, the outcome.

:class:`CompletionService` checks a validated request against its product
(:meth:`~CompletionService.prepare`, no I/O), then rate-limits, quotes, holds and
books it (:meth:`~CompletionService.open`), which returns a :class:`Run`.
:meth:`Run.events` is the single async iterator the HTTP relay and the jobs
consume, for streamed and non-streamed answers alike::

    Queued -> (engine chunks ... | Requeued -> ...) -> Finished

Chunks are the engine's own dicts with ``id``, ``model``, ``created`` (one value
per response: the request's arrival) and the reasoning field rewritten in place; nothing is copied or buffered. Every run ends in exactly one
:class:`Finished` (or in an abandonment when its consumer stops), and every slot it
took is given back exactly once. Only the run writes its own state: its consumers
read ``phase``, ``tokens`` and ``order``, and tell it that the client left with
:meth:`Run.client_gone`. A draining gateway stops a run with :meth:`Run.interrupt`:
it ends with the drain's error (settled by its policy), or, a detached job's run,
raises :class:`HandedBack` unsettled, for the jobs to give back. The money is
:class:`~bourse.services.billing.Billing`'s, handed plain values: the run's
:class:`~bourse.services.billing.Quote` before the book, its
:class:`~bourse.services.billing.Closing` after the outcome.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping
from enum import IntEnum
from typing import Any, TypeVar

from bourse.domain.book import Admission, Order
from bourse.domain.charging import Outcome, RecordedOutcome
from bourse.domain.errors import GatewayError, draining, invalid_request, model_not_found
from bourse.domain.policy import Policy
from bourse.domain.ratelimit import retry_after_header
from bourse.domain.values import immutable
from bourse.ports.book import ClientGone
from bourse.ports.engine import (
    ChunkEvent,
    EngineEvent,
    EngineFailure,
    GenerationRequest,
    Kind,
    TokenCounter,
    UsageEvent,
)
from bourse.ports.limits import KeyLimits, LimiterUnavailable, RateLimiter
from bourse.ports.observer import NULL_OBSERVER, NULL_SPAN, Caller, Observer, RunReport, Span
from bourse.services.auth import Authenticator, Principal
from bourse.services.billing import ENDPOINTS, Billing, Closing, Quote, quote_for
from bourse.services.market import Market
from bourse.wire.prompt import PromptSize, measure_prompt
from bourse.wire.requests import GATEWAY_FIELDS, ChatCompletionRequest, CompletionRequest, bounded_header

log = logging.getLogger("bourse.completion")

T = TypeVar("T")


class Phase(IntEnum):
    """Where a run is; only ever goes forward, except ADMITTED -> QUEUED on a requeue."""

    NEW = 0
    """Built, not yet in the book."""
    QUEUED = 1
    ADMITTED = 2
    """Holds a slot; no output yet."""
    STREAMING = 3
    """The engine's first chunk arrived."""
    DONE = 4
    """Finished or abandoned; its settlement is under way or done."""


@immutable
class Queued:
    bid: float


@immutable
class Requeued:
    deployment: str


@immutable
class Finished:
    """The end of a run, settled: the error (None when completed), usage and receipt."""

    outcome: RecordedOutcome
    error: GatewayError | None
    usage: dict[str, Any]
    receipt: dict[str, Any]
    text_tokens: int = 0
    """Completion tokens the gateway relayed (its own count)."""
    cost_micros: int = 0


RunEvent = ChunkEvent | Queued | Requeued | Finished
SettledHook = Callable[[Closing, Finished], None]
"""Called once per run after its settlement (the usage record is written); must not block."""


class HandedBack(Exception):
    """A detached job's run stopped by a draining gateway, neither finished nor settled:
    its slot is back; its hold is the consumer's to give back
    (:meth:`CompletionService.give_back`)."""


@immutable
class Limits:
    book_timeout_s: float = 300.0
    book_timeout_max_s: float = 3600.0


@immutable
class Ask:
    """A request checked against its product: what its run will ask the book and the engine."""

    market: Market
    kind: Kind
    body: dict[str, Any]
    """The engine's body: gateway fields removed, ``stream`` and ``include_usage`` on."""
    bid: float
    timeout_s: float
    stream: bool
    include_usage: bool
    """The client gets a usage chunk (asked for, or policy ``usage_chunk = always``)."""
    max_output_tokens: int


@immutable
class Grant:
    """What the rate limiter granted a run: given back with the tokens used when it ends."""

    key_id: str
    limits: KeyLimits
    tokens: int
    headers: dict[str, str]


class CompletionService:
    """Opens runs: product checks, rate limits, the hold, the book."""

    def __init__(
        self,
        markets: Mapping[str, Market],
        limits: Limits,
        models: Mapping[str, str],
        *,
        billing: Billing,
        limiter: RateLimiter,
        auth: Authenticator,
        observer: Observer = NULL_OBSERVER,
    ) -> None:
        self.markets = markets
        self.limits = limits
        self.models = models
        """deployment name -> the engine's internal model name"""
        self.billing = billing
        self.limiter = limiter
        self.auth = auth
        self.observer = observer
        self.background: set[asyncio.Task[Any]] = set()
        self.on_settled: list[SettledHook] = []
        """Listeners of settled runs (the dashboard's live tail)."""
        self.live: set[Run] = set()
        """The runs booked and not yet ended."""
        self.draining = False
        """The gateway is shutting down: no new run opens (503 ``draining``)."""

    async def open(
        self,
        kind: Kind,
        body: dict[str, Any],
        req: ChatCompletionRequest | CompletionRequest,
        principal: Principal,
        *,
        request_id: str,
        max_price_header: str | None = None,
        timeout_header: str | None = None,
        t0: float | None = None,
        engine_stream: bool = True,
        fail_fast: bool = True,
        caller: Caller | None = None,
        present: Callable[[], bool] | None = None,
    ) -> Run:
        """validate -> (authenticated) -> rate-limit -> quote -> hold -> book.

        ``engine_stream`` False: the engine may produce the answer at once (a relayed
        non-streamed request); jobs keep the stream, so that their progress and a
        cancel's charge count the tokens as they come. ``fail_fast`` False: the run waits
        out open breakers in the book (a resumed job) rather than get 503 at once.
        ``caller``: the HTTP request (None: a job's run). ``present`` asks whether the
        client is still connected: a slot that comes to an order whose client left is
        given to the next order, and no engine starts for it."""
        if self.draining:
            raise draining()
        t0 = time.perf_counter() if t0 is None else t0
        ask = self.prepare(kind, body, req, max_price_header=max_price_header, timeout_header=timeout_header)
        request_id = ask.market.policy.request_id(request_id)
        self.auth.check_product(principal, ask.market.product)
        prompt = measure_prompt(body)
        await self._check_fits(ask, prompt, fail_fast)
        quote = quote_for(prompt, ask.max_output_tokens, ask.bid)
        grant = await self._acquire(principal, quote.tokens)
        account_id = principal.key.account_id
        try:
            hold_id = await self.billing.hold(
                quote,
                account_id=account_id,
                request_id=request_id,
                product=ask.market.product,
                key=principal.key,
            )
        except BaseException:
            await self._limits_done(grant, 0)
            raise
        run = Run(
            self,
            ask,
            request_id,
            t0,
            prompt,
            quote,
            account_id,
            hold_id,
            grant,
            engine_stream,
            caller,
        )
        run.present = present
        try:
            await run.submit()
        except BaseException:  # the order never entered the book
            await self.billing.release(hold_id)
            await self._limits_done(grant, 0)
            raise
        self.live.add(run)
        return run

    async def give_back(self, run: Run) -> None:
        """A run handed back undone (:class:`HandedBack`): its hold released without a
        usage record, its rate-limit reservation returned."""
        try:
            await self.billing.release(run.hold_id)
        finally:
            await self._limits_done(run.grant, 0)

    async def _check_fits(self, ask: Ask, prompt: PromptSize, fail_fast: bool = True) -> None:
        """503 if no deployment can run (``fail_fast``: or none before its cool-down
        ends); 400 if the prompt cannot fit the context."""
        market = ask.market
        broken = market.broken_reason()
        if broken is not None:
            raise GatewayError(
                503,
                "no_capacity",
                f"'{market.product}' cannot serve: {broken}",
                headers={"retry-after": "30"},
            )
        cooling = market.cooling() if fail_fast else None
        if cooling is not None:  # no deployment can be tried before its cool-down ends
            raise cooling
        param = "messages" if ask.kind == "chat" else "prompt"
        counter = market.token_counter()
        n = None if counter is None else await counter.count_prompt_tokens(ask.kind, ask.body)
        if counter is not None and n is not None:  # the engine's own tokenizer and context: exact
            if n >= counter.context_length:
                raise GatewayError(
                    400,
                    "context_length_exceeded",
                    f"The prompt is {n} tokens; '{market.product}' has a context of {counter.context_length} "
                    "tokens and needs room for at least one generated token. Shorten the prompt.",
                    param=param,
                )
            return
        # no count (no counter, or one that cannot tell for this engine): the byte bound
        at_least = prompt.bytes // 8  # no common tokenizer averages more than 8 bytes a token
        if at_least > market.context_length:  # the engine enforces its own limit; refuse only what cannot fit
            raise GatewayError(
                400,
                "context_length_exceeded",
                f"The prompt is at least {at_least} tokens ({prompt.bytes} bytes); '{market.product}' has a "
                f"context of {market.context_length} tokens. Shorten the prompt.",
                param=param,
            )

    async def _acquire(self, principal: Principal, tokens: int) -> Grant:
        key_id, limits = principal.key.id, principal.limits
        try:
            decision = await self.limiter.acquire(key_id, limits, tokens)
        except LimiterUnavailable as exc:
            self.observer.backend_error("redis", "limits", exc)
            raise GatewayError(
                503, "no_capacity", f"{exc}; retry shortly.", headers={"retry-after": "2"}
            ) from None
        if not decision.allowed:
            raise GatewayError(
                429,
                "rate_limited",
                f"Rate limited: {decision.reason}; retry in {decision.retry_after_s:.1f} s.",
                headers={"retry-after": retry_after_header(decision.retry_after_s), **decision.headers},
            )
        return Grant(key_id, limits, tokens, decision.headers)

    async def _limits_done(self, grant: Grant, used: int) -> None:
        try:
            await self.limiter.finish(grant.key_id, grant.limits, grant.tokens, used)
        except LimiterUnavailable as exc:  # the limiter repairs its count when it can
            self.observer.backend_error("redis", "limits", exc)
            log.warning("rate limits of key %s not updated: %s", grant.key_id, exc)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A background task the service keeps until it ends (shutdown waits for them)."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def settle(
        self,
        closing: Closing,
        error: GatewayError | None,
        grant: Grant,
        text_tokens: int,
        run: Run | None = None,
    ) -> Finished:
        """Settlement and limiter bookkeeping, detached from the client's connection;
        the run (when given) then reports its end to the observer."""
        observer = self.observer
        span: Span = NULL_SPAN
        if run is None or run.span is not NULL_SPAN:  # a run not traced has no child spans
            span = observer.start_span("bourse.settle", None if run is None else run.span)
        try:
            s = await self.billing.settle(closing)
        finally:
            await self._limits_done(grant, int(closing.usage.get("total_tokens") or 0))
            if span is not NULL_SPAN:
                span.end()
        fin = Finished(s.outcome, error, s.usage, s.receipt, text_tokens, s.cost_micros)
        if run is not None:
            run.report(fin, closing)
        for hook in self.on_settled:
            try:
                hook(closing, fin)
            except Exception:  # a listener's failure never touches the money
                log.exception("an on_settled listener failed for %s", closing.request_id)
        return fin

    def market(self, model: str) -> Market:
        m = self.markets.get(model)
        if m is None:
            raise model_not_found(model)
        return m

    def prepare(
        self,
        kind: Kind,
        body: dict[str, Any],
        req: ChatCompletionRequest | CompletionRequest,
        *,
        max_price_header: str | None = None,
        timeout_header: str | None = None,
    ) -> Ask:
        """Check the request against its product (no I/O): the bid, the timeout, tools, the output budget."""
        market = self.market(req.model)
        if req.sim is not None and not market.sim_overrides:
            raise invalid_request(
                f"sim: the product '{req.model}' does not take per-request simulator settings "
                "(its operator has sim_overrides off).",
                param="sim",
            )
        bid = _header_number(max_price_header, "X-Max-Price") if req.max_price is None else req.max_price
        if bid is None:
            bid = market.default_bid
        if bid < market.min_floor:
            raise invalid_request(
                f"max_price: {bid:g} USD per 1M tokens is below the lowest floor of '{req.model}' "
                f"({market.min_floor:g}); no deployment would ever admit this order.",
                param="max_price",
            )
        timeout = _header_number(timeout_header, "X-Book-Timeout") if req.timeout is None else req.timeout
        timeout = (
            self.limits.book_timeout_s if timeout is None else min(timeout, self.limits.book_timeout_max_s)
        )
        if isinstance(req, ChatCompletionRequest) and req.tools and not market.supports_tools:
            raise invalid_request(
                f"tools: the product '{req.model}' does not support tool calling.", param="tools"
            )
        max_out = _max_output(req, market)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        engine_body = _engine_body(body)
        if max_out is None:
            # the quote counted the product's output limit: the engine may not go past it
            engine_body["max_tokens"] = market.max_output_tokens
        return Ask(
            market,
            kind,
            engine_body,
            bid=bid,
            timeout_s=timeout,
            stream=req.stream,
            include_usage=include_usage or market.policy.usage_chunk == "always",
            max_output_tokens=max_out or market.max_output_tokens,
        )


def _max_output(req: ChatCompletionRequest | CompletionRequest, market: Market) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        max_out = req.max_completion_tokens or req.max_tokens
    else:
        max_out = req.max_tokens
    if max_out is not None and max_out > market.max_output_tokens:
        raise invalid_request(
            f"max_tokens: {max_out} is over the output limit of '{req.model}' ({market.max_output_tokens}).",
            param="max_tokens",
        )
    return max_out


def _engine_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body an engine gets: gateway fields removed, streamed, with its usage."""
    out = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
    out["stream"] = True
    so = out.get("stream_options")
    out["stream_options"] = {**so, "include_usage": True} if isinstance(so, dict) else {"include_usage": True}
    return out


def _header_number(value: str | None, name: str) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except ValueError:
        raise invalid_request(f"{name}: expected a positive number, got {value!r}", param=name) from None
    if not f > 0 or f == float("inf"):
        raise invalid_request(f"{name}: expected a positive number, got {value!r}", param=name)
    return bounded_header(name, f)


async def _close_quietly(it: AsyncIterator[EngineEvent]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # the engine is being cancelled; its error is moot
            pass


PRESENT_FRESH_S = 0.01
"""A client found connected this recently (loop time) is not asked again: the run's
second look (after its admission) right after the book's (at its dispatch). An order
admitted at once, in its submission, is not asked at all (its request was just read). Each look is a ``poll()``, a
system call that gives up the GIL to the database thread: ~22 µs of the event loop's
thread per request under load, in py-spy. A client that leaves after a look is seen
by the relay (on bourse's own server the connection watch calls it back, on another
ASGI server its listener hears ``http.disconnect``), which cancels the run and so the
engine; the looks are for orders that waited in the book, whose clients may have left
unseen."""

STALL_TICKS = 4
"""The stall clock looks every ``stall_timeout_s / STALL_TICKS`` seconds, so a stall is
ended between ``stall_timeout_s`` and ``(1 + 1 / STALL_TICKS) * stall_timeout_s`` after
the engine was asked for a chunk it never gave."""


class StallClock:
    """One engine attempt's stall clock: a generation that gives no chunk for the
    product's ``stall_timeout_s`` is ended, whatever the engine.

    One timer handle per attempt, rescheduled each tick, never per chunk. The run marks
    in :attr:`pull` whether it waits on the engine: 0 while its consumer holds the last
    chunk (a slow client is not the engine's stall), 1 and up while the engine is asked;
    each chunk sets it back to 0. Each tick that finds the run waiting counts one more;
    past ``STALL_TICKS`` whole ticks the clock cancels the task iterating the engine (as
    :func:`asyncio.timeout` does) and :meth:`caused` tells the run that this cancellation
    was the clock's, which the run turns into an :class:`EngineFailure`. ``stall_s``
    None: no clock (an engine that bounds a whole answer's wait itself)."""

    __slots__ = ("_cancelling", "_fired", "_handle", "_loop", "_task", "_tick", "pull", "stall_s")

    def __init__(self, stall_s: float | None) -> None:
        self.pull = 0
        self.stall_s = stall_s
        self._fired = False
        self._handle: asyncio.TimerHandle | None = None
        if stall_s is None:
            return
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._tick = stall_s / STALL_TICKS
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(self._tick, self._check)

    def _check(self) -> None:
        if self.pull:
            self.pull += 1
            if self.pull > STALL_TICKS + 1:  # waited STALL_TICKS whole ticks at least
                self._fired = True
                self._handle = None
                self._task.cancel()
                return
        self._handle = self._loop.call_later(self._tick, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def caused(self) -> bool:
        """Whether the cancellation being handled is the clock's alone (then it is
        taken back, as :func:`asyncio.timeout` does); another one is the consumer's."""
        return self._fired and self._task.uncancel() <= self._cancelling


class Run:
    """One request from the book to its outcome.

    Its terms are fixed when it is built; its state (``phase``, ``order``,
    ``tokens``, the timings) is written by its own methods only."""

    __slots__ = (
        "_attempt_span",
        "_clock",
        "_deadline",
        "_engine_iter",
        "_fut",
        "_present_at",
        "_settlement",
        "_stop",
        "_stop_cancelled",
        "_task",
        "_usage_event",
        "account_id",
        "admission",
        "bid",
        "body",
        "caller",
        "cleared",
        "client_left",
        "created",
        "created_at",
        "detached",
        "engine_stream",
        "grant",
        "hold_id",
        "include_usage",
        "kind",
        "market",
        "max_output_tokens",
        "order",
        "phase",
        "policy",
        "present",
        "product",
        "prompt",
        "queued_ms",
        "quote",
        "reasoning_tokens",
        "request_id",
        "service",
        "span",
        "stream",
        "t0",
        "timeout_s",
        "tokens",
        "ttft_ms",
    )

    def __init__(
        self,
        service: CompletionService,
        ask: Ask,
        request_id: str,
        t0: float,
        prompt: PromptSize,
        quote: Quote,
        account_id: str,
        hold_id: str,
        grant: Grant,
        engine_stream: bool = True,
        caller: Caller | None = None,
    ) -> None:
        # -- terms (fixed) --
        self.service = service
        self.market = market = ask.market
        self.product = market.product
        self.policy: Policy = market.policy
        self.kind = ask.kind
        self.body = ask.body
        self.bid = ask.bid
        self.timeout_s = ask.timeout_s
        self.stream = ask.stream
        self.include_usage = ask.include_usage
        self.max_output_tokens = ask.max_output_tokens
        self.request_id = request_id
        self.t0 = t0
        self.prompt = prompt
        self.quote = quote
        self.account_id = account_id
        self.hold_id = hold_id
        """The hold placed for this run (closed by its settlement)."""
        self.grant = grant
        self.engine_stream = engine_stream
        self.caller = caller
        """The HTTP request (None: a job's run)."""
        self.span = service.observer.start_span(
            "bourse.run", None if caller is None else caller.traceparent, t0
        )
        self.present: Callable[[], bool] | None = None
        """Asks whether the client is still connected (the relay's; None for a job)."""
        self._present_at = -PRESENT_FRESH_S
        """When (loop time) ``present`` last found the client connected."""
        self._clock = asyncio.get_running_loop().time
        """The loop's time, as :meth:`Market.now` reads it (one call, not three)."""
        self.created_at = time.time()
        self.created = int(self.created_at)
        # -- state (written by the run only) --
        self.phase = Phase.NEW
        self.order: Order | None = None
        self.admission: Admission | None = None
        """The slot held now."""
        self.cleared: Admission | None = None
        """The last admission's terms, kept after its slot is given back."""
        self.client_left = False
        self.tokens = 0
        self.reasoning_tokens = 0
        """Of ``tokens``, those the engine sent as reasoning."""
        self.ttft_ms: float | None = None
        self.queued_ms: float | None = None
        self._usage_event: UsageEvent | None = None
        self._fut: asyncio.Future[Admission] | None = None
        self._deadline = 0.0
        self._engine_iter: AsyncIterator[EngineEvent] | None = None
        self._settlement: asyncio.Task[Finished] | None = None
        self.detached = False
        """The run of a detached job: a drain hands it back rather than ending it."""
        self._stop: GatewayError | None = None
        """Set by :meth:`interrupt`: the error the run ends with."""
        self._stop_cancelled = False
        self._task: asyncio.Task[Any] | None = None
        """The task reading :meth:`events` (where :meth:`interrupt` stops it)."""
        self._attempt_span: Span = NULL_SPAN

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def interrupt(self, error: GatewayError) -> None:
        """A drain ends the run now, wherever it waits (an order leaves the book, an
        engine is stopped): it ends with ``error``, settled by its policy, or, a
        detached job's run, raises :class:`HandedBack`. Once; nothing if it has ended."""
        if self.phase is Phase.DONE or self._stop is not None:
            return
        self._stop = error
        task = self._task
        if task is not None and not task.done():  # else it stops at its next attempt
            self._stop_cancelled = True
            task.cancel()

    def take_back_stop(self) -> bool:
        """The consumer caught a cancellation: True (once) if it is the one
        :meth:`interrupt` sent, which landed in the consumer rather than in the run (a
        relay blocked writing to a slow client). It is taken back; the run has been
        abandoned, settled by its policy."""
        if not self._stop_cancelled:
            return False
        self._stop_cancelled = False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True

    def client_gone(self) -> None:
        """The client disconnected: an abandonment from now on is ``disconnected``."""
        self.client_left = True

    def _still_there(self) -> bool:
        """Whether the client is still connected, as far as can be told now (asked at
        admission: the relay may not have seen a disconnect the socket already has)."""
        if self.client_left:
            return False
        if self.present is not None:
            now = self._clock()
            if now - self._present_at >= PRESENT_FRESH_S:
                if not self.present():
                    self.client_left = True
                    return False
                self._present_at = now
        return True

    async def submit(self) -> None:
        """Rest the order in the book (may admit at once); 503 if the book is full."""
        m = self.market
        self.order = order = m.new_order(self.request_id, self.bid)
        order.present = self._still_there
        # its request was read from the client just now: an order admitted at once is
        # not asked (a client that left meanwhile is seen by the relay: the connection
        # watch, or the listener on another server)
        self._present_at = self._clock()
        self._deadline = order.arrived_at + self.timeout_s  # a requeue or re-entry keeps it
        self._fut = fut = await m.submit(order)
        if not fut.done():  # resting in the book: its client is asked when a slot comes
            self._present_at = -PRESENT_FRESH_S
        self.phase = Phase.QUEUED

    # -- the run -------------------------------------------------------------------

    async def events(self, on_admit: Callable[[Run], None] | None = None) -> AsyncGenerator[RunEvent, None]:
        """The run's events; ``on_admit`` is called once, when the order first gets a
        slot (detached jobs mark themselves running)."""
        assert self.order is not None, "submit() first"
        target = self.market.policy.reasoning_field
        other = "reasoning" if target == "reasoning_content" else "reasoning_content"
        chat = self.kind == "chat"
        rid = self.request_id
        product = self.product
        created = self.created
        streaming = Phase.STREAMING
        self._task = asyncio.current_task()
        try:
            yield Queued(self.bid)
            while True:
                it, clock = await self._attempt(on_admit)
                try:
                    clock.pull = 1
                    async for ev in it:
                        clock.pull = 0
                        if type(ev) is ChunkEvent:
                            chunk = ev.chunk
                            chunk["id"] = rid
                            chunk["model"] = product
                            chunk["created"] = created
                            # the reasoning field renamed and counted, inline (once per chunk;
                            # a legacy completion's choices have no delta)
                            for choice in chunk["choices"] if chat else ():
                                delta = choice.get("delta")
                                if delta is not None:
                                    if other in delta:
                                        delta[target] = delta.pop(other)
                                    if delta.get(target):
                                        self.reasoning_tokens += _reasoning_count(delta[target], ev.tokens)
                            if self.phase is not streaming:
                                self._first_output()
                            self.tokens += ev.tokens
                            yield ev
                        else:
                            self._usage_event = ev
                        clock.pull = 1
                except (EngineFailure, asyncio.CancelledError) as exc:
                    clock.stop()
                    end = await self._failed(await self._failure(exc, clock, it))
                    yield end
                    if type(end) is Finished:
                        return
                    continue
                finally:
                    clock.stop()
                self._engine_iter = None
                yield await self._settled("disconnected" if self.client_left else "completed", None)
                return
        except (GatewayError, ClientGone, asyncio.CancelledError, GeneratorExit) as exc:
            yield await self._ended(exc)
        finally:
            self._task = None

    async def _ended(
        self, exc: GatewayError | ClientGone | asyncio.CancelledError | GeneratorExit
    ) -> Finished:
        """The end of a run by an error: the book's or the engine's, or a drain's stop;
        or a slot that came after the client left (no engine started on it). Or its
        consumer stopped it (``exc`` raised again once the run is abandoned), unless
        ``exc`` is the cancellation a drain's stop sent."""
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            await self._abandon_unless_stopped(exc)
            return await self._interrupted()
        if exc is self._stop:
            return await self._interrupted()
        if isinstance(exc, ClientGone):
            self.client_left = True
            return await self._settled("disconnected", None)
        return await self._settled("timeout" if exc.status == 408 else "error", exc)

    async def _abandon_unless_stopped(self, exc: asyncio.CancelledError | GeneratorExit) -> None:
        """The consumer stops (``exc`` raised again, the run abandoned), unless ``exc`` is
        the cancellation :meth:`interrupt` sent: that one is taken back, and the task goes
        on to end the run with the drain's error."""
        if type(exc) is GeneratorExit or not self.take_back_stop():
            await self._abandon()
            raise exc

    async def _attempt(
        self, on_admit: Callable[[Run], None] | None
    ) -> tuple[AsyncIterator[EngineEvent], StallClock]:
        """Wait for a slot (408 at the deadline), start the engine on it and its stall clock."""
        if self._stop is None and self.service.draining:
            self._stop = draining()
        if self._stop is not None:
            raise self._stop
        m, order, fut = self.market, self.order, self._fut
        assert order is not None and fut is not None
        self.phase = Phase.QUEUED
        observer, run_span = self.service.observer, self.span
        traced = run_span is not NULL_SPAN  # else no child span either (nothing is traced)
        wait = observer.start_span("bourse.book.wait", run_span) if traced else NULL_SPAN
        try:
            adm = await m.wait(order, fut, self._deadline)  # ClientGone: the book saw the client had left
        except BaseException as exc:
            wait.end(type(exc).__name__)
            if isinstance(exc, asyncio.CancelledError):
                # the book withdrew the order itself (or gave back the slot it had just
                # given): the abandonment must not withdraw it a second time
                self._fut = None
            raise
        if traced:
            wait.end()
        if not self._still_there():  # left since: give the slot to the next order, start nothing
            m.release(adm)
            raise ClientGone(order.id)
        self.admission = self.cleared = adm
        self.phase = Phase.ADMITTED
        if self.queued_ms is None:
            self.queued_ms = (self._clock() - order.arrived_at) * 1000.0
            if on_admit is not None:
                on_admit(self)
        self.body["model"] = self.service.models[adm.deployment]
        traceparent = None if self.caller is None else self.caller.traceparent
        if traced:
            span = self._attempt_span = observer.start_span("bourse.engine.attempt", run_span)
            span.set("bourse.deployment", adm.deployment)
            span.set("bourse.attempt", order.requeues)
            traceparent = span.traceparent or traceparent
        engine = m.engines[adm.deployment]
        it = engine.generate(
            GenerationRequest(
                self.request_id, self.kind, self.body, attempt=order.requeues, stream=self.engine_stream,
                traceparent=traceparent,
            )
        )  # fmt: skip
        self._engine_iter = it
        whole = not self.engine_stream and engine.answers_whole
        return it, StallClock(None if whole else m.stall_timeout_s)

    async def _failure(
        self, exc: EngineFailure | asyncio.CancelledError, clock: StallClock, it: AsyncIterator[EngineEvent]
    ) -> EngineFailure:
        """The engine's failure, or the stall the clock ended; any other cancellation
        goes on (the consumer's: the run is abandoned)."""
        if isinstance(exc, EngineFailure):
            return exc
        if not clock.caused():
            raise exc
        await _close_quietly(it)
        assert clock.stall_s is not None
        return EngineFailure(
            f"The engine produced no token for {clock.stall_s:g} s (the stall timeout of "
            f"'{self.product}'); the generation was ended.",
            transient=True,  # a retry when nothing was produced yet; final after output
            kind="stall",
        )

    def _first_output(self) -> None:
        self.phase = Phase.STREAMING
        self.ttft_ms = (time.perf_counter() - self.t0) * 1000.0
        if self.admission is not None:
            self.market.report_success(self.admission.deployment)

    async def _failed(self, failure: EngineFailure) -> Requeued | Finished:
        """The engine failed: requeue a transient failure before any output (up to
        ``max_requeues``), else finish with the error. A final failure says
        ``x-should-retry: false``: it ran (perhaps produced, perhaps was charged), or
        refused the request, or may still be running; sent again, it would run again."""
        self._engine_iter = None
        m, order, adm = self.market, self.order, self.admission
        assert order is not None and adm is not None
        if failure.kind == "empty" and self.phase is not Phase.STREAMING:
            failure = await self._empty_refusal(adm.deployment, failure)
        self._end_attempt(failure.message)
        self.service.observer.upstream_failed(
            m.product, adm.deployment, failure.kind, failure.message, self.request_id
        )
        if self.phase is Phase.STREAMING or not failure.transient:
            if failure.kind == "timeout" and self.phase is not Phase.STREAMING:
                m.report_failure(adm.deployment, order)  # no answer in time: the deployment's, once
            err = GatewayError(
                failure.status, failure.code, failure.message, error_type=failure.error_type, retry=False
            )
            return await self._settled("error", self._engine_error(err))
        if order.requeues < m.policy.max_requeues:
            self.service.observer.requeued(m.product, adm.deployment)
            self._fut = fut = await m.requeue(order, adm)
            self.admission = None
            self.phase = Phase.QUEUED
            cooling = None if self.detached else m.cooling()
            if cooling is not None:  # every deployment cools down: nothing could run it now
                m.withdraw(order, fut)
                return await self._settled("error", cooling)
            return Requeued(adm.deployment)
        m.report_failure(adm.deployment, order)
        return await self._settled("error", self._engine_error(m.failure_after_requeues(failure.message)))

    async def _empty_refusal(self, deployment: str, failure: EngineFailure) -> EngineFailure:
        """An upstream stream closed empty (no output, no ``[DONE]``): a refusal of the
        request when its prompt is over the engine's context (llama-cpp-python answers
        such a prompt so), counted by the engine's tokenizer if it has one, else by the
        gateway's estimate against the product's context length; else ``failure``
        (transient, counted once per request on the breaker)."""
        engine, context, n = self.market.engines.get(deployment), self.market.context_length, None
        if isinstance(engine, TokenCounter) and engine.loaded and engine.context_length > 0:
            try:  # (an engine that does not know its context says 0: the product's stands)
                n = await engine.count_prompt_tokens(self.kind, self.body)
            except Exception:  # the count is a best effort: the failure stays what it was
                log.warning(
                    "counting the prompt of %s on %s failed", self.request_id, deployment, exc_info=True
                )
            context = engine.context_length
        counted = "" if n is not None else "about "
        if n is None:
            n = self.prompt.estimated_tokens
        if n < context:
            return failure
        return EngineFailure(
            f"The prompt is {counted}{n} tokens; the engine of '{self.product}' has a context of {context} "
            "tokens and closed the stream without an answer. Shorten the prompt.",
            transient=False,
            status=400,
            code="context_length_exceeded",
            error_type="invalid_request_error",
            kind="refused",
        )

    def _after_output(self, err: GatewayError) -> GatewayError:
        """``err`` as the end of this run: once output began, ``x-should-retry: false``
        (sent again, the request would run, and by its policy be charged, again)."""
        if self.phase is not Phase.STREAMING or err.headers.get("x-should-retry") == "false":
            return err
        headers = {k: v for k, v in err.headers.items() if k != "x-should-retry"}
        return GatewayError(
            err.status, err.code, err.message, param=err.param, error_type=err.error_type, headers=headers,
            retry=False,
        )  # fmt: skip

    def _engine_error(self, err: GatewayError) -> GatewayError:
        """An engine failure as the client sees it: the policy may name its code and type."""
        code, error_type = self.policy.engine_error(err.code, err.error_type)
        if (code, error_type) == (err.code, err.error_type):
            return err
        return GatewayError(
            err.status, code, err.message, param=err.param, error_type=error_type, headers=err.headers
        )

    async def _settled(self, outcome: Outcome, error: GatewayError | None) -> Finished:
        self._finish(outcome, error)
        fin = await self.settled()
        assert fin is not None
        return fin

    async def settled(self) -> Finished | None:
        """The run's settled end (waits for its settlement); None if it has not ended."""
        if self._settlement is None:
            return None
        return await asyncio.shield(self._settlement)

    async def abandon(self) -> None:
        """The consumer stops without the run having finished (client gone, head not
        sent, job canceled): stop the engine, give back the slot, settle. Idempotent."""
        if self.phase is not Phase.DONE:
            await self._abandon()

    async def _abandon(self) -> None:
        if self.phase is Phase.DONE:
            return
        await self._halt()
        self._finish("disconnected" if self.client_left else "canceled", None)

    async def _halt(self) -> None:
        """Stop the engine; take a waiting order out of the book."""
        it, self._engine_iter = self._engine_iter, None
        if it is not None:
            await _close_quietly(it)
        if (
            self.phase is Phase.QUEUED
            and self.admission is None
            and self.order is not None
            and self._fut is not None
        ):
            self.market.withdraw(self.order, self._fut)

    async def _interrupted(self) -> Finished:
        """The end of a run a drain stopped: with the drain's error, settled by the
        policy; a detached job's run gives back its slot and raises :class:`HandedBack`."""
        assert self._stop is not None
        await self._halt()
        if not self.detached:
            return await self._settled("error", self._after_output(self._stop))
        self.phase = Phase.DONE
        self._unlink()
        if self.admission is not None:
            self.market.release(self.admission)
            self.admission = None
        self.service.live.discard(self)
        self._end_attempt("handed back")
        self.span.end("handed_back")
        raise HandedBack(self.request_id)

    def _finish(self, outcome: Outcome, error: GatewayError | None) -> None:
        """The run ends: give back the slot, start the settlement (its own task)."""
        if self.phase is Phase.DONE:
            return
        closing = self._closing(outcome)
        self.phase = Phase.DONE
        self._unlink()
        self.service.live.discard(self)
        if self._attempt_span is not NULL_SPAN:
            self._end_attempt(None if error is None else error.message)
        if self.admission is not None:
            self.market.release(self.admission)
            self.admission = None
        service = self.service
        self._settlement = service.spawn(service.settle(closing, error, self.grant, self.tokens, self))

    def _unlink(self) -> None:
        """At the run's end, drop the order's way back to the run (its presence probe, a
        bound method of the run): nothing asks it any more, and without it the run, its
        order and its settlement are freed by reference counting, not left in a cycle for
        the garbage collector (a collection every ~200 requests under load)."""
        if self.order is not None:
            self.order.present = None

    def _end_attempt(self, error: str | None) -> None:
        """End the engine attempt's span (callers on the hot path look for one first)."""
        span, self._attempt_span = self._attempt_span, NULL_SPAN
        span.end(error)

    def report(self, fin: Finished, closing: Closing) -> None:
        """Tell the observer how the run ended (once, after its settlement): its report,
        if the observer hears runs, and the end of its span."""
        observer = self.service.observer
        if observer.hears_runs:
            observer.run_finished(self._report(fin, closing))
        span = self.span
        if span is not NULL_SPAN:
            span.set("bourse.outcome", fin.outcome)
            span.set("bourse.product", self.product)
            span.set("bourse.cost_micros", fin.cost_micros)
            span.end(None if fin.error is None else fin.error.code)

    def _report(self, fin: Finished, closing: Closing) -> RunReport:
        caller, usage, cleared = self.caller, fin.usage, self.cleared
        error = fin.error
        if self.stream and caller is not None:
            status = 200  # the head went out when the order entered the book
        elif error is not None:
            status = error.status
        else:
            status = 499 if self.client_left else 200
        return RunReport(
            method=None if caller is None else "POST",
            route=caller.route if caller is not None else ENDPOINTS[closing.kind],
            status=status,
            outcome=fin.outcome,
            request_id=self.request_id,
            correlation_id=None if caller is None else caller.correlation_id,
            key_id=self.grant.key_id,
            product=self.product,
            deployment=None if cleared is None else cleared.deployment,
            stream=self.stream,
            detached=caller is None,
            error=None if error is None else error.code,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cost_micros=fin.cost_micros,
            quote_micros=self.quote.micros,
            bid=self.bid,
            cleared_price=None if cleared is None else cleared.price,
            queued_ms=None if self.queued_ms is None else round(self.queued_ms, 3),
            ttft_ms=None if self.ttft_ms is None else round(self.ttft_ms, 3),
            latency_ms=closing.receipt["latency_ms"],
            requeues=0 if self.order is None else self.order.requeues,
        )

    def _closing(self, outcome: Outcome) -> Closing:
        usage = self._usage()
        latency_ms = (time.perf_counter() - self.t0) * 1000.0
        receipt: dict[str, Any] = {"latency_ms": round(latency_ms, 3)}
        if self.policy.receipt_ttft:
            receipt["ttft_ms"] = None if self.ttft_ms is None else round(self.ttft_ms, 3)
        receipt["outcome"] = outcome
        cleared = self.cleared
        return Closing(
            request_id=self.request_id,
            kind=self.kind,
            product=self.product,
            created_at=self.created_at,
            account_id=self.account_id,
            key_id=self.grant.key_id,
            hold_id=self.hold_id,
            quote=self.quote,
            policy=self.policy,
            outcome=outcome,
            produced=self.tokens > 0 or bool(usage["completion_tokens"]),
            price=self.bid if cleared is None else cleared.price,
            usage=usage,
            receipt=receipt,
            correlation_id=None if self.caller is None else self.caller.correlation_id,
        )

    def _usage(self) -> dict[str, Any]:
        """The engine's usage, or the gateway's own count (``usage_estimated``); with ``x_market``."""
        ev = self._usage_event
        if ev is not None:
            usage: dict[str, Any] = {
                "prompt_tokens": ev.prompt_tokens,
                "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            }
            usage.update(ev.details)
        else:
            prompt = self.prompt.estimated_tokens if self.tokens or self.phase is Phase.STREAMING else 0
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens,
                "usage_estimated": True,
            }
        if self.reasoning_tokens:
            _reasoning_details(usage, self.reasoning_tokens)
        order, cleared = self.order, self.cleared
        usage["x_market"] = {
            "bid": self.bid,
            "cleared_price": None if cleared is None else cleared.price,
            "level": None if cleared is None else cleared.level,
            "position_at_entry": order.position_at_entry if order else None,
            "queued_ms": None if self.queued_ms is None else round(self.queued_ms, 3),
            "requeues": order.requeues if order else 0,
            "deployment": None if cleared is None else cleared.deployment,
        }
        return usage


def _reasoning_details(usage: dict[str, Any], relayed: int) -> None:
    """``completion_tokens_details.reasoning_tokens`` in ``usage``: the engine's own, else
    the gateway's count of the reasoning it relayed (one token per reasoning chunk)."""
    details = usage.get("completion_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    given = details.get("reasoning_tokens")
    if not (isinstance(given, int) and given > 0):
        details["reasoning_tokens"] = relayed
    usage["completion_tokens_details"] = details


def _reasoning_count(text: Any, tokens: int) -> int:
    """The reasoning tokens of a chunk that carries ``tokens`` completion tokens: all of
    them for a chunk of one token, else (a whole answer in one chunk) the text's UTF-8
    bytes / 4 + 1, at most ``tokens``."""
    if tokens <= 1 or not isinstance(text, str):
        return tokens
    return min(tokens, len(text.encode()) // 4 + 1)
