"""The database's size per request, on SQLite and PostgreSQL (docs/operating.md, "Sizing
and retention").

A ``bourse serve`` process (the ``sim`` engine, nothing else running) takes ``--warm``
requests, then ``--n`` more; the size of every table (its indexes included) is read
after each, and the difference divided by ``--n``. A request is a non-streamed chat
completion with a short prompt and 16 generated tokens: one hold (placed, then
settled) and one usage record with its receipt. SQLite: the bytes of each table's and
index's pages (``dbstat``), read on the live file; PostgreSQL: ``pg_total_relation_size``
after a ``VACUUM`` (so dead row versions of the settled holds are not counted twice).

With ``--retention-s`` the same run is made with ``[storage] retention_s`` set and the
load spread over five rounds a retention apart, measured right after the last: the
steady state, about ``retention_s`` times the request rate times the bytes a request,
the pages a prune freed reused by later rows ("on disk" counts the free pages too; on
PostgreSQL a ``VACUUM`` between rounds stands for autovacuum).

    python -m bench.dbsize --n 5000
    python -m bench.dbsize --n 5000 --retention-s 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import httpx
import psycopg

from bench.common import gateway_process

CONFIG = """
[server]
log_level = "warning"
{storage}
[products.sim]
sim_overrides = true
[[products.sim.deployments]]
engine = "sim"
slots = 32
floor = 1.0
tokens_per_s = 0
"""
BODY = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Tell me something about rivers."}],
    "max_tokens": 16,
    "sim": {"output_tokens": 16},
}


def _sqlite_sizes(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
        tables = dict(
            conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')")
        )
    finally:
        conn.close()
    out: dict[str, int] = {}
    for name, size in rows:
        table = tables.get(name, name)  # an index counts with its table
        out[table] = out.get(table, 0) + int(size)
    return out


def _pg_sizes(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM")
        rows = conn.execute(
            "SELECT relname, pg_total_relation_size(relid) FROM pg_stat_user_tables"
        ).fetchall()
    return {str(name): int(size) for name, size in rows}


def _sqlite_file(path: Path) -> int:
    """The database's pages, used and free (what the file takes, the WAL aside)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(conn.execute("PRAGMA page_count").fetchone()[0]) * int(
            conn.execute("PRAGMA page_size").fetchone()[0]
        )
    finally:
        conn.close()


def _pg_database(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    assert row is not None
    return int(row[0])


async def _load(base: str, key: str, n: int, concurrency: int) -> None:
    left = n
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=60) as c:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                r = await c.post("/chat/completions", json=BODY)
                r.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(kind: str, dsn: str | None, args: argparse.Namespace) -> None:
    storage = ""
    if args.retention_s:
        storage = (
            f"[storage]\nretention_s = {args.retention_s}\nretention_interval_s = {args.retention_s / 5}\n"
        )
    with tempfile.TemporaryDirectory(prefix="bourse-dbsize-") as d:

        def sizes() -> dict[str, int]:
            return _pg_sizes(dsn) if dsn else _sqlite_sizes(Path(d) / "bourse.db")

        with gateway_process(CONFIG.format(storage=storage), database=dsn, data_dir=Path(d)) as (v1, key, _):
            asyncio.run(_load(v1, key, args.warm, args.concurrency))
            before = sizes()
            t0 = time.monotonic()
            if args.retention_s:  # spread over several retention periods (measured after the last)
                rounds = 5
                for i in range(rounds):
                    if i:
                        time.sleep(args.retention_s)
                        if dsn:  # what autovacuum does over a longer run: the pruned rows' space reusable
                            _pg_sizes(dsn)
                    asyncio.run(_load(v1, key, args.n // rounds, args.concurrency))
            else:
                asyncio.run(_load(v1, key, args.n, args.concurrency))
            dt = time.monotonic() - t0
            after = sizes()
            on_disk = _pg_database(dsn) if dsn else _sqlite_file(Path(d) / "bourse.db")
    total_before, total_after = sum(before.values()), sum(after.values())
    label = f"{kind}" + (f", retention_s = {args.retention_s:g}" if args.retention_s else "")
    print(
        f"{label}: {args.n} requests in {dt:.1f} s; database {total_before / 1e6:.2f} MB -> {total_after / 1e6:.2f} MB"
    )
    print(
        f"  {(total_after - total_before) / args.n:8.0f} bytes a request in all; {on_disk / 1e6:.2f} MB on disk"
    )
    for table in sorted(after, key=lambda t: after[t] - before.get(t, 0), reverse=True):
        grew = after[table] - before.get(table, 0)
        if grew:
            print(f"  {grew / args.n:8.0f} bytes a request in {table} (now {after[table] / 1e6:.2f} MB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--warm", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--retention-s", type=float, default=0.0)
    ap.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--only", choices=["sqlite", "postgres"])
    args = ap.parse_args()
    if args.only != "postgres":
        measure("sqlite", None, args)
    if args.only != "sqlite":
        name = "bourse_dbsize_" + os.urandom(4).hex()
        with psycopg.connect(args.postgres, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        try:
            measure("postgres", args.postgres.rsplit("/", 1)[0] + "/" + name, args)
        finally:
            with psycopg.connect(args.postgres, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
