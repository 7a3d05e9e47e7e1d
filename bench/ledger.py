"""The ledger alone: hold + settle throughput and latency on SQLite and PostgreSQL.

    .venv/bin/python -m bench.ledger [--n 2000] [--concurrency 1,32] [--accounts 1] [--postgres URL]

Each operation is one request's money: place a hold, then settle it with a usage
record (two transactions), exactly as the gateway does. The last column is this
process's CPU per pair (the gateway's share of the ledger's cost; the database's own
is not in it), steadier than the rate on a busy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import psycopg

from bench.common import pct
from bourse.ports.stores import Hold, UsageRecord
from bourse.storage.postgres import PostgresStore
from bourse.storage.sql import SqlStore
from bourse.storage.sqlite import SqliteStore


async def run(store: SqlStore, n: int, concurrency: int, accounts: int = 1) -> dict[str, float]:
    await store.open()
    now = time.time()
    base = "bench" + os.urandom(4).hex()
    names = [f"{base}-{k}" for k in range(accounts)]
    for name in names:
        await store.create_account(name, 10**12, now)
    hold_ms: list[float] = []
    settle_ms: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            account = names[i % accounts]
            rid = f"r{i}-{account}"
            t0 = time.perf_counter()
            await store.place_hold(
                Hold(f"h{i}-{account}", account, rid, 5000, "open", owner="bench", created_at=now)
            )
            t1 = time.perf_counter()
            rec = UsageRecord(rid, account, "p", now, "completed", 1234, {"usage": {"prompt_tokens": 10}})
            await store.settle(f"h{i}-{account}", 1234, rec, now)
            t2 = time.perf_counter()
            hold_ms.append((t1 - t0) * 1000)
            settle_ms.append((t2 - t1) * 1000)

    t, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(n)))
    dt, cpu = time.perf_counter() - t, time.process_time() - cpu
    totals = await store.totals()
    assert totals.balanced, totals
    await store.close()
    return {
        "settled_per_s": n / dt,
        "cpu_us": cpu / n * 1e6,
        "hold_p50_ms": pct(hold_ms, 50),
        "settle_p50_ms": pct(settle_ms, 50),
        "hold_p99_ms": pct(hold_ms, 99),
        "settle_p99_ms": pct(settle_ms, 99),
    }


async def fresh_pg(url: str) -> str:
    name = "bourse_bench_" + os.urandom(4).hex()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + "/" + name


async def drop_pg(url: str, dsn: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {dsn.rsplit('/', 1)[1]} WITH (FORCE)")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--accounts", type=int, default=1, help="spread the requests over this many accounts")
    args = ap.parse_args()
    print(
        f"{'store':10} {'conc':>5} {'settled/s':>10} {'hold p50':>9} {'settle p50':>11} {'hold p99':>9} {'settle p99':>11}  (ms)"
        "  client CPU µs/pair"
    )
    for c in (int(x) for x in args.concurrency.split(",")):
        with tempfile.TemporaryDirectory() as d:
            r = await run(SqliteStore(os.path.join(d, "b.db")), args.n, c, args.accounts)
        print(
            f"{'sqlite':10} {c:5} {r['settled_per_s']:10.0f} {r['hold_p50_ms']:9.2f} {r['settle_p50_ms']:11.2f} "
            f"{r['hold_p99_ms']:9.2f} {r['settle_p99_ms']:11.2f} {r['cpu_us']:8.0f}"
        )
        dsn = await fresh_pg(args.postgres)
        try:
            r = await run(PostgresStore(dsn, max_size=max(2, min(c, 20))), args.n, c, args.accounts)
        finally:
            await drop_pg(args.postgres, dsn)
        print(
            f"{'postgres':10} {c:5} {r['settled_per_s']:10.0f} {r['hold_p50_ms']:9.2f} {r['settle_p50_ms']:11.2f} "
            f"{r['hold_p99_ms']:9.2f} {r['settle_p99_ms']:11.2f} {r['cpu_us']:8.0f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
