"""What the stall clock costs per chunk (``bourse.services.completion.StallClock``).

Iterates an async generator of ``--chunks`` items (cooperating every 64, as the sim
engine does) three ways and prints the best of ``--repeat`` runs in ns per chunk:

- ``bare``: the loop alone;
- ``clock``: with the run's stall clock (two attribute stores per chunk, one timer
  per attempt checked every quarter of the timeout);
- ``timeout``: with :func:`asyncio.timeout` rescheduled at every chunk (a timer
  handle cancelled and pushed on the loop's heap per chunk), the obvious alternative.

Run from the repository root: ``python -m bench.stall_clock``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from bourse.services.stall_clock import StallClock

STALL_S = 120.0


async def _chunks(n: int) -> AsyncGenerator[int, None]:
    for i in range(n):
        yield i
        if not i % 64:
            await asyncio.sleep(0)


async def bare(n: int) -> float:
    t0 = time.perf_counter()
    async for _ in _chunks(n):
        pass
    return time.perf_counter() - t0


async def clock(n: int) -> float:
    t0 = time.perf_counter()
    c = StallClock(STALL_S)
    c.pull = 1
    async for _ in _chunks(n):
        c.pull = 0
        c.pull = 1
    c.stop()
    return time.perf_counter() - t0


async def timeout(n: int) -> float:
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    async with asyncio.timeout(STALL_S) as cm:
        async for _ in _chunks(n):
            cm.reschedule(loop.time() + STALL_S)
    return time.perf_counter() - t0


async def main(chunks: int, repeat: int) -> None:
    ways: dict[str, Callable[[int], Awaitable[float]]] = {"bare": bare, "clock": clock, "timeout": timeout}
    best = {name: float("inf") for name in ways}
    for _ in range(repeat):
        for name, way in ways.items():
            best[name] = min(best[name], await way(chunks))
    base = best["bare"]
    for name, t in best.items():
        print(f"{name:8s} {t * 1e9 / chunks:8.1f} ns/chunk  (+{(t - base) * 1e9 / chunks:7.1f} over bare)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.stall_clock", description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=int, default=300_000)
    p.add_argument("--repeat", type=int, default=15)
    a = p.parse_args()
    asyncio.run(main(a.chunks, a.repeat))
