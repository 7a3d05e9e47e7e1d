"""The scripts' own line to Redis (``coordination/script_line.py``) on a real Redis:
the calls of one turn of the loop go in one write, each caller gets its own answer or
its own error in the order made; a script Redis forgot is loaded again; a caller that
stops waiting leaves the others answered; a connection Redis closes is replaced on the
next call; a call without an answer in time fails (and drops its connection); a
database other than 0 is the one written."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bourse.coordination.script_line import ScriptLine, pack, usable

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('bad argument') end
redis.call('RPUSH', KEYS[1], ARGV[1])
return {ARGV[1], 7, {'x'}}
"""

BIN = """
redis.call('RPUSH', KEYS[1], ARGV[1])
if ARGV[1] == 'bin' then return '\\255\\254' end
return ARGV[1]
"""

SLOW = """
local n = 0
for i = 1, 4000000 do n = n + 1 end
return 'slow'
"""


@pytest.fixture
async def rig(redis_service_url: str) -> AsyncIterator[tuple[aioredis.Redis, ScriptLine, str]]:
    r = aioredis.from_url(redis_service_url, decode_responses=True)
    key = "t" + os.urandom(6).hex() + ":log"
    scripts = {"ECHO": r.register_script(ECHO), "SLOW": r.register_script(SLOW)}
    await r.script_load(ECHO)
    await r.script_load(SLOW)
    line = ScriptLine(redis_service_url, scripts)
    try:
        yield r, line, key
    finally:
        await line.aclose()
        await r.delete(key)
        await r.aclose()


def test_pack_is_resp() -> None:
    assert pack([b"EVALSHA", "ab", 2, 0.5]) == b"*4\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$3\r\n0.5\r\n"
    assert usable("redis://h:1/0") and usable("unix:///tmp/r.sock") and not usable("rediss://h:1/0")


async def test_one_turns_calls_one_write_answers_in_order(
    rig: tuple[aioredis.Redis, ScriptLine, str],
) -> None:
    r, line, key = rig
    assert await line.call("ECHO", [key], ["solo"]) == ["solo", 7, ["x"]]
    await r.delete(key)
    before = line.writes
    words = [f"w{i}" for i in range(40)]
    got = await asyncio.gather(*(line.call("ECHO", [key], [w]) for w in words))
    assert [g[0] for g in got] == words  # each caller its own answer
    assert line.writes == before + 1  # made in one turn: one write
    assert await r.lrange(key, 0, -1) == words  # in the order made
    assert line.connections == 1


async def test_an_error_is_its_own_calls(rig: tuple[aioredis.Redis, ScriptLine, str]) -> None:
    _, line, key = rig
    got = await asyncio.gather(*(line.call("ECHO", [key], [w]) for w in ["a", "b", "bad", "c"]),
                               return_exceptions=True)  # fmt: skip
    assert [g[0] for g in got[:2]] == ["a", "b"] and got[3][0] == "c"  # type: ignore[index]
    assert isinstance(got[2], ResponseError) and "bad argument" in str(got[2])


async def test_a_script_redis_forgot_is_loaded_again(rig: tuple[aioredis.Redis, ScriptLine, str]) -> None:
    r, line, key = rig
    await r.script_flush()
    got = await asyncio.gather(*(line.call("ECHO", [key], [f"x{i}"]) for i in range(6)))
    assert [g[0] for g in got] == [f"x{i}" for i in range(6)]
    assert await r.llen(key) == 6


async def test_a_caller_that_stops_waiting_leaves_the_others_answered(
    rig: tuple[aioredis.Redis, ScriptLine, str],
) -> None:
    _, line, key = rig
    tasks = [asyncio.create_task(line.call("ECHO", [key], [f"y{i}"])) for i in range(8)]
    await asyncio.sleep(0)
    tasks[3].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[3], asyncio.CancelledError)
    assert [d[0] for i, d in enumerate(done) if i != 3] == [f"y{i}" for i in range(8) if i != 3]  # type: ignore[index]
    assert (await line.call("ECHO", [key], ["after"]))[0] == "after"  # nothing left out of step


async def test_a_connection_redis_closes_is_replaced(rig: tuple[aioredis.Redis, ScriptLine, str]) -> None:
    r, line, key = rig
    assert (await line.call("ECHO", [key], ["one"]))[0] == "one"
    conn = line._conn
    assert conn is not None and conn._transport is not None
    host, port = conn._transport.get_extra_info("sockname")[:2]
    await r.client_kill_filter(addr=f"{host}:{port}")  # this line's alone
    await asyncio.sleep(0.05)
    assert (await line.call("ECHO", [key], ["two"]))[0] == "two"
    assert line.connections == 2


async def test_a_call_without_an_answer_in_time_fails(redis_service_url: str) -> None:
    r = aioredis.from_url(redis_service_url, decode_responses=True)
    scripts = {"SLOW": r.register_script(SLOW)}
    await r.script_load(SLOW)
    line = ScriptLine(redis_service_url, scripts, timeout_s=0.005)
    try:
        with pytest.raises(RedisTimeoutError):
            await line.call("SLOW", [], [])
        assert line._conn is not None and line._conn.closed  # dropped with its call
    finally:
        await line.aclose()
        await r.aclose()


async def test_an_unreachable_redis_fails_each_call(redis_service_url: str) -> None:
    from tests.support.processes import free_port

    live = aioredis.from_url(redis_service_url, decode_responses=True)
    try:
        line = ScriptLine(f"redis://127.0.0.1:{free_port()}/0", {"ECHO": live.register_script(ECHO)})
        got = await asyncio.gather(*(line.call("ECHO", ["k"], [f"z{i}"]) for i in range(5)),
                                   return_exceptions=True)  # fmt: skip
        assert all(isinstance(g, RedisConnectionError) for g in got), got
        await line.aclose()
    finally:
        await live.aclose()


async def test_the_urls_database_is_the_one_written(redis_service_url: str) -> None:
    base = redis_service_url.rsplit("/", 1)[0]
    other = aioredis.from_url(f"{base}/3", decode_responses=True)
    key = "t" + os.urandom(6).hex() + ":db"
    line = ScriptLine(f"{base}/3", {"ECHO": other.register_script(ECHO)})
    try:
        await line.call("ECHO", [key], ["in3"])
        assert await other.lrange(key, 0, -1) == ["in3"]
    finally:
        await line.aclose()
        await other.delete(key)
        await other.aclose()


async def test_a_kept_head_is_packed_once_a_new_one_is_used(
    rig: tuple[aioredis.Redis, ScriptLine, str],
) -> None:
    r, line, key = rig
    keys = [key]
    head = ["h1"]
    assert (await line.call("ECHO", keys, ["x"], head))[0] == "h1"  # ARGV[1] is the head's
    assert (await line.call("ECHO", keys, ["y"], head))[0] == "h1"
    assert len(line._prefixes) == 1
    assert (await line.call("ECHO", keys, ["z"], ["h2"]))[0] == "h2"  # a new head, never a stale one
    assert await r.lrange(key, 0, -1) == ["h1", "h1", "h2"]


async def test_an_answer_not_utf8_fails_its_own_call_only_and_runs_nothing_twice(
    rig: tuple[aioredis.Redis, ScriptLine, str],
) -> None:
    """hiredis reads the answer, then cannot decode it: its caller gets a ResponseError,
    the connection stays (the others' answers in the same read are theirs), and no call
    is made again (a connection failure would have re-run every call on it)."""
    r, line, key = rig
    line._scripts["BIN"] = r.register_script(BIN)
    await r.script_load(BIN)
    got = await asyncio.gather(*(line.call("BIN", [key], [w]) for w in ["a", "bin", "c"]),
                               return_exceptions=True)  # fmt: skip
    assert got[0] == "a" and got[2] == "c", got
    assert isinstance(got[1], ResponseError) and "UTF-8" in str(got[1]), got
    assert await r.lrange(key, 0, -1) == ["a", "bin", "c"]  # each ran once
    assert line.connections == 1 and line._conn is not None and not line._conn.closed


async def test_a_closed_line_opens_no_connection(rig: tuple[aioredis.Redis, ScriptLine, str]) -> None:
    """A call after ``aclose`` (a background task late at shutdown) fails at once, without a
    new connection nobody would close."""
    _, line, key = rig
    await line.call("ECHO", [key], ["before"])
    await line.aclose()
    with pytest.raises(RedisConnectionError, match="closed"):
        await line.call("ECHO", [key], ["after"])
    assert line.connections == 1 and line._conn is None


def test_the_retries_wait_as_redis_py_did() -> None:
    """The hub's redis-py client retried a failed connection 3 times, 40, 80 and 160 ms
    apart (``Retry(ExponentialBackoff(cap=0.5, base=0.02), 3)``): the line gives a restart
    as long."""
    from bourse.coordination import script_line

    waits = [
        min(script_line.BACKOFF_CAP_S, script_line.BACKOFF_S * 2**i) for i in range(script_line.ATTEMPTS - 1)
    ]
    assert waits == [0.04, 0.08, 0.16]
