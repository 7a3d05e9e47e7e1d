"""A run's consumer waits for its settlement, which is a task of its own: a consumer
cancelled meanwhile leaves the settlement running to its end (the hold closed, the
run reported), and a settlement that fails hands its error to the consumer."""

from __future__ import annotations

import asyncio

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
    class Broken(Exception):
        pass

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
