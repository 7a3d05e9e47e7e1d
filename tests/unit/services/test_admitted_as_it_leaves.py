"""A client that leaves at the very moment its order is admitted gives its slot back
exactly once.

Found by the fault suite's load (``tests/faults/test_pg_terminate.py``): the order's
admission future was resolved, and in the same turn of the loop the client left (its
task cancelled). The book's ``wait`` withdrew the order on the cancellation (giving
back the slot the admission had taken), and the run's abandonment withdrew it again:
a second release of the same slot, ``AssertionError: release of an idle slot`` in
the next request's settlement, and that request's hold left open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bourse.services.completion import Phase, Run, RunEvent
from tests.unit.services.exchange import Exchange, product, run_to_end, running, until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def exchange(tmp_path: Path) -> AsyncIterator[Exchange]:
    async with running(tmp_path, {"one": product(slots=1)}) as ex:
        yield ex


async def _consume(run: Run, seen: list[RunEvent]) -> None:
    async for ev in run.events():
        seen.append(ev)


async def test_leaving_as_the_order_is_admitted_gives_the_slot_back_once(exchange: Exchange) -> None:
    blocker = await exchange.open("one")  # holds the only slot
    run = await exchange.open("one")
    seen: list[RunEvent] = []
    task = asyncio.create_task(_consume(run, seen))
    await until(lambda: bool(seen) and run.phase is Phase.QUEUED)
    await asyncio.sleep(0)  # the consumer now waits on its admission
    await blocker.abandon()  # the slot goes to the waiting order: its future resolves ...
    task.cancel()  # ... and in the same turn its client leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    fin = await run.settled()
    assert fin is not None and fin.outcome == "canceled" and fin.cost_micros == 0, fin
    assert (await exchange.hold(run)).state == "released"
    assert await exchange.busy("one") == (0, 0)
    # the slot works as one slot: the next run is admitted, completes and gives it back
    _, done = await run_to_end(await exchange.open("one"))
    assert done.outcome == "completed" and done.error is None
    assert await exchange.busy("one") == (0, 0)
