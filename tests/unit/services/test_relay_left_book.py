"""A ``: queued`` frame is written only for an order still in the book.

Found by bench (h) on the Redis book: an order whose book timeout ended it while its
quiet-interval frame was asking the book for its standing got ``: queued level=…
position=0`` with no ``wait_s``, in the instant its 408 was written. The book had said
it was not waiting (position -1); the run had not yet seen its timeout, so it was still
``QUEUED``. Now the relay writes no frame for an order the book says has left.
"""

from __future__ import annotations

import pytest

from bourse.http.relay import RunResponse
from bourse.services.run_state import QUEUED
from tests.unit.services.exchange import Exchange, until

pytestmark = pytest.mark.anyio


async def test_no_queued_frame_for_an_order_that_left_the_book(exchange: Exchange) -> None:
    busy = await exchange.open("default", sim={"stall_after_tokens": 1, "stall_s": 30}, max_tokens=4)
    waiting = await exchange.open("default", timeout_s=30)
    order = waiting.order
    assert order is not None and waiting.phase is QUEUED
    market = exchange.completions.markets["default"]
    relay = RunResponse(waiting)
    still = await relay._queued_frame()
    assert still is not None and b"position=0" in still  # in the book: its frame
    # its timeout takes it out of the book; the run has not seen it yet
    fut = waiting._fut
    assert fut is not None
    market.book.withdraw(order, fut)
    assert waiting.phase is QUEUED
    assert await relay._queued_frame() is None
    for run in (waiting, busy):
        await run.abandon()
    await until(lambda: market.book.occupancy() == {"default/0": 0})
