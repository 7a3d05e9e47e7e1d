"""The observer adapter: the :class:`~bourse.ports.observer.Observer` the composition
root builds, counting into the metrics, writing the access log and the WARN lines,
and starting the spans.

Each part can be off (``[server] metrics``, ``access_log``, ``tracing``); the WARN
lines (a breaker opening or closing, an upstream failure, a hold moved to
``reconciling``, a webhook given up) are always written, on the ``bourse.events``
logger, with their facts as fields (keys of their own in the JSON format). An
engine refusing the request itself (``refused``: a prompt over its context) is an
INFO line: the client's doing, not the deployment's.

A finished run is counted and its access line written in a batch, not in the run's
own task: :meth:`Observability.run_finished` keeps the report (and when it came) and
:meth:`Observability.drain` counts and writes the batch, at most ``batch_s`` (0.1 s)
after its first run, at once when ``batch_max`` (256) wait, before every scrape (so
``/metrics`` counts every run that ended before it) and at shutdown. The run's answer
does not wait for it, and the formatting runs warm, many lines at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from bourse.observability.access_log import (
    QUIET_ROUTES,
    AccessLog,
    refused_fields,
    response_fields,
    run_text_parts,
)
from bourse.observability.metrics import Instruments, Metrics
from bourse.observability.tracing import Tracer
from bourse.ports.observer import NULL_SPAN, Caller, RunReport, Span

log = logging.getLogger("bourse.events")

UNKNOWN = "unknown"
"""The product label of a request refused before its product was known to be one."""


class _RunKind:
    """What one kind of finished run counts into and starts its access line with (a kind:
    its method, route, status, outcome, product, deployment, stream, detached and error,
    every one bounded), made once per kind: counting a run then builds no label tuple and
    looks up no series, and its text line formats only the per-request fields."""

    __slots__ = (
        "book_wait",
        "completion",
        "duration",
        "prompt",
        "request",
        "response",
        "spend",
        "text",
        "ttft",
    )

    def __init__(self, i: Instruments | None, r: RunReport, text: bool) -> None:
        self.text: tuple[str, str] | None = run_text_parts(r) if text else None
        if i is None:
            return
        product = (r.product,)
        self.request = i.requests.cell((r.product, r.outcome))
        self.response = None if r.detached else i.responses.cell(("POST", r.route, str(r.status)))
        self.prompt = i.tokens.cell((r.product, "prompt"))
        self.completion = i.tokens.cell((r.product, "completion"))
        self.spend = i.spend.cell(product)
        self.duration = i.duration.of(product)
        self.ttft = i.ttft.of(product)
        self.book_wait = i.book_wait.of(product)


RunKindKey = tuple[str | None, str, int, str, str, str | None, bool, bool, str | None]

KINDS_KEPT = 4096
"""At most this many kinds of run are kept (each label bounded; a guard all the same)."""


def _count(i: Instruments, kind: _RunKind, r: RunReport) -> None:
    """Count one finished run into its kind's cells and series."""
    kind.request[0] += 1
    if kind.response is not None:
        kind.response[0] += 1
    i.duration.add(kind.duration, r.latency_ms / 1000.0)
    if r.ttft_ms is not None:
        i.ttft.add(kind.ttft, r.ttft_ms / 1000.0)
    if r.queued_ms is not None:
        i.book_wait.add(kind.book_wait, r.queued_ms / 1000.0)
    if r.prompt_tokens:
        kind.prompt[0] += r.prompt_tokens
    if r.completion_tokens:
        kind.completion[0] += r.completion_tokens
    if r.cost_micros:
        kind.spend[0] += r.cost_micros


def _warn(message: str, *args: object, **fields: Any) -> None:
    log.warning(message, *args, extra={"fields": fields})


class Observability:
    """Metrics, access log, WARN lines and traces, each optional."""

    def __init__(
        self,
        *,
        metrics: Metrics | None = None,
        access: AccessLog | None = None,
        tracer: Tracer | None = None,
        database: str = "database",
        batch_s: float = 0.1,
        batch_max: int = 256,
    ) -> None:
        self.metrics = metrics
        self.instruments: Instruments | None = metrics.instruments if metrics is not None else None
        self.access = access
        self.tracer = tracer
        self.database = database
        """The ``backend`` label of ledger errors (``sqlite``, ``postgresql``)."""
        self.batch_s = batch_s
        self.batch_max = batch_max
        self._finished: list[tuple[RunReport, float]] = []
        """Finished runs (and when) not yet counted and written: see :meth:`drain`."""
        self._timer: asyncio.TimerHandle | None = None
        self._kinds: dict[RunKindKey, _RunKind] = {}
        self._ledger: dict[str, list[float]] = {}
        self._cached_for: tuple[Instruments | None, AccessLog | None] = (None, None)
        """The instruments and access log the cached kinds and ledger series are of."""
        self.on_refused: list[Callable[[Caller, int, str], None]] = []
        """Told of each request refused before it became a run (the dashboard's list)."""

    # -- tracing ----------------------------------------------------------------------

    def start_span(self, name: str, parent: Span | str | None = None, started: float | None = None) -> Span:
        if self.tracer is None:
            return NULL_SPAN
        return self.tracer.start(name, parent, started)

    # -- runs and requests ----------------------------------------------------------------

    @property
    def hears_runs(self) -> bool:
        return self.instruments is not None or self.access is not None

    def run_finished(self, report: RunReport) -> None:
        if not self.hears_runs:
            return
        q = self._finished
        q.append((report, time.time()))
        if len(q) >= self.batch_max:
            self.drain()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): count it at once
                self.drain()
                return
            self._timer = loop.call_later(self.batch_s, self.drain)

    def drain(self) -> None:
        """Count and write the finished runs not yet counted (at most ``batch_s`` after
        the first of them, at ``batch_max`` of them, before a scrape and at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        q = self._finished
        if not q:
            return
        self._finished = []
        self._check_cache()
        i, access = self.instruments, self.access
        lines: list[str] = []
        for r, at in q:
            k = (
                r.method,
                r.route,
                r.status,
                r.outcome,
                r.product,
                r.deployment,
                r.stream,
                r.detached,
                r.error,
            )
            kind = self._kinds.get(k)
            if kind is None:
                kind = self._kind(k, r)
            if i is not None:
                _count(i, kind, r)
            if access is not None:
                line = access.run_line(r, kind.text, at)
                if line is not None:
                    lines.append(line)
        if access is not None:
            access.write_lines(lines)

    def _kind(self, k: RunKindKey, r: RunReport) -> _RunKind:
        """The kind of run ``r`` is, made (and kept) on its first run (the cache was
        checked against replaced instruments and access log by the caller)."""
        if len(self._kinds) >= KINDS_KEPT:
            self._kinds = {}
        kind = self._kinds[k] = _RunKind(
            self.instruments, r, self.access is not None and not self.access.json
        )
        return kind

    def refused(self, caller: Caller, status: int, code: str) -> None:
        if self.instruments is not None:
            self.instruments.requests.inc((caller.product or UNKNOWN, "refused"))
            self.instruments.responses.inc(("POST", caller.route, str(status)))
        if self.access is not None:
            seconds = time.perf_counter() - caller.started
            self.access.write(refused_fields(caller, status, code, seconds))
        for hook in self.on_refused:
            hook(caller, status, code)

    def responded(self, method: str, route: str, status: int, seconds: float, caller: Caller | None) -> None:
        if self.instruments is not None:
            self.instruments.responses.inc((method, route, str(status)))
        if self.access is not None:
            level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO
            self.access.write(response_fields(method, route, status, seconds, caller), level)

    def requeued(self, product: str, deployment: str) -> None:
        if self.instruments is not None:
            self.instruments.requeues.inc((product, deployment))

    def upstream_failed(
        self, product: str, deployment: str, kind: str, message: str, request_id: str, upstream: str = ""
    ) -> None:
        if self.instruments is not None:
            self.instruments.upstream_failures.inc((product, deployment, kind))
        fields = {"product": product, "deployment": deployment, "kind": kind, "request_id": request_id}
        # a refusal too (a prompt over its context: the client's doing, but the engine's word
        # is the operator's to see, with its status and body)
        said = f"; the engine answered {upstream}" if upstream else ""
        if upstream:
            fields["upstream"] = upstream
        _warn("upstream failure on deployment %s (%s): %s; request %s%s", deployment, kind, message,
              request_id, said, **fields)  # fmt: skip

    def breaker_changed(self, product: str, deployment: str, state: str) -> None:
        if self.instruments is not None:
            self.instruments.breaker_changes.inc((product, deployment, state))
        verb = "opened (cooling down)" if state == "open" else "closed"
        _warn(
            "circuit breaker of deployment %s %s", deployment, verb,
            product=product, deployment=deployment, breaker=state,
        )  # fmt: skip

    # -- money and jobs ---------------------------------------------------------------------

    def ledger_timed(self, op: str, seconds: float) -> None:
        i = self.instruments
        if i is not None:
            series = self._ledger.get(op)
            if series is None or self._cached_for[0] is not i:
                self._check_cache()
                series = self._ledger[op] = i.ledger.of((op,))
            i.ledger.add(series, seconds)

    def _check_cache(self) -> None:
        """Forget the cached kinds and series if the instruments or the access log were
        replaced since they were made (their cells are not the new ones')."""
        now = (self.instruments, self.access)
        if self._cached_for[0] is not now[0] or self._cached_for[1] is not now[1]:
            self._kinds, self._ledger, self._cached_for = {}, {}, now

    def hold_reconciling(self, hold_id: str, request_id: str, note: str) -> None:
        if self.instruments is not None:
            self.instruments.reconciling.inc(())
        _warn(
            "hold %s of request %s moved to reconciling: %s", hold_id, request_id, note,
            hold_id=hold_id, request_id=request_id,
        )  # fmt: skip

    def backend_error(self, backend: str, op: str, error: BaseException) -> None:
        name = self.database if backend == "database" else backend
        if self.instruments is not None:
            self.instruments.backend_errors.inc((name, op))
        log.debug("%s error during %s: %s", name, op, error)

    def webhook_result(self, job_id: str, result: str, detail: str | None = None) -> None:
        if self.instruments is not None:
            self.instruments.webhooks.inc((result,))
        if result == "failed":
            _warn("webhook of job %s failed: %s", job_id, detail or "given up", job_id=job_id)
        elif result == "held":
            _warn(
                "webhook of job %s held: %s", job_id, detail or "its secret cannot be opened", job_id=job_id
            )

    # -- exposition ---------------------------------------------------------------------------

    async def scrape(self, accept: str | None) -> tuple[bytes, str] | None:
        if self.metrics is None:
            return None
        self.drain()
        return await self.metrics.scrape(accept)

    def close(self) -> None:
        self.drain()
        if self.access is not None:
            self.access.flush()
        if self.tracer is not None:
            self.tracer.close()
