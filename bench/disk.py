"""Bytes written to disk a request (issue 40): the gateway on SQLite and on PostgreSQL.

    .venv/bin/python -m bench.disk [--quick] [--out bench/RESULTS.md] [--json FILE]

Also run by ``bash bench/run.sh`` (scenario i of bench/harness.py).

A ``bourse serve`` process (embedded SQLite in a data folder on the machine's disk, one
``sim`` product answering at once) takes a warm-up of ``WARM`` requests, stays idle
until its WAL is checkpointed and emptied (``IDLE_S``), then takes ``n`` non-streamed
requests of 8 generated tokens at concurrency ``c`` (1,000 at c=1, 4,000 at c=32), and
stays idle again. What is measured over that window, divided by ``n``:

- SQLite: the gateway's ``write_bytes`` in ``/proc/<pid>/io`` (what the process sent
  to the block layer: the WAL frames of each commit, then the same pages again when the
  checkpoint copies them into the database file), and the growth of the database file;
  the WAL file's size right after the last request (the log written since the idle
  checkpoint emptied it, when no reset came in between);
- PostgreSQL (the same gateway with ``--database``, a fresh database of its own):
  the WAL written between ``pg_current_wal_lsn()`` before and after, of this database
  (its records, read with ``pg_walinspect``: those naming its relations' blocks and
  every record, commits included, of a transaction that wrote one), and of the whole
  cluster (``pg_wal_lsn_diff``: other sessions' writes in the window count there too,
  and on a shared server they dwarf the gateway's).

Bytes do not depend on the machine's speed, so this runs on a busy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from bench.common import gateway_process, report

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## (i) bytes written to disk a request (bench/disk.py)"
CONFIG = """
[server]
log_level = "warning"
[products.sim]
sim_overrides = true
[[products.sim.deployments]]
engine = "sim"
slots = 64
floor = 1.0
tokens_per_s = 0
"""
TOKENS = 8
BODY = {
    "model": "sim",
    "messages": [{"role": "user", "content": "Tell me something about rivers."}],
    "max_tokens": TOKENS,
    "sim": {"output_tokens": TOKENS},
}
RUNS = ((1, 1000), (32, 4000))
"""(concurrency, requests) of each run, as in the issue."""
WARM = 300
IDLE_S = 2.5
"""Longer than the SQLite store's IDLE_CHECKPOINT_S: the idle pass has emptied the WAL."""
PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TARGETS = {("sqlite", 1): 16_000, ("sqlite", 32): 8_000, ("postgres", 1): 2_000, ("postgres", 32): 2_000}
"""Issue 40's targets, bytes a request: written by the gateway on SQLite, WAL on PostgreSQL."""


def log(msg: str) -> None:
    print(f"[disk {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_bytes(pid: int) -> int:
    """The process's ``write_bytes`` (all its threads) from ``/proc/<pid>/io``."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"no write_bytes in /proc/{pid}/io")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _lsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


OURS = """
WITH r AS (SELECT xid, record_length, block_ref FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)),
mine AS (SELECT DISTINCT xid FROM r WHERE xid <> 0 AND block_ref ~ %s)
SELECT COALESCE(SUM(record_length), 0), pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)
FROM r WHERE block_ref ~ %s OR xid IN (SELECT xid FROM mine)
"""


PROFILE = """
WITH r AS (SELECT xid, record_length, fpi_length, resource_manager, record_type, block_ref
           FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)),
mine AS (SELECT DISTINCT xid FROM r WHERE xid <> 0 AND block_ref ~ %s),
ours AS (SELECT *, substring(block_ref from %s)::oid AS node FROM r
         WHERE block_ref ~ %s OR xid IN (SELECT xid FROM mine))
SELECT COALESCE(c.relname, resource_manager) AS what, SUM(record_length), SUM(fpi_length), COUNT(*)
FROM ours LEFT JOIN pg_class c ON c.relfilenode = ours.node
GROUP BY 1 ORDER BY 2 DESC
"""


def _pg_profile(dsn: str, before: str, after: str) -> dict[str, list[int]]:
    """This database's WAL records by relation (their first block's; a commit record
    by its resource manager): [bytes, of which full-page images, records]."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        oid = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
        assert oid is not None
        rel = f"rel [0-9]+/{int(oid[0])}/"
        node = f"rel [0-9]+/{int(oid[0])}/([0-9]+)"
        rows = conn.execute(PROFILE, (before, after, rel, node, rel)).fetchall()
    return {str(w): [int(b), int(f or 0), int(k)] for w, b, f, k in rows}


def _pg_wal(dsn: str, before: str) -> tuple[int, int, str]:
    """(WAL bytes of this database's records, WAL bytes of the cluster, the LSN now) since ``before``:
    the records that name one of its relations' blocks, and every record (commits
    included) of a transaction that wrote one (``pg_walinspect``)."""
    after = _lsn(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        oid = conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()
        assert oid is not None
        rel = f"rel [0-9]+/{int(oid[0])}/"
        row = conn.execute(OURS, (before, after, rel, after, before, rel)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), after


def wal_profile(db: Path) -> dict[str, Any]:
    """What the WAL of ``db`` holds (the frames of its current log, read from the file):
    frames by table or index (``dbstat`` on the live file; a page not in it, e.g. a free
    one, is ``other``), and the commits (frames that end a transaction)."""
    data = Path(str(db) + "-wal").read_bytes()
    if len(data) < 32:
        return {"frames": 0, "commits": 0, "by_name": {}}
    page_size = int.from_bytes(data[8:12], "big")
    salts = data[16:24]
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        names = dict(conn.execute("SELECT pageno, name FROM dbstat"))
    finally:
        conn.close()
    by_name: dict[str, int] = {}
    frames = commits = 0
    for off in range(32, len(data) - 24 - page_size + 1, 24 + page_size):
        if data[off + 8 : off + 16] != salts:  # a frame of an earlier log
            break
        pgno = int.from_bytes(data[off : off + 4], "big")
        commits += int.from_bytes(data[off + 4 : off + 8], "big") != 0
        frames += 1
        name = names.get(pgno, "other")
        by_name[name] = by_name.get(name, 0) + 1
    return {"frames": frames, "commits": commits, "page_size": page_size, "by_name": by_name}


async def load(base: str, key: str, n: int, concurrency: int) -> None:
    """``n`` chat completions, ``concurrency`` at a time; each must succeed (aiohttp: the
    client's CPU a request is a third of httpx's, so c=32 keeps 32 requests in the
    gateway on this 2-core machine)."""
    left = n
    headers = {"authorization": f"Bearer {key}"}
    body = json.dumps(BODY).encode()
    async with aiohttp.ClientSession(
        headers=headers, connector=aiohttp.TCPConnector(limit=concurrency)
    ) as http:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                async with http.post(
                    base + "/chat/completions", data=body, headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                    r.raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def measure(store: str, concurrency: int, n: int, warm: int, pg_url: str) -> dict[str, Any]:
    """One gateway, one run: bytes a request over ``n`` requests after ``warm``."""
    dsn = None
    name = "bourse_disk_" + os.urandom(4).hex()
    if store == "postgres":
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        dsn = pg_url.rsplit("/", 1)[0] + "/" + name
    try:
        with (
            contextlib.ExitStack() as stack,
            tempfile.TemporaryDirectory(prefix="bourse-disk-") as d,
            gateway_process(CONFIG, database=dsn, data_dir=Path(d)) as (v1, key, proc),
        ):
            db, wal = Path(d) / "bourse.db", Path(d) / "bourse.db-wal"
            asyncio.run(load(v1, key, warm, concurrency))
            time.sleep(IDLE_S)
            if dsn:  # a temporary slot keeps the WAL until it is read (dropped with its session)
                keep = stack.enter_context(psycopg.connect(dsn, autocommit=True))
                keep.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
                keep.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", (name,))
            io0, db0, lsn0 = write_bytes(proc.pid), _size(db), _lsn(dsn) if dsn else ""
            t0 = time.monotonic()
            asyncio.run(load(v1, key, n, concurrency))
            dt = time.monotonic() - t0
            wal_end = _size(wal)
            profile = wal_profile(db) if dsn is None else {}
            time.sleep(IDLE_S)
            io1, db1 = write_bytes(proc.pid), _size(db)
            wal_pg, wal_cluster, lsn1 = _pg_wal(dsn, lsn0) if dsn else (0, 0, "")
            if dsn:
                profile = {"by_relation": _pg_profile(dsn, lsn0, lsn1)}
    finally:
        if dsn is not None:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    return {
        "store": store,
        "c": concurrency,
        "n": n,
        "per_s": n / dt,
        "written": (io1 - io0) / n,
        "db_growth": (db1 - db0) / n,
        "wal_file": wal_end / n,
        "pg_wal": wal_pg / n,
        "pg_wal_cluster": wal_cluster / n,
        "wal": profile,
    }


def scenario(
    quick: bool = False, pg_url: str | None = None, stores: tuple[str, ...] = ("sqlite", "postgres")
) -> dict[str, Any]:
    """Every row (what the harness calls): SQLite, then PostgreSQL, c=1 and c=32."""
    url = pg_url or os.environ.get("BOURSE_DISK_POSTGRES_URL", PG_URL)
    rows: list[dict[str, Any]] = []
    for store in stores:
        for c, n in RUNS:
            n = n // 5 if quick else n
            try:
                row = measure(store, c, n, WARM // 3 if quick else WARM, url)
            except Exception as exc:
                row = {"store": store, "c": c, "n": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
            log(_summary(row))
            rows.append(row)
    return {"rows": rows, "quick": quick}


def _summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['store']} c={r['c']}: {r['error']}"
    return _profile_line(r) + (
        f"{r['store']} c={r['c']}: {r['written'] / 1000:.1f} KB written a request by the gateway, "
        f"db +{r['db_growth']:.0f} B, WAL file {r['wal_file'] / 1000:.1f} KB, "
        f"PostgreSQL WAL {r['pg_wal'] / 1000:.2f} KB (cluster {r['pg_wal_cluster'] / 1000:.1f} KB) "
        f"({r['per_s']:.0f} requests/s)"
    )


def _profile_line(r: dict[str, Any]) -> str:
    """SQLite: the WAL's frames a request by table and index (of the log since its last
    restart: a sample of the run), and its commits a frame. PostgreSQL: the WAL's bytes
    a request by relation, with the full-page images' share."""
    p, n = r.get("wal") or {}, r["n"]
    if "by_relation" in p:
        top = sorted(p["by_relation"].items(), key=lambda kv: -kv[1][0])
        parts = ", ".join(
            f"{name} {b / n:.0f} B ({f / n:.0f} in page images)" for name, (b, f, _) in top[:10]
        )
        return f"{r['store']} c={r['c']}: WAL bytes a request by relation: {parts}\n"
    if not p.get("frames"):
        return ""
    top = sorted(p["by_name"].items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{name} {k / n:.2f}" for name, k in top[:10])
    share = ", ".join(f"{name} {k / p['frames'] * 100:.0f} %" for name, k in top[:10])
    return (
        f"{r['store']} c={r['c']}: WAL frames a commit {p['frames'] / max(1, p['commits']):.1f} "
        f"({p['page_size']}-byte pages), by table or index: {share}\n"
    )


def target_rows(res: dict[str, Any]) -> list[list[str]]:
    """Issue 40's rows of the targets table: (scenario, target, measured, met)."""
    out = []
    found = {(r["store"], r["c"]): r for r in res.get("rows", []) if "error" not in r}
    for (store, c), limit in TARGETS.items():
        what = "written by the gateway" if store == "sqlite" else "PostgreSQL WAL"
        label = f"(i) bytes a request, {store}, c={c}"
        target = f"≤ {limit / 1000:g} KB {what}"
        r = found.get((store, c))
        if r is None:
            out.append([label, target, "—", "not measured"])
            continue
        got = r["written"] if store == "sqlite" else r["pg_wal"]
        out.append([label, target, f"{got / 1000:.1f} KB", "**met**" if got <= limit else "**missed**"])
    return out


def section_lines(res: dict[str, Any]) -> list[str]:
    """The RESULTS.md section of this bench."""
    L = [HEADING, ""]
    if "error" in res:
        return [*L, f"error: {res['error']}", ""]
    L.append(
        f"`bourse serve` with one `sim` product (answers at once), non-streamed requests of {TOKENS} "
        f"tokens, metering on; {WARM} requests of warm-up, then the WAL emptied (idle {IDLE_S:g} s), then "
        "the requests measured, then idle again (the checkpoint of what they wrote is in the figures). "
        "*Written*: the gateway's `write_bytes` (`/proc/<pid>/io`) a request; *WAL file*: the SQLite WAL's "
        "size right after the last request, a request; *PostgreSQL WAL*: the WAL records of the gateway's "
        "database between `pg_current_wal_lsn()` before and after (`pg_walinspect`), a request; *cluster*: "
        "`pg_wal_lsn_diff` of the two, every session's (the server is shared with other work)."
        + (" Quick run (a fifth of the requests)." if res.get("quick") else "")
    )
    L.append("")
    L.append(
        "| store | c | requests | requests/s | written KB/request | db growth B/request | WAL file KB/request | PostgreSQL WAL KB/request | cluster WAL KB/request |"
    )
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res["rows"]:
        if "error" in r:
            L.append(f"| {r['store']} | {r['c']} | {r['n']:,} | {r['error']} | | | | | |")
            continue
        pg = (
            f"{r['pg_wal'] / 1000:.2f} | {r['pg_wal_cluster'] / 1000:.1f}"
            if r["store"] == "postgres"
            else "— | —"
        )
        wal = f"{r['wal_file'] / 1000:.1f}" if r["store"] == "sqlite" else "—"
        L.append(
            f"| {r['store']} | {r['c']} | {r['n']:,} | {r['per_s']:,.0f} | {r['written'] / 1000:.1f} "
            f"| {r['db_growth']:.0f} | {wal} | {pg} |"
        )
    L.append("")
    profiles = [line for r in res["rows"] if "error" not in r and (line := _profile_line(r))]
    if profiles:
        L.append(
            "Where the bytes went. SQLite: the WAL's pages by table or index (the frames of the log since its "
            "last restart, a sample of the run; each page is written twice, to the WAL and at the checkpoint). "
            "PostgreSQL: the database's WAL records by the relation of their first block (a commit record "
            "by its resource manager, `Transaction`), and the full-page images in them:"
        )
        L.append("")
        L.extend(f"- {line.strip()}" for line in profiles)
        L.append("")
    L.append("| target (issue 40) | limit | measured | met |")
    L.append("|---|---|---|---|")
    for row in target_rows(res):
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    L.append("Command: `.venv/bin/python -m bench.disk" + (" --quick" if res.get("quick") else "") + "`.")
    L.append("")
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a fifth of the requests, one round")
    ap.add_argument("--postgres", default=None, help=f"a server to make a database on (default {PG_URL})")
    ap.add_argument("--only", choices=["sqlite", "postgres"], help="one store")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()
    res = scenario(args.quick, args.postgres, (args.only,) if args.only else ("sqlite", "postgres"))
    report(res, section_lines(res), HEADING, args.out, args.json)


if __name__ == "__main__":
    main()
