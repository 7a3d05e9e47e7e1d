"""The arrivals and run lengths of the market bench (issue 38, item 1): what
``bench/market.py`` plans each run with, and the warm-up before it.

- **arrivals**: Poisson at the run's rate, or **bursty**: on/off modulated Poisson
  with the same mean rate (on for :data:`BURST_ON_S`, off for :data:`BURST_OFF_S` on
  average, both exponential; while on, the rate is the mean rate times
  ``(on + off) / on``), the on/off schedule drawn by a generator of its own;
- **run lengths**: short (the bench's ``TOKENS``) or, in a **mixed** run,
  :data:`LONG_SHARE` of the orders long (:data:`LONG_TOKENS`), chosen by a generator
  of its own, so the rest of the plan is the same; the capacity (and so the load's
  multiple) counts the mix's mean run;
- **warm-up**: a gateway's forecast learns from the runs it has seen; a gateway just
  started has seen none. Before the measured orders, :data:`WARMUP_ORDERS` short orders
  per replica, fewer than the slots take (none waits, none is scored), then the
  upstream's record is cleared: each run measures a gateway that has seen a few runs,
  as one that has served for a while has.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import aiohttp

LONG_SHARE = 0.2
LONG_TOKENS = (120, 200)
BURST_ON_S = 2.0
BURST_OFF_S = 4.0
WARMUP_ORDERS = 5
WARMUP_SPAN_S = 6.0
WARMUP_FIRST_N = 1_000_000
"""Warm-up orders are numbered from here (the measured ones from 0)."""


def mean_tokens(tokens: tuple[int, int], mixed: bool) -> float:
    short = (tokens[0] + tokens[1]) / 2
    if not mixed:
        return short
    return (1 - LONG_SHARE) * short + LONG_SHARE * (LONG_TOKENS[0] + LONG_TOKENS[1]) / 2


def capacity_per_s(slots: int, tokens: tuple[int, int], tokens_per_s: float, mixed: bool) -> float:
    """Requests a second the slots serve at the mix's mean run."""
    return slots / (mean_tokens(tokens, mixed) / tokens_per_s)


def arrival_times(
    seconds: float, rate: float, bursty: bool, rng: random.Random, seed: int
) -> Iterator[float]:
    """Arrival offsets in [0, ``seconds``), ``rate`` a second on average (the gaps drawn
    from ``rng``; a bursty run's on/off schedule from a generator seeded ``seed``)."""
    if not bursty:
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                return
            yield t
    sched = random.Random(seed)
    on_rate = rate * (BURST_ON_S + BURST_OFF_S) / BURST_ON_S
    start, end = 0.0, sched.expovariate(1 / BURST_ON_S)  # the current on period
    t = 0.0
    while True:
        t += rng.expovariate(on_rate)
        while t >= end:  # past this on period: the time over it goes into the next one
            over = t - end
            start = end + sched.expovariate(1 / BURST_OFF_S)
            end = start + sched.expovariate(1 / BURST_ON_S)
            t = start + over
        if t >= seconds:
            return
        yield t


def long_runs(orders: list[object], seed: int) -> None:
    """:data:`LONG_SHARE` of ``orders`` ask for :data:`LONG_TOKENS` (``o.tokens``)."""
    rng = random.Random(seed)
    for o in orders:
        if rng.random() < LONG_SHARE:
            o.tokens = rng.randint(*LONG_TOKENS)  # type: ignore[attr-defined]


async def warm_up(bases: list[tuple[str, str]], tokens: tuple[int, int], tokens_per_s: float) -> None:
    """:data:`WARMUP_ORDERS` short orders per replica over :data:`WARMUP_SPAN_S`, each
    answered before this returns."""
    rng = random.Random(7)
    gap = WARMUP_SPAN_S / WARMUP_ORDERS
    async with aiohttp.ClientSession() as http:

        async def one(i: int, replica: int, base: str, key: str) -> None:
            await asyncio.sleep((i + replica / len(bases)) * gap)
            n = rng.randint(*tokens)
            body = {"model": "p", "messages": [{"role": "user", "content": f"order {WARMUP_FIRST_N + i * len(bases) + replica}"}],
                    "max_price": 1.0, "max_tokens": n, "timeout": 30,
                    "sim": {"output_tokens": n, "tokens_per_s": tokens_per_s}}  # fmt: skip
            async with http.post(base + "/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as r:  # fmt: skip
                await r.read()

        await asyncio.gather(
            *(one(i, r, b, k) for i in range(WARMUP_ORDERS) for r, (b, k) in enumerate(bases))
        )
