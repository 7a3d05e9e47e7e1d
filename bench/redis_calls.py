"""What a script call to Redis costs the gateway's process, sent alone or together
(issue 40 item 4; ``coordination/script_batch.py``).

    .venv/bin/python -m bench.redis_calls [--redis URL] [--calls 6000] [--callers 32]

A closed loop of ``--callers`` coroutines, each calling a one-line script with the
book's 30 arguments (``SUBMIT``'s 14 keys, the replica's 7 terms, 9 values) then
yielding once, over one redis-py client (hiredis): ``direct`` is ``EVALSHA`` per call
(the hub before script batches), ``lanes=N`` is :class:`ScriptBatch` with ``N`` round
trips on their way at most, ``line`` is :class:`ScriptLine` (the hub's path now: one
connection, the calls of a turn in one write). Printed: this process's CPU a call (user + sys), calls a
second, and calls a round trip. Twice each, in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import uvloop

import bourse.coordination.script_batch as script_batch
from bourse.coordination.script_batch import ScriptBatch
from bourse.coordination.script_line import ScriptLine

KEYS = [f"{{bench}}:k{i}".encode() for i in range(14)]
ARGS: list[Any] = [b"abcdefghijklmno"] * 7 + ["o1", "0.5", 0, "", "rep", 100, 0, 0, ""]


async def run(url: str, calls: int, callers: int) -> None:
    r = aioredis.from_url(url, decode_responses=True, max_connections=512)
    try:
        sha = await r.script_load("return 1")
        scripts = {"S": r.register_script("return 1")}
        for _ in range(2):
            for lanes in (0, 1, 2, 4, -1):
                batch = ScriptBatch(lambda: r, scripts)
                script_batch.MAX_IN_FLIGHT = max(1, lanes)
                line = ScriptLine(url, scripts)
                call: Callable[[], Awaitable[Any]]
                if lanes == -1:

                    async def call(line: ScriptLine = line) -> Any:
                        return await line.call("S", KEYS, ARGS)
                elif lanes == 0:

                    async def call() -> Any:
                        return await r.evalsha(sha, len(KEYS), *KEYS, *ARGS)
                else:

                    async def call(batch: ScriptBatch = batch) -> Any:
                        return await batch.call("S", KEYS, ARGS)

                async def caller(call: Callable[[], Awaitable[Any]] = call) -> None:
                    for _ in range(calls // callers):
                        await call()
                        await asyncio.sleep(0)  # the request's other work

                cpu, wall = time.process_time(), time.perf_counter()
                await asyncio.gather(*(caller() for _ in range(callers)))
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                n = calls // callers * callers
                writes = line.writes
                await line.aclose()
                per_trip = ""
                if lanes > 0:
                    per_trip = f", {batch.calls / batch.round_trips:.1f} calls a round trip"
                elif lanes == -1:
                    per_trip = f", {line.calls / max(1, writes):.1f} calls a write"
                name = {0: "direct", -1: "line"}.get(lanes, f"lanes={lanes}")
                print(f"{name:8} {cpu / n * 1e6:6.1f} µs of CPU a call, {n / wall:8,.0f} calls/s{per_trip}")
    finally:
        await r.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--callers", type=int, default=32)
    args = ap.parse_args()
    uvloop.run(run(args.redis, args.calls, args.callers))


if __name__ == "__main__":
    main()
