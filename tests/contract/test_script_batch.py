"""Script calls sent together (``coordination/script_batch.py``) on a real Redis: a
call made while a lane is free goes straight away; calls made while every lane is
out go as one pipeline, each caller with its own answer or its own error, in the order made; a
script Redis forgot is loaded again; a caller that stops waiting leaves the others
answered."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from bourse.coordination.script_batch import MAX_IN_FLIGHT, ScriptBatch

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('bad argument') end
redis.call('RPUSH', KEYS[1], ARGV[1])
return ARGV[1]
"""

SLOW = """
local n = 0
for i = 1, 4000000 do n = n + 1 end
return 'slow'
"""


@pytest.fixture
async def rig(redis_service_url: str) -> AsyncIterator[tuple[aioredis.Redis, ScriptBatch, str]]:
    r = aioredis.from_url(redis_service_url, decode_responses=True)
    key = "t" + os.urandom(6).hex() + ":log"
    scripts = {"ECHO": r.register_script(ECHO), "SLOW": r.register_script(SLOW)}
    await r.script_load(ECHO)
    await r.script_load(SLOW)
    try:
        yield r, ScriptBatch(lambda: r, scripts), key
    finally:
        await r.delete(key)
        await r.aclose()


async def test_alone_straight_away_together_one_pipeline_in_order(
    rig: tuple[aioredis.Redis, ScriptBatch, str],
) -> None:
    r, batch, key = rig
    assert await batch.call("ECHO", [key], ["solo"]) == "solo"
    assert (batch.calls, batch.round_trips) == (1, 1)
    await r.delete(key)
    # every lane out on a slow call (Redis runs one script at a time: they take ~0.1 s)
    slow = [asyncio.create_task(batch.call("SLOW", [], [])) for _ in range(MAX_IN_FLIGHT)]
    await asyncio.sleep(0.01)
    words = [f"w{i}" for i in range(40)]
    got = await asyncio.gather(*(batch.call("ECHO", [key], [w]) for w in words))
    assert got == words  # each caller its own answer
    assert await asyncio.gather(*slow) == ["slow"] * MAX_IN_FLIGHT
    assert batch.calls == 1 + MAX_IN_FLIGHT + 40
    assert batch.round_trips == 1 + MAX_IN_FLIGHT + 1  # the 40 made while every lane was out: one pipeline
    assert await r.lrange(key, 0, -1) == words  # in the order made


async def test_an_error_is_its_own_calls(rig: tuple[aioredis.Redis, ScriptBatch, str]) -> None:
    _, batch, key = rig
    got = await asyncio.gather(*(batch.call("ECHO", [key], [w]) for w in ["a", "b", "bad", "c"]),
                               return_exceptions=True)  # fmt: skip
    assert got[:2] == ["a", "b"] and got[3] == "c"
    assert isinstance(got[2], ResponseError) and "bad argument" in str(got[2])


async def test_a_script_redis_forgot_is_loaded_again(rig: tuple[aioredis.Redis, ScriptBatch, str]) -> None:
    r, batch, key = rig
    await r.script_flush()
    got = await asyncio.gather(*(batch.call("ECHO", [key], [f"x{i}"]) for i in range(6)))
    assert got == [f"x{i}" for i in range(6)]
    assert await r.llen(key) == 6


async def test_a_caller_that_stops_waiting_leaves_the_others_answered(
    rig: tuple[aioredis.Redis, ScriptBatch, str],
) -> None:
    _, batch, key = rig
    tasks = [asyncio.create_task(batch.call("ECHO", [key], [f"y{i}"])) for i in range(8)]
    await asyncio.sleep(0)
    tasks[3].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[3], asyncio.CancelledError)
    assert [d for i, d in enumerate(done) if i != 3] == [f"y{i}" for i in range(8) if i != 3]
    assert await batch.call("ECHO", [key], ["after"]) == "after"  # nothing left stuck


async def test_a_failed_connection_fails_the_calls_sent_on_it(redis_service_url: str) -> None:
    from tests.support.processes import free_port

    dead = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", decode_responses=True)
    live = aioredis.from_url(redis_service_url, decode_responses=True)
    try:
        batch = ScriptBatch(lambda: dead, {"ECHO": live.register_script(ECHO)})
        got = await asyncio.gather(*(batch.call("ECHO", ["k"], [f"z{i}"]) for i in range(5)),
                                   return_exceptions=True)  # fmt: skip
        assert all(isinstance(g, (ConnectionError, OSError)) or "Connect" in type(g).__name__ for g in got), (
            got
        )
        assert batch.round_trips <= MAX_IN_FLIGHT + 1
    finally:
        await dead.aclose()
        await live.aclose()
