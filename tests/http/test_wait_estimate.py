"""The expected wait (issue 16, item 5): a waiting order's ``: queued`` frames and
the market views say how long a new order should expect to wait at a bid, from the
pace of the recent admissions and the orders ahead (the market bench measures its
error against the actual waits)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.asgi import InProcessGateway, in_process_gateway
from tests.support.config import Dep, Product, config_toml

pytestmark = pytest.mark.anyio

QUEUED = re.compile(r"^queued level=(\S+) position=(\d+) wait_s=(\d+\.\d\d)$")
SLOW = {"output_tokens": 12, "tokens_per_s": 20}
"""About 0.6 s on the one slot."""


@pytest.fixture
async def one_slot(tmp_path: Path) -> AsyncIterator[InProcessGateway]:
    cfg = config_toml([Product("one", [Dep("one-a", slots=1, floor=1.0)])], server={"quiet_interval_s": 0.1})
    async with in_process_gateway(cfg, tmp_path) as g:
        yield g


async def test_queued_frames_and_the_market_say_the_expected_wait(one_slot: InProcessGateway) -> None:
    gw = one_slot
    market = (await gw.get("/v1/market/one")).json()
    assert (market["admissions_per_s"], market["expected_wait_s"], market["parked"]) == (None, 0.0, 0)
    for _ in range(3):  # a pace to go by
        r = await gw.post("/v1/chat/completions", {"model": "one", "messages": [{"role": "user", "content": "hi"}],
                                                   "sim": {"output_tokens": 2}})  # fmt: skip
        assert r.status_code == 200, r.text
    holder = asyncio.create_task(gw.sse({"model": "one", "max_price": 5.0, "sim": SLOW}))
    await _until_busy(gw)
    waiter = asyncio.create_task(gw.sse({"model": "one", "max_price": 2.0, "sim": {"output_tokens": 2}}))
    market = await _until_waiting(gw)
    assert market["admissions_per_s"] > 0, market
    assert market["expected_wait_s"] > 0, market  # the default bid queues behind the waiter
    assert market["book"] == [{"price": 2.0, "orders": 1}], market
    [at] = market["waits"]
    assert at["price"] == 2.0 and at["wait_s"] > 0, market
    res = await waiter
    await holder
    frames = [k[2:] for k in res.kinds() if k.startswith("c:queued level=")]
    assert frames, res.kinds()
    for f in frames:
        m = QUEUED.match(f)
        assert m is not None, f
        assert m.group(2) == "0" and float(m.group(3)) > 0, f


async def _until_busy(gw: InProcessGateway) -> None:
    for _ in range(500):
        if (await gw.get("/v1/market/one")).json()["slots"]["busy"] == 1:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the holder never got the slot")


async def _until_waiting(gw: InProcessGateway) -> dict[str, Any]:
    for _ in range(500):
        m: dict[str, Any] = (await gw.get("/v1/market/one")).json()
        if m["waiting"] == 1:
            return m
        await asyncio.sleep(0.01)
    raise AssertionError("the order never waited")
