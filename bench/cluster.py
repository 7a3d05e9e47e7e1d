"""The shared book: admission latency of the Redis book against the in-process one,
and admission throughput with one and with two replicas against the same Redis.

    .venv/bin/python -m bench.cluster [--redis redis://127.0.0.1:6379/0] [--seconds 5]

1. Book port alone, c=1: ``submit`` of an order that is admitted at once, then
   ``release``; p50/p99 of the submit (the admission) for ``LocalBook`` and
   ``RedisBook``.
2. Book port alone, throughput: each replica is a process with its own hub
   (connection pool, channel, heartbeat) running 32 concurrent loops of
   submit -> admitted -> release on one product of 64 slots, for ``--seconds``;
   admissions/s with one replica and with two (pinned one per core when possible).
3. Through the gateway, c=1: a non-streamed request to the in-process ``sim``
   engine (no upstream), with the book in process and in Redis; the p50/p99
   difference is the added admission latency a client sees.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import httpx

from bench.common import gateway, pct
from bourse.coordination.book_local import LocalBook
from bourse.domain.book import Deployment, ProductBook


def _deps(slots: int) -> list[Deployment]:
    return [Deployment("d", 0.01, slots)]


async def _redis_book(url: str, prefix: str, slots: int) -> Any:
    from bourse.coordination.book_redis import RedisBook
    from bourse.coordination.redis_hub import RedisHub

    hub = RedisHub(url, prefix=prefix, lease_s=3.0)
    book = RedisBook(hub, "p", _deps(slots), max_waiting=100_000)
    await hub.start()
    await book.start()
    return hub, book


async def _latency(book: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        order = book.new_order(f"o{os.getpid()}-{i}", 1.0)
        t0 = time.perf_counter()
        fut = await book.submit(order)
        adm = await book.wait(order, fut, asyncio.get_running_loop().time() + 10)
        out.append((time.perf_counter() - t0) * 1e6)
        book.release(adm)
        await asyncio.sleep(0)
    return out


async def latency(url: str, n: int) -> dict[str, dict[str, float]]:
    local = LocalBook(ProductBook("p", _deps(4)))
    lat_local = await _latency(local, n)
    hub, rb = await _redis_book(url, "benchlat" + os.urandom(4).hex(), 4)
    try:
        await _latency(rb, 200)  # warm-up
        lat_redis = await _latency(rb, n)
    finally:
        await hub.aclose()
    return {
        "in-process": {"p50_us": statistics.median(lat_local), "p99_us": pct(lat_local, 99)},
        "redis": {"p50_us": statistics.median(lat_redis), "p99_us": pct(lat_redis, 99)},
    }


async def _replica_loop(url: str, prefix: str, seconds: float, conc: int, start_at: float) -> int:
    hub, book = await _redis_book(url, prefix, 64)
    done = 0
    stop = False

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        loop = asyncio.get_running_loop()
        while not stop:
            i += 1
            order = book.new_order(f"{hub.replica}-{w}-{i}", 1.0)
            fut = await book.submit(order)
            adm = await book.wait(order, fut, loop.time() + 30)
            book.release(adm)
            done += 1

    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        tasks = [asyncio.create_task(worker(w)) for w in range(conc)]
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        stop = True
        n = done
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    finally:
        await hub.aclose()
    return int(n / elapsed)


def _replica_proc(
    url: str, prefix: str, seconds: float, conc: int, start_at: float, cpu: int | None, q: Any
) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    q.put(asyncio.run(_replica_loop(url, prefix, seconds, conc, start_at)))


def throughput(url: str, replicas: int, seconds: float, conc: int) -> list[int]:
    prefix = "benchtp" + os.urandom(4).hex()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 3.0
    ncpu = os.cpu_count() or 1
    procs = [
        ctx.Process(
            target=_replica_proc,
            args=(url, prefix, seconds, conc, start_at, (i % ncpu) if replicas > 1 else None, q),
        )
        for i in range(replicas)
    ]
    for p in procs:
        p.start()
    rates = [q.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    return rates


CONFIG = """
[server]
log_level = "warning"
{cluster}
[products.fast]
sim_overrides = true
[[products.fast.deployments]]
engine = "sim"
slots = 64
floor = 0.01
ttft_ms = 0
tokens_per_s = 0
"""


def gateway_latency(url: str | None, runs: int) -> dict[str, float]:
    cluster = ""
    if url:
        cluster = f'[cluster]\nredis_url = "{url}"\nkey_prefix = "benchgw{os.urandom(4).hex()}"\n'
    with gateway(CONFIG.format(cluster=cluster)) as (base, key), httpx.Client(timeout=30) as c:
        body = {"model": "fast", "max_tokens": 4, "sim": {"output_tokens": 4},
                "messages": [{"role": "user", "content": "now"}]}  # fmt: skip
        hdr = {"authorization": f"Bearer {key}"}
        out = []
        for i in range(runs + 50):
            t0 = time.perf_counter()
            r = c.post(base + "/chat/completions", json=body, headers=hdr)
            r.raise_for_status()
            if i >= 50:
                out.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": statistics.median(out), "p99_ms": pct(out, 99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", default=os.environ.get("BOURSE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2000)
    args = ap.parse_args()
    print("1. book port, c=1, submit admitted at once (µs)")
    for name, v in asyncio.run(latency(args.redis, args.runs)).items():
        print(f"   {name:11s} p50 {v['p50_us']:8.1f}  p99 {v['p99_us']:8.1f}")
    print(f"2. book port, admissions/s (submit+admit+release), {args.concurrency} loops per replica")
    one = throughput(args.redis, 1, args.seconds, args.concurrency)
    two = throughput(args.redis, 2, args.seconds, args.concurrency)
    print(f"   1 replica : {sum(one):8,d}/s")
    print(
        f"   2 replicas: {sum(two):8,d}/s  ({' + '.join(f'{r:,d}' for r in two)}); ratio {sum(two) / max(1, sum(one)):.2f}"
    )
    print("3. through the gateway, c=1, non-streamed, sim engine (ms)")
    loc = gateway_latency(None, args.runs // 2)
    red = gateway_latency(args.redis, args.runs // 2)
    print(f"   in-process book p50 {loc['p50_ms']:.3f}  p99 {loc['p99_ms']:.3f}")
    print(f"   Redis book      p50 {red['p50_ms']:.3f}  p99 {red['p99_ms']:.3f}")
    print(
        f"   added by Redis  p50 {red['p50_ms'] - loc['p50_ms']:+.3f}  p99 {red['p99_ms'] - loc['p99_ms']:+.3f}"
    )


if __name__ == "__main__":
    main()
