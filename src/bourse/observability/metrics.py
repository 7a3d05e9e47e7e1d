"""The metrics: what the observer counts, and its Prometheus exposition.

Counters and histograms are updated on the event loop's thread (every hook runs
there), in plain dicts keyed by their label values: an update costs a dict lookup
and an addition (~0.3 µs), where a prometheus-client ``Counter`` child takes a lock
(~1 µs) and a ``Histogram`` two (~2 µs); a request makes about ten updates.
prometheus-client reads them only when ``/metrics`` is scraped: :class:`Metrics` is a
custom collector in a :class:`~prometheus_client.CollectorRegistry` of this app's
own (no module globals), beside the process collector, and prometheus-client writes
the exposition (``choose_encoder``: the text format, or OpenMetrics when asked).

Gauges of live state (book depth, level, cleared price, slots, breakers, holds,
jobs) are read at scrape time by :class:`LiveState` from the markets and the store:
nothing on the hot path keeps them up to date. With the Redis book they are the
shared book's (the view is read from Redis); holds and jobs are the ledger's. Those
are the same on every replica, so they carry ``scope="cluster"`` (docs/operating.md:
aggregate them with ``max``, the replica's own series with ``sum``); a deployment's
``available`` is this replica's probes' verdict and carries no scope, nor does the
wait forecast's score (``bourse_wait_forecast_*``: this replica's orders').

Under ``serve --workers N`` a worker's own series carry ``worker="n"`` and a scrape
holds every worker's (:mod:`~bourse.observability.worker_metrics`); the live state
once.

Every label value is bounded: products, deployments and route templates come from
the config and the route table, outcomes, kinds and results are fixed words, and
statuses are HTTP codes. Never a key, an account or a request id.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from bourse.observability.worker_metrics import ErrorHook, WorkerPeers, labelled, merged
from bourse.ports.book import BookView

log = logging.getLogger("bourse.metrics")

Key = tuple[str, ...]
T = TypeVar("T")

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
LEDGER_BUCKETS = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
SCRAPE_TIMEOUT_S = 5.0
BREAKER_STATES = {"closed": 0, "open": 1, "half_open": 2}
CLUSTER = ("scope", "cluster")
"""The label of a series that is the cluster's, the same on every replica."""


class Counts:
    """A counter family: label values -> total, each total a one-element list (a cell),
    so that a caller counting often into the same label values keeps the cell and adds
    to it without a lookup (:meth:`cell`)."""

    __slots__ = ("cells", "doc", "labels", "name")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name = name
        """Without ``_total`` (prometheus-client adds it)."""
        self.doc = doc
        self.labels = labels
        self.cells: dict[Key, list[float]] = {}

    def cell(self, key: Key) -> list[float]:
        """The cell of ``key`` (made at 0 on first use): ``cell[0] += n`` counts ``n``."""
        c = self.cells.get(key)
        if c is None:
            c = self.cells[key] = [0]
        return c

    def inc(self, key: Key, by: float = 1) -> None:
        self.cell(key)[0] += by

    @property
    def values(self) -> dict[Key, float]:
        """Label values -> total."""
        return {key: c[0] for key, c in self.cells.items()}

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, c in self.cells.items():
            fam.add_metric(key, c[0])
        return fam


class Timings:
    """A histogram family: label values -> per-bucket counts (not cumulative), then the sum."""

    __slots__ = ("bounds", "doc", "labels", "name", "series")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...], bounds: tuple[float, ...]) -> None:
        self.name = name
        self.doc = doc
        self.labels = labels
        self.bounds = bounds
        self.series: dict[Key, list[float]] = {}

    def observe(self, key: Key, value: float) -> None:
        self.add(self.of(key), value)

    def add(self, s: list[float], value: float) -> None:
        """Count ``value`` into the series ``s`` (one of :meth:`of`'s)."""
        s[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        s[-1] += value

    def of(self, key: Key) -> list[float]:
        """The series of ``key`` (made empty on first use): its per-bucket counts, then the sum."""
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = [0.0] * (len(self.bounds) + 2)
        return s

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        names = [*(repr(b) for b in self.bounds), "+Inf"]
        for key, s in self.series.items():
            running = 0.0
            buckets = []
            for name, n in zip(names, s, strict=False):
                running += n
                buckets.append((name, running))
            fam.add_metric(key, buckets, s[-1])
        return fam


class Instruments:
    """Every counter and histogram bourse keeps, by name (see docs/operating.md)."""

    def __init__(self) -> None:
        self.requests = Counts(
            "bourse_requests", "Completion requests by product and outcome (refused: answered an HTTP "
            "error before entering the book).", ("product", "outcome"),
        )  # fmt: skip
        self.responses = Counts(
            "bourse_http_responses", "HTTP responses by method, route template and status.",
            ("method", "route", "status"),
        )  # fmt: skip
        self.duration = Timings(
            "bourse_request_duration_seconds", "A run's latency, from its request to its end, by product.",
            ("product",), DURATION_BUCKETS,
        )  # fmt: skip
        self.ttft = Timings(
            "bourse_time_to_first_token_seconds", "From the request to the engine's first output, by product.",
            ("product",), TTFT_BUCKETS,
        )  # fmt: skip
        self.book_wait = Timings(
            "bourse_book_wait_seconds", "Time an order waited in the book for its first slot, by product.",
            ("product",), WAIT_BUCKETS,
        )  # fmt: skip
        self.tokens = Counts(
            "bourse_tokens", "Tokens of finished runs by product and kind (prompt, completion).",
            ("product", "kind"),
        )  # fmt: skip
        self.spend = Counts(
            "bourse_spend_micro_usd", "Money charged, in micro-USD, by product.", ("product",)
        )
        self.upstream_failures = Counts(
            "bourse_upstream_failures", "Engine failures by product, deployment and kind.",
            ("product", "deployment", "kind"),
        )  # fmt: skip
        self.requeues = Counts(
            "bourse_requeues", "Orders put back in the book after a transient failure, by the deployment that failed.",
            ("product", "deployment"),
        )  # fmt: skip
        self.breaker_changes = Counts(
            "bourse_breaker_transitions", "Circuit breakers opening and closing, by deployment.",
            ("product", "deployment", "state"),
        )  # fmt: skip
        self.ledger = Timings(
            "bourse_ledger_operation_seconds", "Ledger operations (hold, settle, release, reconcile) by op.",
            ("op",), LEDGER_BUCKETS,
        )  # fmt: skip
        self.reconciling = Counts(
            "bourse_holds_to_reconciling", "Holds this replica moved to reconciling.", ()
        )
        self.webhooks = Counts(
            "bourse_webhook_deliveries", "Webhook deliveries by result (delivered, attempt_failed, failed: given up).",
            ("result",),
        )  # fmt: skip
        self.backend_errors = Counts(
            "bourse_backend_errors", "Errors talking to the database or Redis, by backend and operation.",
            ("backend", "op"),
        )  # fmt: skip

    def all(self) -> list[Counts | Timings]:
        return [v for v in vars(self).values() if isinstance(v, Counts | Timings)]


# -- live state, read when scraped ------------------------------------------------------


class BookSource(Protocol):
    async def view(self) -> BookView: ...


class GaugeStore(Protocol):
    async def hold_counts(self) -> Mapping[str, tuple[int, int]]:
        """Open and reconciling holds: state -> (count, micro-USD)."""
        ...

    async def job_counts(self) -> Mapping[str, int]:
        """Jobs by status."""
        ...


@dataclass(slots=True)
class Snapshot:
    views: dict[str, BookView] = field(default_factory=dict)
    holds: Mapping[str, tuple[int, int]] | None = None
    jobs: Mapping[str, int] | None = None


class LiveState:
    """The gauges read from the markets and the store at scrape time."""

    def __init__(
        self, books: Mapping[str, BookSource], store: GaugeStore | None, on_error: ErrorHook
    ) -> None:
        self.books = books
        self.store = store
        self.on_error = on_error
        self.snapshot = Snapshot()

    async def refresh(self) -> None:
        snap = Snapshot()
        views = await asyncio.gather(*(self._view(p, b) for p, b in self.books.items()))
        snap.views = {p: v for p, v in zip(self.books, views, strict=True) if v is not None}
        if self.store is not None:
            snap.holds = await self._read("hold_counts", self.store.hold_counts)
            snap.jobs = await self._read("job_counts", self.store.job_counts)
        self.snapshot = snap

    async def _view(self, product: str, book: BookSource) -> BookView | None:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                return await book.view()
        except Exception as exc:  # the shared book is unreachable: its gauges are left out
            self.on_error("redis", "book_view", exc)
            return None

    async def _read(self, op: str, read: Callable[[], Awaitable[T]]) -> T | None:
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                return await read()
        except Exception as exc:
            self.on_error("database", op, exc)
            return None

    def families(self) -> Iterator[Metric]:
        snap = self.snapshot
        yield from book_families(snap.views)
        if snap.holds is not None:
            count = GaugeMetricFamily(
                "bourse_holds", "Open and reconciling holds (the ledger's).", labels=["state", "scope"]
            )
            micros = GaugeMetricFamily(
                "bourse_holds_micro_usd",
                "Money in open and reconciling holds, in micro-USD.",
                labels=["state", "scope"],
            )
            for state in ("open", "reconciling"):
                n, m = snap.holds.get(state, (0, 0))
                count.add_metric([state, CLUSTER[1]], n)
                micros.add_metric([state, CLUSTER[1]], m)
            yield count
            yield micros
        if snap.jobs is not None:
            jobs = GaugeMetricFamily("bourse_jobs", "Jobs by state (the store's).", labels=["state", "scope"])
            for state in ("queued", "running", "succeeded", "failed", "canceled", "expired"):
                jobs.add_metric([state, CLUSTER[1]], snap.jobs.get(state, 0))
            yield jobs


def breaker_state(breaker: str, healthy: bool, available: bool = True) -> int:
    """0 closed, 1 open (cooling down, or unavailable: its probes fail, idle or not),
    2 half-open (cooled down; the next admission is a trial)."""
    if not available:
        return BREAKER_STATES["open"]
    if breaker == "closed":
        return BREAKER_STATES["closed"]
    return BREAKER_STATES["half_open"] if healthy else BREAKER_STATES["open"]


def book_families(views: Mapping[str, BookView]) -> Iterator[Metric]:
    p, pd = ["product", "scope"], ["product", "deployment", "scope"]
    waiting = GaugeMetricFamily("bourse_book_waiting_orders", "Orders waiting in the book.", labels=p)
    level = GaugeMetricFamily(
        "bourse_book_level_usd_per_million_tokens", "The price a new order must bid to be next.", labels=p
    )
    best = GaugeMetricFamily(
        "bourse_book_best_bid_usd_per_million_tokens", "The best bid waiting (absent: none).", labels=p
    )
    cleared = GaugeMetricFamily(
        "bourse_book_cleared_price_usd_per_million_tokens",
        "The price of the last admission that cleared (a failed attempt, which nobody paid, does not).",
        labels=p,
    )
    admitted = CounterMetricFamily("bourse_book_admissions", "Orders the book has admitted.", labels=p)
    slots = GaugeMetricFamily(
        "bourse_deployment_slots", "Concurrent generations a deployment runs.", labels=pd
    )
    busy = GaugeMetricFamily("bourse_deployment_slots_busy", "Slots running a generation now.", labels=pd)
    breaker = GaugeMetricFamily(
        "bourse_deployment_breaker_state",
        "Circuit breaker: 0 closed, 1 open (also while the deployment is unavailable), 2 half-open.",
        labels=pd,
    )
    available = GaugeMetricFamily(
        "bourse_deployment_available",
        "1 while this replica's probes of the deployment pass, 0 while it is unavailable.",
        labels=["product", "deployment"],
    )
    c = CLUSTER[1]
    for product, v in views.items():
        waiting.add_metric([product, c], v.waiting)
        level.add_metric([product, c], v.level)
        if v.best_bid is not None:
            best.add_metric([product, c], v.best_bid)
        last = next((r for r in v.recent if not r.failed), None)
        if last is not None:
            cleared.add_metric([product, c], last.price)
        admitted.add_metric([product, c], v.admitted_total)
        for d in v.deployments:
            slots.add_metric([product, d.name, c], d.slots)
            busy.add_metric([product, d.name, c], d.busy)
            breaker.add_metric([product, d.name, c], breaker_state(d.breaker, d.healthy, d.available))
            available.add_metric([product, d.name], 1 if d.available else 0)
    yield from (waiting, level, best, cleared, admitted, slots, busy, breaker, available)
    yield from forecast_families(views)


def forecast_families(views: Mapping[str, BookView]) -> Iterator[Metric]:
    """The wait forecast's score over its recent window, per product: this replica's own
    (its orders' predicted and actual waits), so no ``scope``."""
    p = ["product"]
    scored = GaugeMetricFamily(
        "bourse_wait_forecast_scored_orders",
        "Orders whose predicted wait was scored against their actual wait, in the recent window.",
        labels=p,
    )
    error = GaugeMetricFamily(
        "bourse_wait_forecast_abs_error_seconds",
        "Median absolute error of the predicted waits in the recent window (absent: none scored).",
        labels=p,
    )
    within = GaugeMetricFamily(
        "bourse_wait_forecast_within_2x_ratio",
        "Share of the recent window's orders whose wait was predicted within a factor of 2.",
        labels=p,
    )
    median = GaugeMetricFamily(
        "bourse_wait_forecast_median_wait_seconds",
        "Median actual wait of the recent window's scored orders (the scale of the error).",
        labels=p,
    )
    for product, v in views.items():
        f = v.forecast
        if f is None:
            continue
        scored.add_metric([product], f.orders)
        if f.median_abs_error_s is not None:
            error.add_metric([product], f.median_abs_error_s)
        if f.within_2x is not None:
            within.add_metric([product], f.within_2x)
        if f.median_wait_s is not None:
            median.add_metric([product], f.median_wait_s)
    yield from (scored, error, within, median)


# -- the exposition -------------------------------------------------------------------------


class Metrics:
    """This app's registry: the instruments, the live state and the process collector;
    under ``serve --workers`` (``worker``: this one's number) its peers' series too."""

    def __init__(
        self, instruments: Instruments, live: LiveState, *, process: bool = True, worker: int | None = None
    ) -> None:
        self.instruments = instruments
        self.live = live
        self.process = ProcessCollector(registry=None) if process else None
        self.worker = worker
        self.peers: WorkerPeers | None = None
        """The other workers (set with ``worker``)."""
        self._theirs: list[list[Metric]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._lock = asyncio.Lock()

    def own(self) -> list[Metric]:
        """This process's series: counters, histograms, the process collector's
        (labelled ``worker`` under ``serve --workers``)."""
        fams: list[Metric] = [inst.family() for inst in self.instruments.all()]
        if self.process is not None:
            fams.extend(self.process.collect())
        if self.worker is not None:
            fams = list(labelled(fams, "worker", str(self.worker)))
        return fams

    def collect(self) -> Iterable[Metric]:
        if self.worker is None:
            yield from self.own()
        else:
            yield from merged([self.own(), *self._theirs])
        yield from self.live.families()

    async def scrape(self, accept: str | None) -> tuple[bytes, str]:
        """Read the live state (and the other workers' series), then the exposition in
        the format ``accept`` asks for."""
        encoder, content_type = choose_encoder(accept or "")
        async with self._lock:  # one scrape at a time reads and writes the snapshot
            if self.peers is not None:
                self._theirs, _ = await asyncio.gather(self.peers.gather(), self.live.refresh())
            else:
                await self.live.refresh()
            try:
                return encoder(self.registry), content_type
            finally:
                self._theirs = []
