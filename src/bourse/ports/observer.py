"""The observer port: what the services tell the operator's instruments (metrics,
the access log, warnings, traces), and the null observer that hears nothing.

The services call it at a handful of points, each a plain method call with plain
values: a run's end (:meth:`Observer.run_finished`, once per run, after its
settlement), a request refused before it became a run, a requeue, an upstream
failure, a circuit breaker opening or closing, a hold moved to ``reconciling``, a
webhook's result, the time of a ledger operation, an error talking to the database
or Redis. Tracing is three spans per run at most (the wait in the book, each engine
attempt, the settlement) under one span for the run; a :class:`Span` is also what
hands a ``traceparent`` on to an upstream.

Every method is synchronous, cheap and never raises: the adapter
(:mod:`bourse.observability`) counts in memory on the event loop and writes its
lines in batches. Gauges that read live state (book depth, slots, holds, jobs) are
not pushed here: the adapter reads them when ``/metrics`` is scraped
(:meth:`Observer.scrape`), so the hot path pays nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Attr = str | int | float | bool


class Span(Protocol):
    """One traced operation; :meth:`end` it exactly once."""

    @property
    def traceparent(self) -> str | None:
        """This span's W3C ``traceparent`` header value; None when nothing is traced."""
        ...

    def set(self, key: str, value: Attr) -> None: ...

    def end(self, error: str | None = None) -> None:
        """End the span; ``error`` marks it failed with that description."""
        ...


class NullSpan:
    """The span of an observer that traces nothing."""

    __slots__ = ()

    @property
    def traceparent(self) -> str | None:
        return None

    def set(self, key: str, value: Attr) -> None:
        return None

    def end(self, error: str | None = None) -> None:
        return None


NULL_SPAN = NullSpan()


@dataclass(slots=True)
class Caller:
    """One HTTP request as the edge sees it. The edge makes it (request id, route, start);
    the route fills in the rest as it reads the request."""

    request_id: str
    route: str
    """The route template (``/v1/chat/completions``), never the raw path."""
    started: float
    """``time.perf_counter()`` when the request arrived."""
    correlation_id: str | None = None
    """The client's own ``x-request-id``, kept beside bourse's id (which stays the response id)."""
    traceparent: str | None = None
    """The client's W3C ``traceparent`` header."""
    key_id: str | None = None
    """The API key's public id (``key_…``), once authenticated; never the secret."""
    account_id: str | None = None
    """The key's account, once authenticated."""
    product: str | None = None
    """The product asked for, once known to be one."""


@dataclass(slots=True)
class RunReport:
    """One run's end, settled: everything the access line and the metrics need (its
    fields, in this order, are the access line's; times in milliseconds, to the µs)."""

    method: str | None
    """``POST``; None for a job's run (no HTTP request of its own)."""
    route: str
    """The endpoint (``/v1/chat/completions``, ``/v1/completions``)."""
    status: int
    """The HTTP status the client got (a stream's is its head's, 200; 499: it left
    before a non-streamed answer)."""
    outcome: str
    """The recorded outcome (``completed``, ``error``, ``canceled``, ``disconnected``,
    ``timeout``, ``reconciling``)."""
    request_id: str
    correlation_id: str | None
    key_id: str | None
    product: str
    deployment: str | None
    stream: bool
    detached: bool
    """A job's run."""
    error: str | None
    """The error's code (None: completed)."""
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int
    quote_micros: int
    bid: float
    cleared_price: float | None
    queued_ms: float | None
    """Time in the book before the first admission (None: never admitted)."""
    ttft_ms: float | None
    """From the request to the engine's first output (None: no output)."""
    latency_ms: float
    requeues: int


class Observer(Protocol):
    """Where the services report what the operator watches. Never raises."""

    # -- tracing ---------------------------------------------------------------------

    def start_span(self, name: str, parent: Span | str | None = None, started: float | None = None) -> Span:
        """A span named ``name`` under ``parent`` (a span, or a client's ``traceparent``);
        ``started``: a ``time.perf_counter()`` value, when it began before this call."""
        ...

    # -- runs ------------------------------------------------------------------------

    @property
    def hears_runs(self) -> bool:
        """Whether :meth:`run_finished` counts or writes anything now: when it does not,
        a run builds no report (metrics and the access log off)."""
        ...

    def run_finished(self, report: RunReport) -> None: ...

    def refused(self, caller: Caller, status: int, code: str) -> None:
        """A completion request answered with an HTTP error before it became a run."""
        ...

    def responded(self, method: str, route: str, status: int, seconds: float, caller: Caller | None) -> None:
        """Any other HTTP response (``route``: the matched template, or ``other``)."""
        ...

    def requeued(self, product: str, deployment: str) -> None: ...

    def upstream_failed(
        self, product: str, deployment: str, kind: str, message: str, request_id: str, upstream: str = ""
    ) -> None:
        """An attempt failed; ``upstream``: the engine's own answer (status and bounded
        body) when it refused or failed the request itself."""
        ...

    def breaker_changed(self, product: str, deployment: str, state: str) -> None:
        """``state``: ``open`` (cooling down) or ``closed`` (a trial succeeded)."""
        ...

    # -- money and jobs -------------------------------------------------------------

    def ledger_timed(self, op: str, seconds: float) -> None:
        """One ledger operation (``hold``, ``settle``, ``release``, ``reconcile``) took ``seconds``."""
        ...

    def hold_reconciling(self, hold_id: str, request_id: str, note: str) -> None: ...

    def backend_error(self, backend: str, op: str, error: BaseException) -> None:
        """An error talking to ``backend`` (``database`` or ``redis``) during ``op``."""
        ...

    def webhook_result(self, job_id: str, result: str, detail: str | None = None) -> None:
        """``result``: ``delivered``, ``attempt_failed`` (one attempt failed; another follows
        unless it was the last), ``failed`` (given up, or the target refused) or ``held``
        (not sent: the account's secret cannot be opened with this gateway's key)."""
        ...

    # -- exposition -----------------------------------------------------------------

    async def scrape(self, accept: str | None) -> tuple[bytes, str] | None:
        """The metrics in the format ``accept`` asks for (the Prometheus text format by
        default) and its content type; None when metrics are off."""
        ...

    def close(self) -> None:
        """Write what is buffered (at shutdown)."""
        ...


class NullObserver:
    """The observer that hears nothing (services built without one, unit tests)."""

    __slots__ = ()

    def start_span(self, name: str, parent: Span | str | None = None, started: float | None = None) -> Span:
        return NULL_SPAN

    @property
    def hears_runs(self) -> bool:
        return False

    def run_finished(self, report: RunReport) -> None:
        return None

    def refused(self, caller: Caller, status: int, code: str) -> None:
        return None

    def responded(self, method: str, route: str, status: int, seconds: float, caller: Caller | None) -> None:
        return None

    def requeued(self, product: str, deployment: str) -> None:
        return None

    def upstream_failed(
        self, product: str, deployment: str, kind: str, message: str, request_id: str, upstream: str = ""
    ) -> None:
        return None

    def breaker_changed(self, product: str, deployment: str, state: str) -> None:
        return None

    def ledger_timed(self, op: str, seconds: float) -> None:
        return None

    def hold_reconciling(self, hold_id: str, request_id: str, note: str) -> None:
        return None

    def backend_error(self, backend: str, op: str, error: BaseException) -> None:
        return None

    def webhook_result(self, job_id: str, result: str, detail: str | None = None) -> None:
        return None

    async def scrape(self, accept: str | None) -> tuple[bytes, str] | None:
        return None

    def close(self) -> None:
        return None


NULL_OBSERVER: Observer = NullObserver()
