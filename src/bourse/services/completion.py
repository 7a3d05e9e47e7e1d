"""One request's run: admission, the engine attempts, metering, the outcome.

:class:`CompletionService` checks a validated request against its product and
prepares a :class:`Run`. :meth:`Run.events` is the single async iterator the HTTP
relay consumes, for streamed and non-streamed answers alike::

    Queued -> (engine chunks ... | Requeued -> ...) -> Finished

Chunks are the engine's own dicts with ``id``, ``model`` and the reasoning field
rewritten in place; nothing is copied or buffered. Every run ends in exactly one
:class:`Finished` (or in an abandonment when the client leaves), and every slot it
took is given back exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bourse.domain.book import Admission, Order
from bourse.domain.errors import GatewayError, invalid_request, model_not_found
from bourse.domain.money import MAX_PRICE_USD
from bourse.ports.engine import ChunkEvent, EngineEvent, EngineFailure, GenerationRequest, Kind, UsageEvent
from bourse.ports.limits import KeyLimits, LimiterUnavailable, RateLimiter
from bourse.services.auth import Authenticator, Principal
from bourse.services.billing import Billing, prompt_bytes_and_messages
from bourse.services.ids import new_request_id
from bourse.services.limits import retry_after_header
from bourse.services.market import Market
from bourse.wire.requests import GATEWAY_FIELDS, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("bourse.completion")

QUEUED, ADMITTED, STREAMING, DONE = 1, 2, 3, 4


@dataclass(slots=True, frozen=True)
class Queued:
    bid: float


@dataclass(slots=True, frozen=True)
class Requeued:
    deployment: str


@dataclass(slots=True)
class Finished:
    """The end of a run: the error (None when completed), usage and receipt."""

    outcome: str
    error: GatewayError | None
    usage: dict[str, Any]
    receipt: dict[str, Any]
    text_tokens: int = 0
    cost_micros: int = 0


RunEvent = ChunkEvent | Queued | Requeued | Finished
FinishHook = Callable[["Run", Finished], None]


@dataclass(slots=True)
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
    ) -> None:
        self.markets = markets
        self.limits = limits
        self.models = models
        """deployment name -> the engine's internal model name"""
        self.billing = billing
        self.limiter = limiter
        self.auth = auth
        self.on_finish: list[FinishHook] = []
        self.running: set[Run] = set()
        self.background: set[asyncio.Task[None]] = set()

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
    ) -> Run:
        """validate -> (authenticated) -> rate-limit -> quote -> hold -> book."""
        run = self.prepare(
            kind, body, req, max_price_header=max_price_header, timeout_header=timeout_header, t0=t0
        )
        run.request_id = request_id
        market = run.market
        self.auth.check_product(principal, run.product)
        nbytes, nmsgs = prompt_bytes_and_messages(body)
        broken = market.broken_reason()
        if broken is not None:
            raise GatewayError(
                503, "no_capacity", f"'{run.product}' cannot serve: {broken}", headers={"retry-after": "30"}
            )
        counter = market.token_counter()
        if counter is not None:  # the engine's own tokenizer: exact
            n = await counter.count_prompt_tokens(kind, run.body)
            if n is not None and n >= counter.context_length:
                raise GatewayError(
                    400,
                    "context_length_exceeded",
                    f"The prompt is {n} tokens; '{run.product}' has a context of {counter.context_length} tokens "
                    "and needs room for at least one generated token. Shorten the prompt.",
                    param="messages" if kind == "chat" else "prompt",
                )
        else:  # the engine enforces its own limit; refuse here only what cannot fit
            at_least = nbytes // 8  # no common tokenizer averages more than 8 bytes a token
            if at_least > market.context_length:
                raise GatewayError(
                    400,
                    "context_length_exceeded",
                    f"The prompt is at least {at_least} tokens ({nbytes} bytes); '{run.product}' has a context of "
                    f"{market.context_length} tokens. Shorten the prompt.",
                    param="messages" if kind == "chat" else "prompt",
                )
        run.key_id = principal.key.id
        run.limits = principal.limits
        self.billing.quote(run, nbytes, nmsgs)
        tokens = run.quote_tokens
        try:
            decision = await self.limiter.acquire(principal.key.id, principal.limits, tokens)
        except LimiterUnavailable as exc:
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
        run.limit_tokens = tokens
        run.ratelimit_headers = decision.headers
        try:
            await self.billing.hold(run, principal.account_id)
            await run.submit()
        except BaseException:
            await self.billing.release_unbooked(run)
            await self._limits_done(principal.key.id, principal.limits, tokens, 0)
            raise
        return run

    async def _limits_done(self, key_id: str, limits: KeyLimits, reserved: int, used: int) -> None:
        try:
            await self.limiter.finish(key_id, limits, reserved, used)
        except LimiterUnavailable as exc:  # the limiter repairs its count when it can
            log.warning("rate limits of key %s not updated: %s", key_id, exc)

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def after_finish(self, run: Run, fin: Finished) -> None:
        """Settlement and limiter bookkeeping, detached from the client's connection."""
        try:
            await self.billing.settle(run, fin)
        finally:
            if run.key_id is not None and run.limits is not None:
                used = int(fin.usage.get("total_tokens") or 0)
                await self._limits_done(run.key_id, run.limits, run.limit_tokens, used)

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
        t0: float | None = None,
    ) -> Run:
        """Check the request against its product and build its run (no I/O)."""
        market = self.market(req.model)
        bid = _header_number(max_price_header, "X-Max-Price") if req.max_price is None else req.max_price
        if bid is None:
            bid = market.default_bid
        if bid > MAX_PRICE_USD:
            raise invalid_request(f"max_price: {bid:g} USD per 1M tokens is over the highest bid accepted "
                                  f"({MAX_PRICE_USD:.0f}).", param="max_price")  # fmt: skip
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
        max_out = None
        if isinstance(req, ChatCompletionRequest):
            max_out = req.max_completion_tokens or req.max_tokens
        else:
            max_out = req.max_tokens
        if max_out is not None and max_out > market.max_output_tokens:
            raise invalid_request(
                f"max_tokens: {max_out} is over the output limit of '{req.model}' ({market.max_output_tokens}).",
                param="max_tokens",
            )
        engine_body = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
        engine_body["stream"] = True
        so = engine_body.get("stream_options")
        engine_body["stream_options"] = (
            {**so, "include_usage": True} if isinstance(so, dict) else {"include_usage": True}
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Run(
            self,
            market,
            kind,
            engine_body,
            bid=bid,
            timeout_s=timeout,
            stream=req.stream,
            include_usage=include_usage or market.policy.usage_chunk == "always",
            t0=time.perf_counter() if t0 is None else t0,
            max_output_tokens=max_out or market.max_output_tokens,
        )


def _header_number(value: str | None, name: str) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except ValueError:
        raise invalid_request(f"{name}: expected a positive number, got {value!r}", param=name) from None
    if not f > 0 or f == float("inf"):
        raise invalid_request(f"{name}: expected a positive number, got {value!r}", param=name)
    return f


@dataclass(slots=True, eq=False)
class Run:
    """One request from the book to its outcome."""

    service: CompletionService
    market: Market
    kind: Kind
    body: dict[str, Any]
    bid: float
    timeout_s: float
    stream: bool
    include_usage: bool
    t0: float
    max_output_tokens: int = 0
    engine_stream: bool = True
    """False: the engine may produce the answer at once (``GenerationRequest.stream``);
    set for the relay's non-streamed requests. Jobs keep the stream: their progress and
    a cancel's charge count the tokens as they come."""
    request_id: str = field(default_factory=lambda: new_request_id("chat"))
    created_at: float = field(default_factory=time.time)
    created: int = 0
    phase: int = 0
    order: Order | None = None
    admission: Admission | None = None
    client_left: bool = False
    tokens: int = 0
    ttft_ms: float | None = None
    queued_ms: float | None = None
    usage_event: UsageEvent | None = None
    _fut: asyncio.Future[Admission] | None = None
    _deadline: float = 0.0
    _engine_iter: AsyncIterator[EngineEvent] | None = None
    finished: Finished | None = None
    # the last admission's terms, kept after its slot is given back
    cleared_price: float | None = None
    level_at_clear: float | None = None
    deployment: str | None = None
    # money and limits
    account_id: str | None = None
    key_id: str | None = None
    limits: KeyLimits | None = None
    limit_tokens: int = 0
    ratelimit_headers: dict[str, str] | None = None
    quote_tokens: int = 0
    quote_micros: int = 0
    hold_id: str | None = None
    settle_task: asyncio.Task[None] | None = None
    on_admit: Callable[[Run], None] | None = None
    """Called once, when the order first gets a slot (detached jobs mark themselves running)."""

    @property
    def product(self) -> str:
        return self.market.product

    @property
    def policy(self) -> Any:
        return self.market.policy

    def __post_init__(self) -> None:
        self.created = int(self.created_at)
        if self.kind == "completion" and self.request_id.startswith("chatcmpl-"):
            self.request_id = new_request_id("completion")

    async def submit(self) -> None:
        """Rest the order in the book (may admit at once); 503 if the book is full."""
        m = self.market
        self.order = order = m.new_order(self.request_id, self.bid)
        self._deadline = order.arrived_at + self.timeout_s
        self._fut = await m.submit(order)
        self.phase = QUEUED
        self.service.running.add(self)

    # -- the run -------------------------------------------------------------------

    async def events(self) -> AsyncGenerator[RunEvent, None]:
        m = self.market
        order = self.order
        fut = self._fut
        assert order is not None and fut is not None, "submit() first"
        max_requeues = m.policy.max_requeues
        target = m.policy.reasoning_field
        other = "reasoning" if target == "reasoning_content" else "reasoning_content"
        chat = self.kind == "chat"
        rid = self.request_id
        product = self.product
        try:
            yield Queued(self.bid)
            while True:
                self.phase = QUEUED
                adm = await m.wait(order, fut, self._deadline)
                self.admission = adm
                self.phase = ADMITTED
                self.cleared_price, self.level_at_clear, self.deployment = (
                    adm.price,
                    adm.level,
                    adm.deployment,
                )
                if self.queued_ms is None:
                    self.queued_ms = (m.now() - order.arrived_at) * 1000.0
                    if self.on_admit is not None:
                        self.on_admit(self)
                self.body["model"] = self.service.models[adm.deployment]
                it = m.engines[adm.deployment].generate(
                    GenerationRequest(
                        rid, self.kind, self.body, attempt=order.requeues, stream=self.engine_stream
                    )
                )
                self._engine_iter = it
                try:
                    async for ev in it:
                        if type(ev) is ChunkEvent:
                            chunk = ev.chunk
                            chunk["id"] = rid
                            chunk["model"] = product
                            if chat:
                                for choice in chunk["choices"]:
                                    delta = choice.get("delta")
                                    if delta is not None and other in delta:
                                        delta[target] = delta.pop(other)
                            if self.phase != STREAMING:
                                self.phase = STREAMING
                                self.ttft_ms = (time.perf_counter() - self.t0) * 1000.0
                                m.report_success(adm.deployment)
                            self.tokens += ev.tokens
                            yield ev
                        elif type(ev) is UsageEvent:
                            self.usage_event = ev
                except EngineFailure as failure:
                    self._engine_iter = None
                    if self.phase != STREAMING and failure.transient:
                        if order.requeues < max_requeues:
                            fut = self._fut = await m.requeue(order, adm)
                            self.admission = None
                            yield Requeued(adm.deployment)
                            continue
                        m.report_failure(adm.deployment)
                        yield await self._settled("error", m.failure_after_requeues(failure.message))
                        return
                    err = GatewayError(
                        failure.status, failure.code, failure.message, error_type=failure.error_type
                    )
                    yield await self._settled("error", err)
                    return
                self._engine_iter = None
                yield await self._settled("disconnected" if self.client_left else "completed", None)
                return
        except GatewayError as exc:
            yield await self._settled("timeout" if exc.status == 408 else "error", exc)
        except (asyncio.CancelledError, GeneratorExit):
            await self._abandon()
            raise

    async def _settled(self, outcome: str, error: GatewayError | None) -> Finished:
        fin = self._finish(outcome, error)
        if self.settle_task is not None:
            await asyncio.shield(self.settle_task)
        return fin

    async def abandon(self) -> None:
        """The relay ends without the run having finished (client gone, head not sent)."""
        if self.finished is None:
            await self._abandon()

    async def _abandon(self) -> None:
        """The client left (cancel policy) or the relay stopped: stop the engine,
        give back the slot, record the outcome."""
        if self.finished is not None:
            return
        it = self._engine_iter
        self._engine_iter = None
        if it is not None:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # the engine is being cancelled; its error is moot
                    pass
        if (
            self.phase == QUEUED
            and self.order is not None
            and self._fut is not None
            and self.admission is None
        ):
            self.market.withdraw(self.order, self._fut)
        self._finish("canceled" if not self.client_left else "disconnected", None, notify=True)

    def _finish(self, outcome: str, error: GatewayError | None, notify: bool = True) -> Finished:
        if self.finished is not None:
            return self.finished
        self.phase = DONE
        if self.admission is not None:
            self.market.release(self.admission)
            self.admission = None
        self.service.running.discard(self)
        latency_ms = (time.perf_counter() - self.t0) * 1000.0
        usage = self._usage()
        receipt: dict[str, Any]
        if self.market.policy.receipt_name == "hips":
            receipt = {"latency_ms": round(latency_ms, 3), "outcome": outcome}
        else:
            receipt = {
                "latency_ms": round(latency_ms, 3),
                "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3),
                "outcome": outcome,
            }
        self.finished = fin = Finished(outcome, error, usage, receipt, self.tokens)
        self.settle_task = self.service.spawn(self.service.after_finish(self, fin))
        if notify:
            for hook in self.service.on_finish:
                hook(self, fin)
        return fin

    def _usage(self) -> dict[str, Any]:
        ev = self.usage_event
        order = self.order
        if ev is not None:
            usage: dict[str, Any] = {
                "prompt_tokens": ev.prompt_tokens,
                "completion_tokens": ev.completion_tokens,
                "total_tokens": ev.prompt_tokens + ev.completion_tokens,
            }
            usage.update(ev.details)
        else:
            prompt = estimate_prompt_tokens(self.body) if self.tokens or self.phase >= STREAMING else 0
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens,
                "usage_estimated": True,
            }
        usage["x_market"] = {
            "bid": self.bid,
            "cleared_price": self.cleared_price,
            "level": self.level_at_clear,
            "position_at_entry": order.position_at_entry if order else None,
            "queued_ms": None if self.queued_ms is None else round(self.queued_ms, 3),
            "requeues": order.requeues if order else 0,
            "deployment": self.deployment,
        }
        return usage


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """The gateway's own conservative prompt count when an engine gives none:
    UTF-8 bytes / 4 of the text, plus 4 per message."""
    total = 0
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            total += 4
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                total += len(c.encode()) // 4 + 1
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        total += len(part["text"].encode()) // 4 + 1
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            total += len(p.encode()) // 4 + 1
        elif isinstance(p, list):
            total += sum(len(x.encode()) // 4 + 1 if isinstance(x, str) else 1 for x in p)
    return total
