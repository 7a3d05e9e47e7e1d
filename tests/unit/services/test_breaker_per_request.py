"""A breaker counts one failure per request, not per attempt, and requeues back off:
one request that fails on every attempt cannot take its product down for everyone."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest

from bourse.domain.book import requeue_delay_s
from bourse.domain.breaker import CircuitBreaker
from bourse.services.completion import Finished, Queued, Requeued
from tests.unit.services.exchange import Exchange, product, run_to_end, running

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def exchange(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Exchange]:
    products = {"guarded": product(), "flaky": product()}  # flaky: a breaker that does not open
    dep = products["guarded"]["deployments"][0]
    dep["breaker_threshold"], dep["cooldown_s"] = 3, 60  # the defaults' threshold; a long cool-down
    async with running(tmp_path_factory.mktemp("breaker"), products) as ex:
        yield ex


def breaker(exchange: Exchange) -> CircuitBreaker:
    book = exchange.completions.markets["guarded"].book
    [dep] = book.book.deployments  # type: ignore[attr-defined]  # the in-process book
    b: CircuitBreaker = dep.breaker
    return b


async def test_one_request_failing_on_every_attempt_counts_once(exchange: Exchange) -> None:
    run = await exchange.open("guarded", sim={"fail_before_output": -1})
    events, fin = await run_to_end(run)
    assert [type(ev) for ev in events[1:-1]] == [Requeued] * 3  # max_requeues = 3: four attempts
    assert fin.error is not None and (fin.error.status, fin.error.code) == (502, "upstream_error")
    b = breaker(exchange)
    assert (b.failures, b.state) == (1, "closed")  # four attempts of one request: one failure
    # the next client is served, not told that the product is cooling down
    ok = await exchange.open("guarded")
    _, done = await run_to_end(ok)
    assert done.outcome == "completed" and done.error is None
    assert breaker(exchange).failures == 0


async def test_three_failing_requests_open_the_breaker(exchange: Exchange) -> None:
    for _ in range(3):
        _, fin = await run_to_end(await exchange.open("guarded", sim={"fail_before_output": -1}))
        assert fin.outcome == "error"
    assert breaker(exchange).state == "open"
    breaker(exchange).record_success()  # closed again for the next test


async def test_requeues_back_off_and_the_first_attempt_does_not_wait(exchange: Exchange) -> None:
    loop = asyncio.get_running_loop()
    run = await exchange.open("flaky", sim={"fail_before_output": 3})
    times: list[float] = []
    async for ev in run.events():
        if type(ev) in (Queued, Requeued, Finished):
            times.append(loop.time())
        if type(ev) is Finished:
            assert ev.outcome == "completed"
    assert run.queued_ms is not None and run.queued_ms < 50  # admitted at once
    # each attempt fails at once; its requeue is told after the backoff (the slot held,
    # so that the order keeps its place): from each event to the next, one delay
    gaps = [b - a for a, b in itertools.pairwise(times[:-1])]
    assert len(gaps) == 3
    for n, gap in enumerate(gaps):
        assert gap >= requeue_delay_s(n) * 0.9, (n, gaps)
    assert sum(gaps) < 5
