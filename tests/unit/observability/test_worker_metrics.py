"""``serve --workers``: a scrape of any worker holds every worker's own series (labelled
``worker``) and the cluster's once. Three workers' metrics in one process, each on a
real Unix socket of :class:`~bourse.workers.WorkerChannels`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bourse.observability.metrics import Instruments, LiveState, Metrics
from bourse.observability.worker_metrics import WorkerPeers
from bourse.ports.book import BookView, DeploymentView
from bourse.workers import WorkerChannels

pytestmark = pytest.mark.anyio


class _Book:
    async def view(self) -> BookView:
        return BookView(
            level=0.5, waiting=4, best_bid=None, admitted_total=17,
            deployments=[DeploymentView("p/0", 0.1, 2, 1, True, "closed")],
        )  # fmt: skip


class _Store:
    async def hold_counts(self) -> Mapping[str, tuple[int, int]]:
        return {"open": (3, 300)}

    async def job_counts(self) -> Mapping[str, int]:
        return {}


@pytest.fixture
async def workers() -> AsyncIterator[tuple[list[Metrics], list[WorkerPeers], list[str]]]:
    channels = WorkerChannels(3)
    errors: list[str] = []
    metrics: list[Metrics] = []
    peers: list[WorkerPeers] = []
    for n in range(3):
        m = Metrics(
            Instruments(),
            LiveState({"p": _Book()}, _Store(), lambda b, op, e: errors.append(f"{b}:{op}")),
            worker=n,
        )
        others = {k: path for k, path in enumerate(channels.paths) if k != n}
        m.peers = WorkerPeers(channels.listeners[n], others, m.own, m.live.on_error)
        await m.peers.start()
        metrics.append(m)
        peers.append(m.peers)
    try:
        yield metrics, peers, errors
    finally:
        for p in peers:
            await p.stop()
        channels.close()


async def _scrape(m: Metrics) -> list[tuple[str, dict[str, str], float]]:
    body, _ = await m.scrape(None)
    names = [fam.name for fam in text_string_to_metric_families(body.decode())]
    assert len(names) == len(set(names)), "a family written twice"
    return [
        (s.name, s.labels, s.value)
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    ]


async def test_any_worker_answers_with_every_workers_series_and_the_clusters_once(
    workers: tuple[list[Metrics], list[WorkerPeers], list[str]],
) -> None:
    metrics, _, errors = workers
    for n, m in enumerate(metrics):
        m.instruments.requests.inc(("p", "completed"), n + 1)  # 1, 2 and 3 requests
    for m in metrics:
        got = await _scrape(m)
        requests = {lab["worker"]: v for name, lab, v in got if name == "bourse_requests_total"}
        assert requests == {"0": 1, "1": 2, "2": 3}
        rss = {lab["worker"] for name, lab, _ in got if name == "process_resident_memory_bytes"}
        assert rss == {"0", "1", "2"}
        waiting = [(lab, v) for name, lab, v in got if name == "bourse_book_waiting_orders"]
        assert waiting == [({"product": "p", "scope": "cluster"}, 4)]  # once, no worker label
        holds = [v for name, lab, v in got if name == "bourse_holds" and lab["state"] == "open"]
        assert holds == [3]
    assert errors == []


async def test_a_worker_that_does_not_answer_is_left_out_and_counted(
    workers: tuple[list[Metrics], list[WorkerPeers], list[str]],
) -> None:
    metrics, peers, errors = workers
    await peers[2].stop()
    peers[2].listener.close()
    started = time.monotonic()
    got = await _scrape(metrics[0])
    assert time.monotonic() - started < 1.0
    assert {lab["worker"] for name, lab, _ in got if name == "process_cpu_seconds_total"} == {"0", "1"}
    assert errors == ["worker:scrape"]
