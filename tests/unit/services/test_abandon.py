"""Abandonment (SPEC section 7): a run whose consumer stops, at each phase, gives its
slot back exactly once and settles by policy.

The consumer is stopped the way the relay stops it: its task is cancelled (the
relay's task group does that when the client leaves), or the run's events are
closed (the relay's clean-up, a cancelled job), or the run is abandoned before it
was ever read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bourse.services.completion import Phase, Run, RunEvent
from tests.unit.services.exchange import MICROS_PER_TOKEN, PRESETS, Exchange, until

pytestmark = pytest.mark.anyio

PHASES: dict[str, tuple[dict[str, Any], Phase]] = {
    # phase: (the sim's behaviour, the phase the run is in when it is stopped)
    "queued": ({}, Phase.QUEUED),
    "admitted": ({"ttft_ms": 30_000}, Phase.ADMITTED),
    "streaming": ({"stall_after_tokens": 3, "stall_s": 30}, Phase.STREAMING),
}
MODELS = [*PRESETS, "no-charge-on-disconnect"]


def expected_state(model: str, phase: str) -> str:
    if phase != "streaming":
        return "released"  # nothing produced: nothing charged
    if model == "aigrid":
        return "reconciling"  # the stalled stream has no usage: missing_usage = reconcile
    return "released" if model == "no-charge-on-disconnect" else "settled"


async def consume(run: Run, seen: list[RunEvent]) -> None:
    async for ev in run.events():
        seen.append(ev)


async def stopped_in(exchange: Exchange, model: str, phase: str) -> tuple[Run, Run | None]:
    """A run of ``model`` being read, in ``phase`` (queued: behind a run holding the slot)."""
    sim, _ = PHASES[phase]
    blocker = await exchange.open(model) if phase == "queued" else None
    run = await exchange.open(model, sim=sim)
    return run, blocker


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("phase", list(PHASES))
async def test_client_leaves(exchange: Exchange, model: str, phase: str) -> None:
    run, blocker = await stopped_in(exchange, model, phase)
    seen: list[RunEvent] = []
    task = asyncio.create_task(consume(run, seen))
    want = PHASES[phase][1]
    await until(lambda: bool(seen) and run.phase is want and (phase != "streaming" or run.tokens == 3))
    run.client_gone()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.done
    fin = await run.settled()
    assert fin is not None
    hold = await exchange.hold(run)
    state = expected_state(model, phase)
    assert hold.state == state
    assert fin.outcome == ("reconciling" if state == "reconciling" else "disconnected")
    if state == "settled":
        assert fin.cost_micros == MICROS_PER_TOKEN * fin.usage["total_tokens"] > 0
        assert fin.usage["completion_tokens"] == 3
    else:
        assert fin.cost_micros == 0
    assert hold.charged_micros == fin.cost_micros
    if blocker is not None:
        assert await exchange.busy(model) == (1, 0)  # the blocker's slot; the order left the book
        await blocker.abandon()
    assert await exchange.busy(model) == (0, 0)
    await run.abandon()  # again: nothing more is given back
    assert await exchange.busy(model) == (0, 0)


@pytest.mark.parametrize("phase", list(PHASES))
async def test_events_closed_without_the_client_leaving_is_canceled(exchange: Exchange, phase: str) -> None:
    run, blocker = await stopped_in(exchange, "default", phase)
    events = run.events()
    seen = [await anext(events)]  # Queued
    if phase == "admitted":  # admitted, waiting a minute for the engine's first token
        pending = asyncio.ensure_future(anext(events))
        await until(lambda: run.phase is Phase.ADMITTED)
        pending.cancel()  # the consumer stops waiting ...
        with pytest.raises(asyncio.CancelledError):
            await pending
    while phase == "streaming" and run.tokens < 3:
        seen.append(await anext(events))
    await events.aclose()  # ... and closes the run's events
    fin = await run.settled()
    assert fin is not None and fin.outcome == "canceled"
    assert (await exchange.hold(run)).state == ("settled" if phase == "streaming" else "released")
    if blocker is not None:
        await blocker.abandon()
    assert await exchange.busy("default") == (0, 0)


async def test_abandoned_before_it_was_read(exchange: Exchange) -> None:
    """The relay fails before its first frame: the run was admitted at once, never read."""
    run = await exchange.open("default")
    assert run.phase is Phase.QUEUED and await exchange.busy("default") == (1, 0)
    await run.abandon()
    fin = await run.settled()
    assert fin is not None and fin.outcome == "canceled" and fin.cost_micros == 0
    assert (await exchange.hold(run)).state == "released"
    assert await exchange.busy("default") == (0, 0)
