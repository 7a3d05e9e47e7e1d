"""The order book: domain operations per second, and admission latency through the
gateway with 10,000 orders waiting.

    .venv/bin/python -m bench.book [--depth 10000] [--ops 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import statistics
import time

import httpx

from bench.common import gateway, pct
from bourse.domain.book import Deployment, Order, ProductBook


def domain_ops(n: int) -> dict[str, float]:
    rng = random.Random(7)
    book = ProductBook("p", [Deployment("d", 0.01, 64)], max_waiting=n + 10)
    dep = book.deployment("d")
    dep.busy = dep.slots  # all busy: orders rest in the book
    orders = [Order(str(i), round(rng.uniform(0.01, 2.0), 4), book.next_seq(), 0.0) for i in range(n)]
    t0 = time.perf_counter()
    for o in orders:
        book.add(o)
    t1 = time.perf_counter()
    for o in orders[::2]:
        book.remove(o)
    t2 = time.perf_counter()
    admitted = 0
    while book.waiting:
        book.release("d")
        admitted += len(book.dispatch(0.0))
    t3 = time.perf_counter()
    total_ops = n + n // 2 + admitted
    return {
        "insert_per_s": n / (t1 - t0),
        "cancel_per_s": (n // 2) / (t2 - t1),
        "admit_per_s": admitted / (t3 - t2),
        "mixed_per_s": total_ops / (t3 - t0),
    }


CONFIG = """
[server]
log_level = "warning"
book_timeout_s = 600
[products.deep]
max_waiting = 50000
sim_overrides = true
stall_timeout_s = 86400
[[products.deep.deployments]]
name = "cheap"
engine = "sim"
slots = 1
floor = 0.01
ttft_ms = 600000
[[products.deep.deployments]]
name = "dear"
engine = "sim"
slots = 4
floor = 1.0
"""


async def park(host: str, port: int, key: str, n: int) -> list[asyncio.StreamWriter]:
    """Open ``n`` streaming requests that will wait in the book; never read them."""
    writers = []
    for i in range(n):
        body = (
            '{"model":"deep","stream":true,"max_tokens":4,"max_price":%.4f,'
            '"messages":[{"role":"user","content":"wait"}]}' % (0.01 + (i % 400) / 10000)
        ).encode()
        req = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode() + body
        _, w = await asyncio.open_connection(host, port)
        w.write(req)
        writers.append(w)
        if i % 500 == 499:
            await asyncio.sleep(0.05)
    return writers


async def latency(base: str, key: str, runs: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=60) as c:
        for _ in range(runs):
            t0 = time.perf_counter()
            r = await c.post(
                base + "/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={
                    "model": "deep",
                    "max_tokens": 4,
                    "max_price": 2.0,
                    "sim": {"output_tokens": 4},
                    "messages": [{"role": "user", "content": "now"}],
                },
            )
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
    return out


async def through_gateway(depth: int, runs: int) -> dict[str, float]:
    with gateway(CONFIG, cpu=0) as (base, key):
        host, port = base.split("//")[1].split("/")[0].split(":")
        empty = await latency(base, key, runs)
        writers = await park(host, int(port), key, depth)
        async with httpx.AsyncClient() as c:
            for _ in range(200):
                m = (await c.get(base + "/market/deep")).json()
                if m["waiting"] >= depth - 1:
                    break
                await asyncio.sleep(0.1)
        deep = await latency(base, key, runs)
        waiting = m["waiting"]
        for w in writers:
            w.close()
    return {
        "waiting": waiting,
        "p50_empty_ms": statistics.median(empty),
        "p50_deep_ms": statistics.median(deep),
        "p99_deep_ms": pct(deep, 99),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=10_000)
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.depth * 2 + 1000)), hard))
    d = domain_ops(args.ops)
    print(
        f"domain book, {args.ops} orders: insert {d['insert_per_s']:,.0f}/s, cancel {d['cancel_per_s']:,.0f}/s, "
        f"admit {d['admit_per_s']:,.0f}/s, insert+cancel+admit {d['mixed_per_s']:,.0f} ops/s"
    )
    g = asyncio.run(through_gateway(args.depth, args.runs))
    print(
        f"gateway, non-stream request admitted at once (max_price above the waiting orders), {args.runs} runs:"
    )
    print(
        f"  book empty: p50 {g['p50_empty_ms']:.2f} ms; with {g['waiting']} orders waiting: "
        f"p50 {g['p50_deep_ms']:.2f} ms, p99 {g['p99_deep_ms']:.2f} ms"
    )


if __name__ == "__main__":
    main()
