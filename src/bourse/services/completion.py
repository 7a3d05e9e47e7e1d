"""Opening a run: the product checks, the rate limit, the quote, the hold and the book.

:class:`CompletionService` checks a validated request against its product
(:meth:`~CompletionService.prepare`, no I/O), then rate-limits, quotes, holds and
books it (:meth:`~CompletionService.open`), which returns a :class:`~bourse.services.run.Run`
(its terms, meter and state: :mod:`bourse.services.run`). The service settles each
run that ends (:meth:`~CompletionService.settle`) and keeps the runs that are live.
The money is :class:`~bourse.services.billing.Billing`'s, handed plain values: the
run's :class:`~bourse.services.billing.Quote` before the book, its
:class:`~bourse.services.billing.Closing` after the outcome. The run's public names
(``Run``, ``Phase``, its events) are importable from here too, as the HTTP layer
and the jobs always imported them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from bourse.domain.errors import GatewayError, draining, invalid_request, model_not_found, no_capacity
from bourse.domain.ratelimit import retry_after_header
from bourse.domain.values import immutable
from bourse.ports.engine import Kind
from bourse.ports.limits import LimiterUnavailable, RateLimiter
from bourse.ports.observer import NULL_OBSERVER, NULL_SPAN, Caller, Observer, Span
from bourse.services.auth import Authenticator, Principal
from bourse.services.billing import ENDPOINTS, Billing, Closing, quote_for
from bourse.services.market import Market
from bourse.services.run import Run
from bourse.services.run_events import Finished, HandedBack, Queued, Requeued, RunEvent, SettledHook
from bourse.services.run_state import Phase
from bourse.services.run_terms import Ask, Grant, Terms
from bourse.services.stall_clock import StallClock
from bourse.wire.prompt import PromptSize, measure_prompt
from bourse.wire.requests import GATEWAY_FIELDS, ChatCompletionRequest, CompletionRequest, bounded_header

__all__ = [
    "Ask",
    "CompletionService",
    "Finished",
    "Grant",
    "HandedBack",
    "Limits",
    "Phase",
    "Queued",
    "Requeued",
    "Run",
    "RunEvent",
    "SettledHook",
    "StallClock",
]

log = logging.getLogger("bourse.completion")

T = TypeVar("T")


@immutable
class Limits:
    book_timeout_s: float = 300.0
    book_timeout_max_s: float = 3600.0


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
        deadline_header: str | None = None,
        t0: float | None = None,
        engine_stream: bool = True,
        fail_fast: bool = True,
        caller: Caller | None = None,
        present: Callable[[], bool] | None = None,
        route: str | None = None,
    ) -> Run:
        """validate -> (authenticated) -> rate-limit -> quote -> hold -> book.

        ``engine_stream`` False: the engine may produce the answer at once (a relayed
        non-streamed request); jobs keep the stream, so that their progress and a
        cancel's charge count the tokens as they come. ``fail_fast`` False: the run waits
        out open breakers in the book (a resumed job) rather than get 503 at once.
        ``caller``: the HTTP request (None: a job's run). ``present`` asks whether the
        client is still connected: a slot that comes to an order whose client left is
        given to the next order, and no engine starts for it. ``route``: the route a
        job's run answers (default: its kind's own; an HTTP request's is its caller's)."""
        if self.draining:
            raise draining()
        t0 = time.perf_counter() if t0 is None else t0
        ask = self.prepare(
            kind, body, req, max_price_header=max_price_header, timeout_header=timeout_header,
            deadline_header=deadline_header,
        )  # fmt: skip
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
        if caller is not None:
            route = caller.route
        elif route is None:
            route = ENDPOINTS[kind]
        terms = Terms(
            ask, request_id, t0, time.time(), prompt, quote, account_id, hold_id, grant, engine_stream, caller,
            route,
        )  # fmt: skip
        run = Run(self, terms, present)
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
        if fail_fast:  # broken (its 503, as below) or every deployment cooling down: 503 now
            cooling = market.cooling()
            if cooling is not None:
                raise cooling
        else:
            broken = market.broken_reason()
            if broken is not None:
                raise no_capacity(f"'{market.product}' cannot serve: {broken}", retry_after_s=30)
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
        deadline_header: str | None = None,
    ) -> Ask:
        """Check the request against its product (no I/O): the bid (a deadline order's
        ceiling), the timeout (or deadline), tools, the output budget."""
        market = self.market(req.model)
        if req.sim is not None and not market.sim_overrides:
            raise invalid_request(
                f"sim: the product '{req.model}' does not take per-request simulator settings "
                "(its operator has sim_overrides off).",
                param="sim",
            )
        bid = _header_number(max_price_header, "X-Max-Price") if req.max_price is None else req.max_price
        deadline = self._deadline(req, deadline_header, bid, timeout_header)
        if bid is None:
            bid = market.default_bid
        if bid < market.min_floor:
            raise invalid_request(
                f"max_price: {bid:g} USD per 1M tokens is below the lowest floor of '{req.model}' "
                f"({market.min_floor:g}); no deployment would ever admit this order.",
                param="max_price",
            )
        timeout = _header_number(timeout_header, "X-Book-Timeout") if req.timeout is None else req.timeout
        if deadline is not None:
            timeout = deadline
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
        if max_out is None and not market.engine_bounds_output():
            # the quote counted the product's output limit: the engine may not go past it
            # (an engine whose own context is within it cannot: none is sent, see there)
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
            deadline_s=deadline,
        )

    def _deadline(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        header: str | None,
        ceiling: float | None,
        timeout_header: str | None,
    ) -> float | None:
        """A deadline order's deadline (``deadline_s`` or ``X-Deadline-S``), checked: it
        needs ``max_price`` (its ceiling), is its timeout (so no ``timeout`` beside it)
        and is at most ``[server] book_timeout_max_s``. None: a fixed bid."""
        param = "deadline_s" if req.deadline_s is not None else "X-Deadline-S"
        deadline = req.deadline_s if req.deadline_s is not None else _header_number(header, param)
        if deadline is None:
            return None
        if ceiling is None:
            raise invalid_request(
                f"max_price: a deadline order ({param}) needs max_price (or X-Max-Price), the most "
                "it may pay: its bid starts low and is raised up to it as its deadline nears.",
                param="max_price",
            )
        if req.timeout is not None or timeout_header is not None:
            raise invalid_request(
                f"timeout: a deadline order's {param} is its timeout in the book; send one of them.",
                param="timeout" if req.timeout is not None else "X-Book-Timeout",
            )
        most = self.limits.book_timeout_max_s
        if deadline > most:
            raise invalid_request(
                f"{param}: expected at most {most:g} s (the book's longest wait), got {deadline:g}",
                param=param,
            )
        return deadline


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
