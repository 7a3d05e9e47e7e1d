"""The drain (issue 13 item 4, issue 14 item 9) and fail fast (issue 13 item 5), through
the real services in process.

- A drain refuses new runs (503 ``draining``), ends waiting orders at once with that
  error (nothing charged), lets running ones finish within its timeout, and ends those
  still running at the deadline with the error, settled by their policy.
- A detached job is handed back: its hold released without a usage record, the job
  stored queued with no owner.
- A run stopped before it began reading gives back the slot it was admitted to.
- With every breaker of a product open, a request is refused at once (503
  ``no_capacity``, ``retry-after`` = the cool-down left) before any hold, and a run whose
  failure opened the last breaker ends at once instead of waiting for the cool-down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.types import Message

from bourse.domain.errors import GatewayError, draining
from bourse.http.relay import RunResponse
from bourse.services.completion import Finished, Phase, Queued, Run, RunEvent
from bourse.services.drain import Drain
from tests.unit.services.exchange import ACCOUNT, MICROS_PER_TOKEN, Exchange, product, running, until

pytestmark = pytest.mark.anyio

COOLDOWN_S = 30.0
PRODUCTS: dict[str, dict[str, Any]] = {
    "default": product(),
    "charges-errors": product(charge_on_error="generated"),
    "fragile": {
        "max_output_tokens": 64,
        "deployments": [
            {
                "engine": "sim",
                "slots": 2,
                "floor": 10.0,
                "breaker_threshold": 1,
                "cooldown_s": COOLDOWN_S,
                "fail_before_output": -1,
            }
        ],
    },
}


@pytest.fixture
async def exchange(tmp_path: Path) -> AsyncIterator[Exchange]:
    """An exchange of its own per test: a drain is for good."""
    async with running(tmp_path, PRODUCTS) as ex:
        yield ex


async def consume(run: Run, seen: list[RunEvent]) -> None:
    async for ev in run.events():
        seen.append(ev)


def finished(seen: list[RunEvent]) -> Finished:
    assert seen and isinstance(seen[-1], Finished), seen
    return seen[-1]


async def test_a_drain_ends_waiting_orders_and_lets_running_ones_finish(exchange: Exchange) -> None:
    running_run = await exchange.open("default", sim={"ttft_ms": 100, "tokens_per_s": 100}, max_tokens=10)
    waiting_run = await exchange.open("default")
    seen_running: list[RunEvent] = []
    seen_waiting: list[RunEvent] = []
    tasks = [
        asyncio.create_task(consume(running_run, seen_running)),
        asyncio.create_task(consume(waiting_run, seen_waiting)),
    ]
    await until(lambda: running_run.phase >= Phase.ADMITTED and waiting_run.phase is Phase.QUEUED)
    drain = Drain(exchange.completions, exchange.container.jobs, timeout_s=30)
    await drain()
    await asyncio.gather(*tasks)

    fin = finished(seen_waiting)
    assert fin.error is not None and (fin.error.status, fin.error.code) == (503, "draining"), fin
    assert fin.error.headers["retry-after"] == "2"
    assert (await exchange.hold(waiting_run)).state == "released"
    fin = finished(seen_running)
    assert fin.error is None and fin.outcome == "completed" and fin.usage["completion_tokens"] == 10
    assert (await exchange.hold(running_run)).state == "settled"
    assert not exchange.completions.live
    assert await exchange.busy("default") == (0, 0)
    with pytest.raises(GatewayError) as refused:
        await exchange.open("default")
    assert (refused.value.status, refused.value.code) == (503, "draining")


async def test_at_the_deadline_a_running_run_ends_with_the_error_settled_by_its_policy(
    exchange: Exchange,
) -> None:
    run = await exchange.open("charges-errors", sim={"stall_after_tokens": 3, "stall_s": 30}, max_tokens=10)
    seen: list[RunEvent] = []
    task = asyncio.create_task(consume(run, seen))
    await until(lambda: run.tokens == 3)
    await Drain(exchange.completions, exchange.container.jobs, timeout_s=0.05)()
    await task
    fin = finished(seen)
    assert fin.error is not None and fin.error.code == "draining" and "drain_timeout_s" in fin.error.message
    assert fin.outcome == "error" and fin.cost_micros == MICROS_PER_TOKEN * fin.usage["total_tokens"] > 0
    # it produced (and was charged): sent again it would run, and be charged, again
    assert fin.error.headers["x-should-retry"] == "false"
    hold = await exchange.hold(run)
    assert (hold.state, hold.charged_micros) == ("settled", fin.cost_micros)
    assert (await exchange.record(run)).cost_micros == fin.cost_micros
    assert await exchange.busy("charges-errors") == (0, 0)


async def test_a_run_stopped_before_it_is_read_gives_back_its_slot(exchange: Exchange) -> None:
    run = await exchange.open("default")  # a free slot: admitted at once, not yet read
    assert await exchange.busy("default") == (1, 0)
    exchange.completions.draining = True
    seen = [ev async for ev in run.events()]
    assert [type(ev) for ev in seen] == [Queued, Finished]
    fin = finished(seen)
    assert fin.error is not None and fin.error.code == "draining" and fin.cost_micros == 0
    assert await exchange.busy("default") == (0, 0)
    assert (await exchange.hold(run)).state == "released"


async def test_a_draining_gateway_hands_back_its_jobs(exchange: Exchange) -> None:
    jobs = exchange.container.jobs
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10,
            "sim": {"stall_after_tokens": 2, "stall_s": 30}}  # fmt: skip
    running_job = await jobs.submit(exchange.principal, "/v1/chat/completions", body)
    waiting_job = await jobs.submit(exchange.principal, "/v1/chat/completions", body)
    await until(lambda: any(a.run.tokens == 2 for a in jobs.active.values()))
    balance = await exchange.balance()
    await Drain(exchange.completions, jobs, timeout_s=0.05)()
    assert not jobs.active and not exchange.completions.live
    store = exchange.container.store
    for view in (running_job, waiting_job):
        job = await store.job(view["id"])
        assert job is not None
        assert (job.status, job.owner, job.hold_id, job.started_at) == ("queued", None, None, None), job
        assert await store.usage(ACCOUNT, job.request_id) is None  # no charge, no record
    holds = await store.holds(state=None, account_id=ACCOUNT, limit=10)
    assert sorted(h.state for h in holds) == ["released", "released"], holds
    assert await exchange.balance() == balance + sum(h.amount_micros for h in holds)
    assert await exchange.busy("default") == (0, 0)


async def test_open_breakers_refuse_at_once_with_the_cool_down_left(exchange: Exchange) -> None:
    run = await exchange.open("fragile")
    seen: list[RunEvent] = []
    await asyncio.wait_for(consume(run, seen), timeout=COOLDOWN_S / 3)  # no wait for the cool-down
    fin = finished(seen)
    assert fin.error is not None and (fin.error.status, fin.error.code) == (503, "no_capacity"), fin
    assert (await exchange.hold(run)).state == "released"
    balance = await exchange.balance()
    with pytest.raises(GatewayError) as refused:
        await exchange.open("fragile")
    err = refused.value
    assert (err.status, err.code) == (503, "no_capacity") and "cooling down" in err.message
    assert 1 <= int(err.headers["retry-after"]) <= COOLDOWN_S
    assert await exchange.balance() == balance  # refused before any hold
    assert await exchange.busy("fragile") == (0, 0)


@pytest.mark.parametrize("watched", [False, True], ids=["listener", "watch"])
async def test_a_stop_that_finds_the_relay_writing_to_a_slow_client_is_taken_back(
    exchange: Exchange, watched: bool
) -> None:
    """The drain's cancellation lands in the relay's ``send`` (a client that stopped
    reading), not in the run: the relay returns quietly and the run settles as abandoned.
    The same with the relay beside a listener (any server) or on the connection's watch
    (bourse's own server)."""
    run = await exchange.open("default", max_tokens=10)
    watchers: list[Callable[[], None] | None] = []
    scope: dict[str, Any] = {"type": "http"}
    if watched:
        scope["extensions"] = {"bourse.client_present": {"watch": watchers.append}}
    stuck = asyncio.Event()

    async def send(message: Message) -> None:
        if b"data: {" in message.get("body", b""):
            stuck.set()
            await asyncio.Event().wait()  # the client's window is full, for good

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError

    relay = asyncio.create_task(RunResponse(run)(scope, receive, send))
    await until(stuck.is_set)
    run.interrupt(draining())
    await asyncio.wait_for(relay, timeout=5)  # returns: no CancelledError out of the app
    assert not relay.cancelled() and run.done
    assert len(watchers) == (2 if watched else 0) and watchers[-1:] in ([], [None])  # watched, then no more
    fin = await run.settled()
    assert fin is not None and fin.outcome == "canceled"
    assert (await exchange.hold(run)).state == "settled"  # default policy: what was generated
    assert await exchange.busy("default") == (0, 0)


async def test_an_accepted_job_waits_out_open_breakers(exchange: Exchange) -> None:
    """A job's submit is refused like any request while every breaker is open, but a job
    already accepted whose failure opened the last breaker waits in the book for the
    cool-down rather than fail."""
    jobs = exchange.container.jobs
    body = {"model": "fragile", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    view = await jobs.submit(exchange.principal, "/v1/chat/completions", body)
    act = jobs.active[view["id"]]
    await until(
        lambda: act.run.order is not None and act.run.order.requeues == 1 and act.run.phase is Phase.QUEUED
    )
    assert exchange.completions.markets["fragile"].cooling() is not None
    assert (await jobs.get(view["id"], ACCOUNT))["status"] == "queued"
    with pytest.raises(GatewayError) as refused:
        await jobs.submit(exchange.principal, "/v1/chat/completions", body)
    assert refused.value.code == "no_capacity"
    assert (await jobs.cancel(view["id"], ACCOUNT))["status"] == "canceled"
    assert await exchange.busy("fragile") == (0, 0)


async def test_hurry_ends_the_wait_for_running_generations(exchange: Exchange) -> None:
    """A second signal: the drain stops waiting and ends what still runs now."""
    run = await exchange.open("default", sim={"stall_after_tokens": 2, "stall_s": 30}, max_tokens=10)
    seen: list[RunEvent] = []
    task = asyncio.create_task(consume(run, seen))
    await until(lambda: run.tokens == 2)
    drain = Drain(exchange.completions, exchange.container.jobs, timeout_s=600)
    draining_task = asyncio.create_task(drain())
    await until(lambda: exchange.completions.draining)
    assert not draining_task.done() and run.phase is Phase.STREAMING
    drain.hurry()
    await asyncio.wait_for(draining_task, timeout=5)
    await task
    fin = finished(seen)
    assert fin.error is not None and fin.error.code == "draining" and fin.outcome == "error"
    assert (await exchange.hold(run)).state == "released"  # default policy: errors are not charged
