"""The observer adapter: the :class:`~bourse.ports.observer.Observer` the composition
root builds, counting into the metrics, writing the access log and the WARN lines,
and starting the spans.

Each part can be off (``[server] metrics``, ``access_log``, ``tracing``); the WARN
lines (a breaker opening or closing, an upstream failure, a hold moved to
``reconciling``, a webhook given up) are always written, on the ``bourse.events``
logger, with their facts as fields (keys of their own in the JSON format). An
engine refusing the request itself (``refused``: a prompt over its context) is an
INFO line: the client's doing, not the deployment's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from bourse.observability.access_log import (
    QUIET_ROUTES,
    AccessLog,
    refused_fields,
    response_fields,
)
from bourse.observability.metrics import Instruments, Key, Metrics
from bourse.observability.tracing import Tracer
from bourse.ports.observer import NULL_SPAN, Caller, RunReport, Span

log = logging.getLogger("bourse.events")

UNKNOWN = "unknown"
"""The product label of a request refused before its product was known to be one."""


class _RunKeys:
    """The label values and histogram series one kind of finished run counts into
    (by product, outcome, route, status and detached: bounded, as the labels are),
    made once: counting a run then builds no tuple and looks up no series."""

    __slots__ = ("book_wait", "completion", "duration", "product", "prompt", "request", "response", "ttft")

    def __init__(
        self, i: Instruments, product: str, outcome: str, route: str, status: int, detached: bool
    ) -> None:
        self.request: Key = (product, outcome)
        self.response: Key | None = None if detached else ("POST", route, str(status))
        self.product: Key = (product,)
        self.prompt: Key = (product, "prompt")
        self.completion: Key = (product, "completion")
        self.duration = i.duration.of(self.product)
        self.ttft = i.ttft.of(self.product)
        self.book_wait = i.book_wait.of(self.product)


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
    ) -> None:
        self.metrics = metrics
        self.instruments: Instruments | None = metrics.instruments if metrics is not None else None
        self.access = access
        self.tracer = tracer
        self.database = database
        """The ``backend`` label of ledger errors (``sqlite``, ``postgresql``)."""
        self._run_keys: dict[tuple[str, str, str, int, bool], _RunKeys] = {}
        self._keys_of: Instruments | None = None

    # -- tracing ----------------------------------------------------------------------

    def start_span(self, name: str, parent: Span | str | None = None, started: float | None = None) -> Span:
        if self.tracer is None:
            return NULL_SPAN
        return self.tracer.start(name, parent, started)

    # -- runs and requests ----------------------------------------------------------------

    def run_finished(self, report: RunReport) -> None:
        if self.instruments is not None:
            self._count_run(self.instruments, report)
        if self.access is not None:
            self.access.write_run(report)

    def _count_run(self, i: Instruments, r: RunReport) -> None:
        if self._keys_of is not i:  # (instruments replaced: their series are new)
            self._run_keys, self._keys_of = {}, i
        k = (r.product, r.outcome, r.route, r.status, r.detached)
        keys = self._run_keys.get(k)
        if keys is None:
            keys = self._run_keys[k] = _RunKeys(i, *k)
        i.requests.inc(keys.request)
        if keys.response is not None:
            i.responses.inc(keys.response)
        i.duration.add(keys.duration, r.latency_ms / 1000.0)
        if r.ttft_ms is not None:
            i.ttft.add(keys.ttft, r.ttft_ms / 1000.0)
        if r.queued_ms is not None:
            i.book_wait.add(keys.book_wait, r.queued_ms / 1000.0)
        if r.prompt_tokens:
            i.tokens.inc(keys.prompt, r.prompt_tokens)
        if r.completion_tokens:
            i.tokens.inc(keys.completion, r.completion_tokens)
        if r.cost_micros:
            i.spend.inc(keys.product, r.cost_micros)

    def refused(self, caller: Caller, status: int, code: str) -> None:
        if self.instruments is not None:
            self.instruments.requests.inc((caller.product or UNKNOWN, "refused"))
            self.instruments.responses.inc(("POST", caller.route, str(status)))
        if self.access is not None:
            seconds = time.perf_counter() - caller.started
            self.access.write(refused_fields(caller, status, code, seconds))

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
        self, product: str, deployment: str, kind: str, message: str, request_id: str
    ) -> None:
        if self.instruments is not None:
            self.instruments.upstream_failures.inc((product, deployment, kind))
        fields = {"product": product, "deployment": deployment, "kind": kind, "request_id": request_id}
        # an engine refusing the request itself (a prompt over its context) is the client's doing
        level = logging.INFO if kind == "refused" else logging.WARNING
        log.log(level, "upstream failure on deployment %s (%s): %s; request %s", deployment, kind, message,
                request_id, extra={"fields": fields})  # fmt: skip

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
        if self.instruments is not None:
            self.instruments.ledger.observe((op,), seconds)

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

    # -- exposition ---------------------------------------------------------------------------

    async def scrape(self, accept: str | None) -> tuple[bytes, str] | None:
        if self.metrics is None:
            return None
        return await self.metrics.scrape(accept)

    def close(self) -> None:
        if self.access is not None:
            self.access.flush()
        if self.tracer is not None:
            self.tracer.close()
