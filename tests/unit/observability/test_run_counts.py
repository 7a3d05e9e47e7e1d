"""A finished run's counts (``Observability._count_run``): each kind of run (product,
outcome, route, status, detached) counts into its own label values, exactly, the
same whether its label values and series were made for it just now or before."""

from __future__ import annotations

import asyncio
import datetime
import io
import logging
import time
from dataclasses import replace

import orjson
import pytest

from bourse.observability import observer
from bourse.observability.access_log import AccessLog
from bourse.observability.metrics import Instruments, LiveState, Metrics
from bourse.observability.observer import Observability
from bourse.ports.observer import NullObserver, RunReport

pytestmark = pytest.mark.anyio


class _Store:
    async def hold_counts(self) -> dict[str, tuple[int, int]]:
        return {}

    async def job_counts(self) -> dict[str, int]:
        return {}


RUN = RunReport(
    method="POST", route="/v1/chat/completions", status=200, outcome="completed", request_id="chatcmpl-1",
    correlation_id=None, key_id="key_x", product="p", deployment="p/0", stream=False, detached=False,
    error=None, prompt_tokens=3, completion_tokens=4, cost_micros=7, quote_micros=9, bid=0.5,
    cleared_price=0.5, queued_ms=2.0, ttft_ms=1.5, latency_ms=30.0, requeues=0,
)  # fmt: skip


def _observer() -> tuple[Observability, Instruments]:
    metrics = Metrics(Instruments(), LiveState({}, _Store(), lambda *a: None), process=False)
    return Observability(metrics=metrics), metrics.instruments


def test_each_kind_of_run_counts_into_its_own_labels() -> None:
    obs, i = _observer()
    failed = replace(RUN, outcome="error", status=502, ttft_ms=None, completion_tokens=0, cost_micros=0)
    job = replace(RUN, product="q", detached=True, method=None, queued_ms=None)
    for r in (RUN, failed, RUN, job, RUN):
        obs.run_finished(r)
    assert i.requests.values == {("p", "completed"): 3, ("p", "error"): 1, ("q", "completed"): 1}
    assert i.responses.values == {
        ("POST", "/v1/chat/completions", "200"): 3,
        ("POST", "/v1/chat/completions", "502"): 1,
    }
    assert i.tokens.values == {
        ("p", "prompt"): 12,
        ("p", "completion"): 12,
        ("q", "prompt"): 3,
        ("q", "completion"): 4,
    }
    assert i.spend.values == {("p",): 21, ("q",): 7}
    duration = i.duration.series[("p",)]
    assert sum(duration[:-1]) == 4 and duration[-1] == 4 * 0.030
    assert duration[i.duration.bounds.index(0.05)] == 4  # 30 ms: the 0.05 s bucket
    assert sum(i.ttft.series[("p",)][:-1]) == 3  # the failed run had no first token
    assert sum(i.book_wait.series[("p",)][:-1]) == 4 and sum(i.book_wait.series[("q",)][:-1]) == 0


def test_counts_follow_instruments_that_were_replaced() -> None:
    obs, i = _observer()
    obs.run_finished(RUN)
    fresh = Instruments()
    obs.instruments = fresh
    obs.run_finished(RUN)
    assert i.requests.values == {("p", "completed"): 1}
    assert fresh.requests.values == {("p", "completed"): 1}
    assert sum(fresh.duration.series[("p",)][:-1]) == 1


def test_the_kinds_kept_are_bounded_and_counts_stay_exact() -> None:
    obs, i = _observer()
    statuses = range(100, 100 + observer.KINDS_KEPT + 10)
    for status in statuses:
        obs.run_finished(replace(RUN, status=status))
    obs.run_finished(RUN)
    assert len(obs._kinds) <= observer.KINDS_KEPT
    assert i.requests.values == {("p", "completed"): len(statuses) + 1}
    assert i.responses.values[("POST", "/v1/chat/completions", "200")] == 2
    assert sum(i.duration.series[("p",)][:-1]) == len(statuses) + 1


async def test_on_the_loop_runs_are_counted_and_written_in_batches() -> None:
    out = io.StringIO()
    metrics = Metrics(Instruments(), LiveState({}, _Store(), lambda *a: None), process=False)
    obs = Observability(metrics=metrics, access=AccessLog(json=False, stream=out), batch_s=0.05, batch_max=3)
    i = metrics.instruments
    logging.getLogger("bourse.access").setLevel(logging.INFO)
    obs.run_finished(RUN)
    obs.run_finished(RUN)
    assert i.requests.values == {} and out.getvalue() == ""  # waiting for the batch
    obs.run_finished(RUN)  # a full batch: at once
    assert i.requests.values == {("p", "completed"): 3} and out.getvalue().count("\n") == 3
    obs.run_finished(RUN)
    await asyncio.sleep(0.2)  # the rest within batch_s
    assert i.requests.values == {("p", "completed"): 4} and out.getvalue().count("\n") == 4
    obs.run_finished(RUN)
    exposition, _ = await obs.scrape(None) or (b"", "")
    assert (
        b'bourse_requests_total{outcome="completed",product="p"} 5.0' in exposition
    )  # a scrape counts first
    obs.run_finished(RUN)
    obs.close()  # and so does the shutdown
    assert i.requests.values == {("p", "completed"): 6} and out.getvalue().count("\n") == 6


async def test_a_batched_line_carries_the_time_its_run_ended() -> None:
    out = io.StringIO()
    obs = Observability(access=AccessLog(json=True, stream=out), batch_s=10.0)
    logging.getLogger("bourse.access").setLevel(logging.INFO)
    obs.run_finished(RUN)
    ended = time.time()
    await asyncio.sleep(1.1)
    obs.drain()
    (line,) = out.getvalue().splitlines()
    ts = datetime.datetime.strptime(orjson.loads(line)["ts"], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert abs(ts.replace(tzinfo=datetime.UTC).timestamp() - ended) < 0.5


def test_an_observer_hears_runs_when_it_counts_or_logs_them() -> None:
    assert not NullObserver().hears_runs
    assert not Observability().hears_runs
    assert Observability(access=AccessLog(json=True, stream=io.StringIO())).hears_runs
    metrics = Metrics(Instruments(), LiveState({}, _Store(), lambda *a: None), process=False)
    assert Observability(metrics=metrics).hears_runs
