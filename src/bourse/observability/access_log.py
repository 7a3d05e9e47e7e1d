"""The access log: one line per finished request, at INFO, on the ``bourse.access`` logger.

A run's line carries the fields of its :class:`~bourse.ports.observer.RunReport`:
its request id, the client's correlation id (its own ``x-request-id``), the API
key's public id (never the secret), the product, the deployment, the outcome, the
status, the tokens, the cost, the bid, the cleared price, the time to the first
token, the latency and the requeues (text: every field, ``-`` when not known; JSON:
``null``). A request refused before the book carries what was known by then; any
other HTTP request its method, route, status and latency (health checks and
scrapes at DEBUG).

The lines have the shape of every other log line (:mod:`bourse.observability.logs`:
``text`` or ``json``), but are not written through a ``logging`` handler: a record
costs ~10 µs (a ``LogRecord``, the caller's frame, a lock, a write and a flush per
line). They are formatted here (one f-string, or ``orjson`` over the report) and
written in batches, at most
``flush_s`` after the first line of a batch, or at once when ``max_pending`` lines
wait, and at shutdown. The ``bourse.access`` logger's level still decides: below
INFO (e.g. ``log_level = "warning"``) nothing is written.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any, TextIO

import orjson

from bourse.observability.logs import Clock
from bourse.ports.observer import Caller, RunReport

NAME = "bourse.access"
QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})
"""Probes and scrapes: logged at DEBUG, not INFO."""


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def run_text(r: RunReport) -> str:
    """A run's access line in the text format: every field, ``-`` when not known (the
    conditionals inline: this runs once per request, on the event loop)."""
    return (
        f"method={'-' if r.method is None else r.method} route={r.route} status={r.status} "
        f"outcome={r.outcome} request_id={r.request_id} "
        f"correlation_id={'-' if r.correlation_id is None else r.correlation_id} "
        f"key_id={'-' if r.key_id is None else r.key_id} product={r.product} "
        f"deployment={'-' if r.deployment is None else r.deployment} stream={'true' if r.stream else 'false'} "
        f"detached={'true' if r.detached else 'false'} error={'-' if r.error is None else r.error} "
        f"prompt_tokens={r.prompt_tokens} completion_tokens={r.completion_tokens} cost_micros={r.cost_micros} "
        f"quote_micros={r.quote_micros} bid={r.bid} "
        f"cleared_price={'-' if r.cleared_price is None else r.cleared_price} "
        f"queued_ms={'-' if r.queued_ms is None else r.queued_ms} ttft_ms={'-' if r.ttft_ms is None else r.ttft_ms} "
        f"latency_ms={r.latency_ms} requeues={r.requeues}"
    )


def refused_fields(c: Caller, status: int, code: str, seconds: float) -> dict[str, Any]:
    return {
        "method": "POST",
        "route": c.route,
        "status": status,
        "outcome": "refused",
        "request_id": c.request_id,
        "correlation_id": c.correlation_id,
        "key_id": c.key_id,
        "product": c.product,
        "error": code,
        "latency_ms": _ms(seconds),
    }


def response_fields(method: str, route: str, status: int, seconds: float, c: Caller | None) -> dict[str, Any]:
    return {
        "method": method,
        "route": route,
        "status": status,
        "request_id": None if c is None else c.request_id,
        "correlation_id": None if c is None else c.correlation_id,
        "key_id": None if c is None else c.key_id,
        "latency_ms": _ms(seconds),
    }


def _text_value(v: Any) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    return str(v)


class AccessLog:
    """Formats access lines and writes them to ``stream`` (stderr) in batches."""

    def __init__(
        self, *, json: bool, stream: TextIO | None = None, flush_s: float = 0.1, max_pending: int = 256
    ) -> None:
        self.json = json
        self._stream = stream
        self.flush_s = flush_s
        self.max_pending = max_pending
        self._logger = logging.getLogger(NAME)
        self._clock = Clock()
        self._pending: list[str] = []
        self._timer: asyncio.TimerHandle | None = None

    def enabled(self, level: int = logging.INFO) -> bool:
        return self._logger.isEnabledFor(level)

    def write(self, fields: dict[str, Any], level: int = logging.INFO) -> None:
        """One line of ``fields`` (those that are None left out)."""
        if not self._logger.isEnabledFor(level):
            return
        now = time.time()
        name = logging.getLevelName(level)
        if self.json:
            doc: dict[str, Any] = {"ts": self._clock.utc(now), "level": name, "logger": NAME, "msg": "access"}
            doc.update((k, v) for k, v in fields.items() if v is not None)
            line = orjson.dumps(doc).decode()
        else:
            body = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None)
            line = f"{self._clock.local(now)} {name} {NAME}: {body}"
        self._add(line)

    def write_run(self, report: RunReport) -> None:
        """A run's line: in JSON the report's own fields (``orjson`` writes the dataclass
        in C), in text :func:`run_text`."""
        if not self._logger.isEnabledFor(logging.INFO):
            return
        now = time.time()
        if self.json:
            head = f'{{"ts":"{self._clock.utc(now)}","level":"INFO","logger":"{NAME}","msg":"access",'
            self._add(head + orjson.dumps(report).decode()[1:])
        else:
            self._add(f"{self._clock.local(now)} INFO {NAME}: {run_text(report)}")

    def _add(self, line: str) -> None:
        self._pending.append(line)
        if len(self._pending) >= self.max_pending:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): write at once
                self.flush()
                return
            self._timer = loop.call_later(self.flush_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        text = "\n".join(self._pending) + "\n"
        self._pending.clear()
        stream = self._stream or sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: lines are lost, serving goes on
            pass
