"""A departed client (issue 16, item 4): a slot that comes to an order whose client
has already left (the relay has not seen the disconnect yet: the gateway stalled)
starts no engine and goes to the next order; and a run that stops gives its slot
back only once its engine has stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, cast

import pytest

from bourse.coordination.book_local import LocalBook
from bourse.engines.sim import SimEngine
from bourse.ports.engine import EngineEvent, GenerationRequest
from bourse.services.completion import Finished, Phase, RunEvent
from tests.unit.services.exchange import Exchange, run_to_end, until

pytestmark = pytest.mark.anyio

MODEL = "default"


def sim_of(exchange: Exchange) -> SimEngine:
    [engine] = exchange.completions.markets[MODEL].engines.values()
    assert isinstance(engine, SimEngine)
    return engine


async def test_a_slot_for_a_departed_client_starts_no_engine(exchange: Exchange) -> None:
    sim = sim_of(exchange)
    blocker = await exchange.open(MODEL, sim={"ttft_ms": 30_000})  # the bound on a sim ttft
    blocker_events = asyncio.create_task(run_to_end(blocker))
    await until(lambda: blocker.phase is Phase.ADMITTED)
    started = sim.stats["started"]

    asked: list[str] = []

    def present() -> bool:  # the socket says the client is gone; the relay has not seen it yet
        asked.append("left")
        return False

    left = await exchange.open(MODEL, present=present)
    nxt = await exchange.open(MODEL, sim={"output_tokens": 2}, max_tokens=2)
    assert await exchange.busy(MODEL) == (1, 2)
    events = asyncio.create_task(run_to_end(left))
    nxt_events = asyncio.create_task(run_to_end(nxt))
    await until(lambda: left.phase is Phase.QUEUED and nxt.phase is Phase.QUEUED)
    await blocker.abandon()  # the slot comes to ``left`` first (same bid, earlier)
    _, fin = await events
    assert asked, "the client was not asked when the slot came to its order"
    assert fin.outcome == "disconnected" and fin.error is None
    assert fin.usage["x_market"]["cleared_price"] is None  # never admitted
    _, nfin = await nxt_events  # the slot went on to the next order
    assert nfin.outcome == "completed" and nfin.usage["completion_tokens"] == 2
    assert sim.stats["started"] == started + 1, "an engine started for a client that had left"
    assert (await exchange.hold(left)).state == "released"
    assert await exchange.busy(MODEL) == (0, 0)
    blocker_events.cancel()
    await asyncio.gather(blocker_events, return_exceptions=True)


async def test_the_slot_goes_back_only_after_the_engine_stopped(
    exchange: Exchange, monkeypatch: pytest.MonkeyPatch
) -> None:
    market = exchange.completions.markets[MODEL]
    book = market.book
    assert isinstance(book, LocalBook)
    [(name, engine)] = market.engines.items()
    busy_when_stopped: list[int] = []
    real = engine.generate

    async def slow_to_stop(request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        gen = cast(AsyncGenerator[EngineEvent, None], real(request))
        try:
            async for ev in gen:
                yield ev
        finally:
            await asyncio.sleep(0.05)  # an upstream that takes a moment to hang up
            await gen.aclose()
            busy_when_stopped.append(book.book.deployment(name).busy)

    monkeypatch.setattr(engine, "generate", slow_to_stop)
    run = await exchange.open(MODEL, sim={"tokens_per_s": 20, "output_tokens": 50}, max_tokens=50)
    seen: list[RunEvent] = []

    async def consume() -> Any:
        async for ev in run.events():
            seen.append(ev)

    task = asyncio.create_task(consume())
    await until(lambda: run.tokens >= 2)
    run.client_gone()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert busy_when_stopped == [1], "the slot was given back before the engine had stopped"
    assert await exchange.busy(MODEL) == (0, 0)
    fin = await run.settled()
    assert isinstance(fin, Finished) and fin.outcome == "disconnected"


async def test_the_client_is_asked_only_for_an_order_that_waited_and_once(exchange: Exchange) -> None:
    """Each look is a poll() on the event loop's thread: none for an order admitted at
    once (its request was just read), one (the book's, at the dispatch; not again
    right after it, in the run) for an order that waited in the book."""
    asked: list[str] = []

    def present(rid: str) -> bool:
        asked.append(rid)
        return True

    at_once = await exchange.open(
        MODEL, sim={"output_tokens": 2}, max_tokens=2, present=lambda: present("at_once")
    )
    _, fin = await run_to_end(at_once)
    assert fin.outcome == "completed" and asked == []

    blocker = await exchange.open(MODEL, sim={"ttft_ms": 30_000})
    blocker_events = asyncio.create_task(run_to_end(blocker))
    await until(lambda: blocker.phase is Phase.ADMITTED)
    waited = await exchange.open(
        MODEL, sim={"output_tokens": 2}, max_tokens=2, present=lambda: present("waited")
    )
    events = asyncio.create_task(run_to_end(waited))
    await until(lambda: waited.phase is Phase.QUEUED)
    await blocker.abandon()
    _, fin = await events
    assert fin.outcome == "completed" and asked == ["waited"]
    blocker_events.cancel()
    await asyncio.gather(blocker_events, return_exceptions=True)
