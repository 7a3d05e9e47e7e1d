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


def run_text_parts(r: RunReport) -> tuple[str, str]:
    """The two runs of a run's text line that are the same for every run of its kind
    (method, route, status, outcome, product, deployment, stream, detached, error: all
    bounded), each ending where a per-request field starts: made once per kind."""
    head = (
        f"method={'-' if r.method is None else r.method} route={r.route} status={r.status} "
        f"outcome={r.outcome} request_id="
    )
    mid = (
        f" product={r.product} deployment={'-' if r.deployment is None else r.deployment} "
        f"stream={'true' if r.stream else 'false'} detached={'true' if r.detached else 'false'} "
        f"error={'-' if r.error is None else r.error} prompt_tokens="
    )
    return head, mid


def run_text(
    r: RunReport, parts: tuple[str, str] | None = None, prices: dict[float, str] | None = None
) -> str:
    """A run's access line in the text format: every field, ``-`` when not known.

    ``parts`` are :func:`run_text_parts` of the run's kind (made here when not given);
    ``prices`` caches the text of the bid and the cleared price (a handful of values
    recur: a float's repr costs ~0.2 µs). This runs once per request, on the event loop."""
    head, mid = run_text_parts(r) if parts is None else parts
    bid, cleared = r.bid, r.cleared_price
    if prices is None:
        bid_s, cleared_s = repr(bid), "-" if cleared is None else repr(cleared)
    else:
        bid_s = prices.get(bid) or _price(prices, bid)
        cleared_s = "-" if cleared is None else (prices.get(cleared) or _price(prices, cleared))
    return (
        f"{head}{r.request_id} correlation_id={'-' if r.correlation_id is None else r.correlation_id} "
        f"key_id={'-' if r.key_id is None else r.key_id}{mid}{r.prompt_tokens} "
        f"completion_tokens={r.completion_tokens} cost_micros={r.cost_micros} quote_micros={r.quote_micros} "
        f"bid={bid_s} cleared_price={cleared_s} "
        f"queued_ms={'-' if r.queued_ms is None else r.queued_ms} ttft_ms={'-' if r.ttft_ms is None else r.ttft_ms} "
        f"latency_ms={r.latency_ms} requeues={r.requeues}"
    )


PRICES_KEPT = 1024
"""At most this many prices' texts are cached (then the cache starts again)."""


def _price(prices: dict[float, str], value: float) -> str:
    if len(prices) >= PRICES_KEPT:
        prices.clear()
    text = prices[value] = repr(value)
    return text


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
        self._prices: dict[float, str] = {}
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

    def write_run(
        self, report: RunReport, parts: tuple[str, str] | None = None, at: float | None = None
    ) -> None:
        """A run's line (``at``: when it ended; now if not given), in the batch."""
        line = self.run_line(report, parts, at)
        if line is not None:
            self._add(line)

    def write_lines(self, lines: list[str]) -> None:
        """Lines made by :meth:`run_line`, written at once (a batch of their own)."""
        if lines:
            self._pending.extend(lines)
            self.flush()

    def run_line(
        self, report: RunReport, parts: tuple[str, str] | None = None, at: float | None = None
    ) -> str | None:
        """A run's line (None below INFO): in JSON the report's own fields (``orjson``
        writes the dataclass in C), in text :func:`run_text` (``parts``: its kind's
        :func:`run_text_parts`)."""
        if not self._logger.isEnabledFor(logging.INFO):
            return None
        now = time.time() if at is None else at
        if self.json:
            head = f'{{"ts":"{self._clock.utc(now)}","level":"INFO","logger":"{NAME}","msg":"access",'
            return head + orjson.dumps(report).decode()[1:]
        return f"{self._clock.local(now)} INFO {NAME}: {run_text(report, parts, self._prices)}"

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
