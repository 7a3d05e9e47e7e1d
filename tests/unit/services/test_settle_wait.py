"""A run's consumer waits for its settlement, which is a task of its own: a consumer
cancelled meanwhile leaves the settlement running to its end (the hold closed, the
run reported), and a settlement that fails hands its error to the consumer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

import pytest

from bourse.services.billing import Closing, Settlement
from bourse.services.completion import Finished, RunEvent
from tests.unit.services.exchange import Exchange, run_to_end

pytestmark = pytest.mark.anyio

MODEL = "default"


async def test_a_consumer_cancelled_while_its_run_settles_leaves_the_settlement_to_end(
    exchange: Exchange, monkeypatch: pytest.MonkeyPatch
) -> None:
    billing = exchange.completions.billing
    real = billing.settle
    entered, gate = asyncio.Event(), asyncio.Event()

    async def slow(closing: Closing) -> Settlement:
        entered.set()
        await gate.wait()
        return await real(closing)

    monkeypatch.setattr(billing, "settle", slow)
    run = await exchange.open(MODEL, stream=False)
    seen: list[RunEvent] = []

    async def consume() -> None:
        async for ev in run.events():
            seen.append(ev)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(isinstance(ev, Finished) for ev in seen)
    gate.set()
    fin = await asyncio.wait_for(run.settled(), 5)
    assert fin is not None and fin.outcome == "completed" and fin.cost_micros > 0
    hold = await exchange.hold(run)
    assert hold.state == "settled" and hold.charged_micros == fin.cost_micros


async def test_a_settlement_that_fails_raises_in_the_consumer(
    exchange: Exchange, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(closing: Closing) -> Settlement:
        raise Broken(closing.request_id)

    monkeypatch.setattr(exchange.completions.billing, "settle", broken)
    run = await exchange.open(MODEL, stream=False)
    with pytest.raises(Broken):
        await run_to_end(run)
    with pytest.raises(Broken):
        await run.settled()
    monkeypatch.undo()
    await exchange.completions.billing.release(run.hold_id)  # the hold back, for the next test


class Broken(Exception):
    """A settlement's failure (something past the store: the store's own never raise)."""


@contextlib.asynccontextmanager
async def _asyncio_reports() -> AsyncIterator[list[str]]:
    """What the loop's exception handler is told meanwhile, and at the end after the
    collection of what was dropped (a task's error never retrieved is told then)."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda lp, ctx: seen.append(str(ctx.get("message", ""))))
    try:
        yield seen
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
    finally:
        loop.set_exception_handler(old)


async def test_a_failed_settlement_is_reported_once_not_again_as_never_retrieved(
    exchange: Exchange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its error reaches the consumer, and asyncio does not log the settlement's task
    again ("Task exception was never retrieved") when the task is collected."""

    async def broken(closing: Closing) -> Settlement:
        raise Broken(closing.request_id)

    async with _asyncio_reports() as seen:
        monkeypatch.setattr(exchange.completions.billing, "settle", broken)
        run = await exchange.open(MODEL, stream=False)
        hold_id = run.hold_id
        with pytest.raises(Broken):
            await run_to_end(run)
        del run
    monkeypatch.undo()
    await exchange.completions.billing.release(hold_id)
    assert not [m for m in seen if "never retrieved" in m], seen


async def test_a_settlement_failing_after_its_consumer_left_is_logged_once(
    exchange: Exchange, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    entered, gate = asyncio.Event(), asyncio.Event()

    async def broken(closing: Closing) -> Settlement:
        entered.set()
        await gate.wait()
        raise Broken(closing.request_id)

    async with _asyncio_reports() as seen:
        monkeypatch.setattr(exchange.completions.billing, "settle", broken)
        run = await exchange.open(MODEL, stream=False)
        hold_id = run.hold_id
        task = asyncio.create_task(run_to_end(run))
        await asyncio.wait_for(entered.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with caplog.at_level(logging.ERROR, logger="bourse.completion"):
            gate.set()
            with pytest.raises(Broken):
                await asyncio.wait_for(run.settled(), 5)
            del run
    monkeypatch.undo()
    await exchange.completions.billing.release(hold_id)
    logged = [r for r in caplog.records if "settlement failed after its consumer left" in r.getMessage()]
    assert len(logged) == 1 and isinstance(logged[0].exc_info and logged[0].exc_info[1], Broken)
    assert not [m for m in seen if "never retrieved" in m], seen
