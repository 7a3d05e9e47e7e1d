"""The metrics: instruments counted in memory, exposed through prometheus-client and read
back with its own parser; the live-state gauges read at scrape time."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bourse.observability.metrics import (
    Counts,
    Instruments,
    LiveState,
    Metrics,
    Timings,
    breaker_state,
)
from bourse.ports.book import BookView, Clear, DeploymentView

pytestmark = pytest.mark.anyio


class _Book:
    def __init__(self, view: BookView | None) -> None:
        self._view = view

    async def view(self) -> BookView:
        if self._view is None:
            raise ConnectionError("redis is down")
        return self._view


class _Store:
    async def hold_counts(self) -> Mapping[str, tuple[int, int]]:
        return {"open": (3, 300), "reconciling": (1, 50)}

    async def job_counts(self) -> Mapping[str, int]:
        return {"queued": 2, "succeeded": 5}


def _view() -> BookView:
    return BookView(
        level=0.5,
        waiting=4,
        best_bid=0.5,
        admitted_total=17,
        deployments=[
            DeploymentView("p/0", 0.1, 2, 2, True, "closed"),
            DeploymentView("p/1", 0.2, 3, 0, False, "open"),
            DeploymentView("p/2", 0.2, 1, 0, True, "open"),
        ],
        recent=[Clear(1.0, 0.3, 0.5, "p/0"), Clear(0.5, 0.2, 0.2, "p/0")],
    )


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert isinstance(s, Sample)
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


CLUSTER = ("scope", "cluster")


async def _scrape(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = await metrics.scrape(None)
    assert content_type.startswith("text/plain")
    return _samples(body.decode())


def _metrics(books: Mapping[str, _Book] | None = None, errors: list[str] | None = None) -> Metrics:
    def on_error(backend: str, op: str, exc: BaseException) -> None:
        if errors is not None:
            errors.append(f"{backend}:{op}")

    return Metrics(Instruments(), LiveState(books or {}, _Store(), on_error), process=False)


async def test_counters_and_histograms_are_read_back_by_the_prometheus_parser() -> None:
    m = _metrics()
    i = m.instruments
    i.requests.inc(("p", "completed"))
    i.requests.inc(("p", "completed"))
    i.requests.inc(("p", "refused"))
    i.tokens.inc(("p", "prompt"), 12)
    i.duration.observe(("p",), 0.01)  # on a bucket's bound: counted in that bucket
    i.duration.observe(("p",), 0.3)
    i.duration.observe(("p",), 1000.0)
    got = await _scrape(m)
    assert got[("bourse_requests_total", (("outcome", "completed"), ("product", "p")))] == 2
    assert got[("bourse_requests_total", (("outcome", "refused"), ("product", "p")))] == 1
    assert got[("bourse_tokens_total", (("kind", "prompt"), ("product", "p")))] == 12
    bucket = "bourse_request_duration_seconds_bucket"
    assert got[(bucket, (("le", "0.005"), ("product", "p")))] == 0
    assert got[(bucket, (("le", "0.01"), ("product", "p")))] == 1
    assert got[(bucket, (("le", "0.5"), ("product", "p")))] == 2
    assert got[(bucket, (("le", "300.0"), ("product", "p")))] == 2
    assert got[(bucket, (("le", "+Inf"), ("product", "p")))] == 3
    assert got[("bourse_request_duration_seconds_count", (("product", "p"),))] == 3
    assert got[("bourse_request_duration_seconds_sum", (("product", "p"),))] == pytest.approx(1000.31)


async def test_a_failed_attempt_is_not_the_cleared_price() -> None:
    view = _view()
    view.recent.insert(0, Clear(2.0, 0.1, 0.5, "p/1", None, "r9", 0, failed=True))  # nobody paid it
    got = await _scrape(_metrics({"p": _Book(view)}))
    assert got[("bourse_book_cleared_price_usd_per_million_tokens", (("product", "p"), CLUSTER))] == 0.3
    view.recent = [c for c in view.recent if c.failed]
    got = await _scrape(_metrics({"p": _Book(view)}))
    assert ("bourse_book_cleared_price_usd_per_million_tokens", (("product", "p"), CLUSTER)) not in got


async def test_every_family_is_exposed_even_before_anything_was_counted() -> None:
    body, _ = await _metrics().scrape(None)
    names = {fam.name for fam in text_string_to_metric_families(body.decode())}
    expected = {inst.name for inst in Instruments().all()}
    assert expected <= names
    assert {"bourse_holds", "bourse_jobs", "bourse_book_waiting_orders"} <= names


async def test_live_state_is_read_from_the_books_and_the_store_when_scraped() -> None:
    m = _metrics({"p": _Book(_view())})
    got = await _scrape(m)
    p = (("product", "p"), CLUSTER)  # the shared book's: the same on every replica
    assert got[("bourse_book_waiting_orders", p)] == 4
    assert got[("bourse_book_level_usd_per_million_tokens", p)] == 0.5
    assert got[("bourse_book_best_bid_usd_per_million_tokens", p)] == 0.5
    assert got[("bourse_book_cleared_price_usd_per_million_tokens", p)] == 0.3  # the newest clear
    assert got[("bourse_book_admissions_total", p)] == 17
    dep = (("deployment", "p/0"), ("product", "p"), CLUSTER)
    assert got[("bourse_deployment_slots", dep)] == 2
    assert got[("bourse_deployment_slots_busy", dep)] == 2
    states = [
        got[("bourse_deployment_breaker_state", (("deployment", d), ("product", "p"), CLUSTER))]
        for d in ("p/0", "p/1", "p/2")
    ]
    assert states == [0, 1, 2]  # closed, open (cooling), half-open (cooled down)
    assert (
        got[("bourse_deployment_available", (("deployment", "p/0"), ("product", "p")))] == 1
    )  # this replica's
    assert got[("bourse_holds", (CLUSTER, ("state", "open")))] == 3  # the ledger's
    assert got[("bourse_holds_micro_usd", (CLUSTER, ("state", "reconciling")))] == 50
    assert got[("bourse_jobs", (CLUSTER, ("state", "queued")))] == 2
    assert got[("bourse_jobs", (CLUSTER, ("state", "running")))] == 0


async def test_an_unreachable_book_leaves_its_gauges_out_and_counts_an_error() -> None:
    errors: list[str] = []
    m = _metrics({"up": _Book(_view()), "down": _Book(None)}, errors)
    got = await _scrape(m)
    assert ("bourse_book_waiting_orders", (("product", "up"), CLUSTER)) in got
    assert not any(dict(labels).get("product") == "down" for _, labels in got)
    assert errors == ["redis:book_view"]


async def test_each_app_has_its_own_registry() -> None:
    a, b = _metrics(), _metrics()
    a.instruments.requests.inc(("p", "completed"))
    assert a.registry is not b.registry
    assert ("bourse_requests_total", (("outcome", "completed"), ("product", "p"))) not in await _scrape(b)


async def test_openmetrics_is_served_when_asked_for() -> None:
    body, content_type = await _metrics().scrape("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_breaker_states() -> None:
    assert breaker_state("closed", True) == 0
    assert breaker_state("open", False) == 1
    assert breaker_state("open", True) == 2


def test_instruments_keep_label_values_apart() -> None:
    c = Counts("x", "x", ("a",))
    c.inc(("1",))
    c.inc(("2",), 5)
    assert c.values == {("1",): 1, ("2",): 5}
    t = Timings("y_seconds", "y", (), (1.0, 2.0))
    t.observe((), 2.0)
    t.observe((), 3.0)
    assert t.series[()] == [0, 1, 1, 5.0]
