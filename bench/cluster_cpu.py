"""The gateway's CPU a request in cluster mode against a single process (issue 40 item 4).

    .venv/bin/python -m bench.cluster_cpu [--quick] [--rounds 3] [--redis URL] [--out bench/RESULTS.md] [--json FILE]
    .venv/bin/python -m bench.cluster_cpu --quick --profile /tmp/prof   # cProfile dumps, <mode>.1 the window

Also run by ``bash bench/run.sh`` (scenario j of bench/harness.py).

A ``bourse serve`` process (one worker, one ``sim`` product answering at once) runs
twice with the same load: once alone (embedded SQLite, the book in process) and once
in cluster mode (``[cluster]`` Redis with a key prefix of its own, ``--database`` a
fresh PostgreSQL database of its own). Each takes ``WARM`` requests of warm-up, then
``n`` non-streamed requests at concurrency ``C`` (the aiohttp client of bench/disk.py).
What is measured over the ``n`` requests, divided by ``n``:

- the gateway process's CPU (user + sys from ``/proc/<pid>/stat``): it does not
  depend on how busy the machine is, the rate does;
- Redis commands (``INFO commandstats`` before and after, by command; the Lua
  scripts' inner calls are counted too, under their own names, and ``evalsha`` is
  the round trip). By default the bench starts a Redis server of its own on a free
  loopback port (``redis-server``, no persistence), so no other client's commands
  count; ``--redis URL`` uses a shared server instead (its other clients count);
- PostgreSQL transactions and rows written (``pg_stat_database`` of the gateway's
  own database: ``xact_commit``, ``tup_inserted + tup_updated + tup_deleted``; its
  statistics are flushed when the gateway's sessions are idle, so they are read
  after a pause).

The ratio cluster / single is issue 40's target (≤ 1.4).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.common import CLOCK, GATEWAY_SITE, cpu_s, free_port, gateway_process, report
from bench.disk import CONFIG, load

HEADING = "## (j) the gateway's CPU a request, cluster mode against one process (bench/cluster_cpu.py)"
C = 32
N = 4000
WARM = 500
TARGET = 1.4
"""Issue 40: cluster mode's CPU a request at most 1.4 times the single process's."""
SHARED_REDIS = "redis://127.0.0.1:6379/0"
PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
ROUNDS = 3
MODES = {
    "single": (False, False, False),
    "cluster": (True, True, False),
    "redis book, SQLite": (True, False, False),
    "local book, PostgreSQL": (False, True, False),
    "cluster, Unix sockets": (True, True, True),
}
"""Each run: (the book and limits in Redis, the ledger in PostgreSQL, both reached by
Unix sockets rather than loopback TCP). The third and fourth split cluster mode's
extra CPU between its two halves; the last shows what loopback TCP costs (a send on
it runs the receiver's side of TCP too, charged to the sender)."""
PG_SOCKETS = "/var/run/postgresql"
"""Where the PostgreSQL server's Unix socket is (the last mode runs only if it exists)."""
STATS_WAIT_S = 1.5
"""PostgreSQL flushes a backend's statistics at most once a second, when it is idle."""


def log(msg: str) -> None:
    print(f"[cluster_cpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def own_redis() -> Iterator[tuple[str, str]]:
    """A Redis server of the bench's own (no persistence) on a free loopback port and a
    Unix socket: (its redis:// URL, its unix:// URL)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bourse-redis-") as d:
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d]
        args += ["--unixsocket", f"{d}/redis.sock"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    redis.Redis(port=port).ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0", f"unix://{d}/redis.sock?db=0"
        finally:
            proc.terminate()
            proc.wait(10)


@contextlib.contextmanager
def monitored(url: str) -> Iterator[list[int]]:
    """``redis-cli monitor`` on ``url`` while inside; yields a list that gets, on exit,
    the commands clients sent (one a round trip, pipelined or not) and those a Lua
    script ran (MONITOR shows the latter from ``lua``)."""
    out: list[int] = []
    with tempfile.NamedTemporaryFile(prefix="bourse-monitor-") as f:
        mon = subprocess.Popen(["redis-cli", "-u", url, "monitor"], stdout=f, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        try:
            yield out
        finally:
            time.sleep(0.3)
            mon.terminate()
            mon.wait(10)
        lines = [ln for ln in Path(f.name).read_text(errors="replace").splitlines() if "] " in ln]
        sent = [ln for ln in lines if " lua] " not in ln and '"monitor"' not in ln]
        out += [len(sent), len(lines) - len(sent)]


@contextlib.contextmanager
def _profiled(folder: Path | None, mode: str) -> Iterator[None]:
    """While inside, a gateway started gets bench/gateway_site's cProfile hook."""
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "BENCH_CPROFILE_OUT")}
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (saved["PYTHONPATH"], str(GATEWAY_SITE)) if x)
    os.environ["BENCH_CPROFILE_OUT"] = str(folder / mode)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _dump(pid: int, path: Path) -> None:
    """SIGUSR1 to the profiled gateway, then wait for the dump at ``path``."""
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no profile dump at {path}")
        time.sleep(0.05)


def thread_cpu(pid: int) -> tuple[float, float]:
    """(the main thread's, every other thread's) user + sys seconds of process ``pid``:
    the event loop's thread against the database threads (psycopg's and SQLite's)."""
    main = other = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks = int(fields[11]) + int(fields[12])
        if task.name == str(pid):
            main += ticks
        else:
            other += ticks
    return main / CLOCK, other / CLOCK


def redis_calls(url: str) -> dict[str, int]:
    """Calls by command since the server started (``INFO commandstats``)."""
    info = redis.Redis.from_url(url).info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


def pg_counts(dsn: str) -> tuple[int, int]:
    """(transactions committed, rows written) of the database of ``dsn``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted FROM pg_stat_database"
            " WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _config(redis_url: str | None, prefix: str) -> str:
    if redis_url is None:
        return CONFIG
    return CONFIG + f'\n[cluster]\nredis_url = "{redis_url}"\nkey_prefix = "{prefix}"\n'


def measure(
    mode: str,
    n: int,
    warm: int,
    redis_url: str,
    pg_url: str,
    profile: Path | None = None,
    unix_redis: str | None = None,
) -> dict[str, Any]:
    """One gateway (a mode of :data:`MODES`), one run of ``n`` requests after ``warm``;
    with Redis then ``n // 8`` more under ``MONITOR`` (the round trips to Redis).
    ``profile``: the gateway runs under cProfile (bench/gateway_site) and the measured
    window's counts go to ``profile/<mode>.1`` (its CPU figure is then cProfile's too)."""
    use_redis, use_pg, unix = MODES[mode]
    dsn = None
    name = "bourse_cpu_" + os.urandom(4).hex()
    if use_pg:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        dsn = pg_url.rsplit("/", 1)[0] + "/" + name
    gateway_dsn = f"{dsn}?host={PG_SOCKETS}" if unix else dsn
    gateway_redis = unix_redis if unix else redis_url
    trips = [0, 0]
    m = max(1, n // 8)
    try:
        with (
            _profiled(profile, mode),
            gateway_process(_config(gateway_redis if use_redis else None, name), database=gateway_dsn) as (
                v1,
                key,
                proc,
            ),
        ):
            asyncio.run(load(v1, key, warm, C))
            if profile:
                _dump(proc.pid, profile / f"{mode}.0")
            time.sleep(STATS_WAIT_S if use_pg else 0)
            r0 = redis_calls(redis_url) if use_redis else {}
            pg0 = pg_counts(dsn) if dsn else (0, 0)
            th0, cpu0, t0 = thread_cpu(proc.pid), cpu_s(proc.pid), time.monotonic()
            asyncio.run(load(v1, key, n, C))
            cpu1, dt, th1 = cpu_s(proc.pid), time.monotonic() - t0, thread_cpu(proc.pid)
            if profile:
                _dump(proc.pid, profile / f"{mode}.1")
            r1 = redis_calls(redis_url) if use_redis else {}
            time.sleep(STATS_WAIT_S if use_pg else 0)
            pg1 = pg_counts(dsn) if dsn else (0, 0)
            if use_redis:
                with monitored(redis_url) as got:
                    asyncio.run(load(v1, key, m, C))
                trips = got
    finally:
        if dsn is not None:
            with psycopg.connect(pg_url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    by_cmd = {k: r1[k] - r0.get(k, 0) for k in r1 if k != "info" and r1[k] - r0.get(k, 0) > 0}
    return {
        "mode": mode,
        "n": n,
        "per_s": n / dt,
        "cpu_us": (cpu1 - cpu0) / n * 1e6,
        "loop_us": (th1[0] - th0[0]) / n * 1e6,
        "threads_us": (th1[1] - th0[1]) / n * 1e6,
        "redis": {k: v / n for k, v in sorted(by_cmd.items(), key=lambda kv: -kv[1])},
        "redis_sent": trips[0] / m,
        "redis_in_lua": trips[1] / m,
        "pg_xacts": (pg1[0] - pg0[0]) / n,
        "pg_rows": (pg1[1] - pg0[1]) / n,
    }


def scenario(
    quick: bool = False,
    redis_url: str | None = None,
    pg_url: str | None = None,
    profile: Path | None = None,
    rounds: int | None = None,
    only: list[str] | None = None,
) -> dict[str, Any]:
    """Every row (or the modes ``only`` names) (what the harness calls): single process, cluster mode, then each half
    of it, ``rounds`` times in turn (a busy machine drifts); each row is the round
    with the median CPU a request of its mode."""
    url = pg_url or os.environ.get("BOURSE_DISK_POSTGRES_URL", PG_URL)
    n, warm = (N // 4, WARM // 2) if quick else (N, WARM)
    rounds = rounds or (1 if quick else ROUNDS)
    own = False
    with contextlib.ExitStack() as stack:
        unix_redis = None
        if redis_url is None:
            own = shutil.which("redis-server") is not None
            redis_url, unix_redis = stack.enter_context(own_redis()) if own else (SHARED_REDIS, None)
        modes = [m for m in MODES if not MODES[m][2] or (unix_redis and Path(PG_SOCKETS).is_dir())]
        modes = [m for m in modes if only is None or m in only]
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode in modes:
                try:
                    row = measure(mode, n, warm, redis_url, url, profile, unix_redis)
                except Exception as exc:
                    row = {"mode": mode, "n": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
                log(_summary(row))
                runs[mode].append(row)
    rows = []
    for got in runs.values():
        ok = sorted((r for r in got if "error" not in r), key=lambda r: float(r["cpu_us"]))
        row = ok[len(ok) // 2] if ok else got[0]
        rows.append({**row, "cpu_us_rounds": [round(float(r["cpu_us"])) for r in ok]})
    return {"rows": rows, "quick": quick, "own_redis": own, "rounds": rounds}


def _summary(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['mode']}: {r['error']}"
    return (
        f"{r['mode']}: {r['cpu_us']:.0f} µs of gateway CPU a request ({r['loop_us']:.0f} the loop's thread, "
        f"{r['threads_us']:.0f} the others; {r['per_s']:.0f} requests/s); "
        f"Redis {r['redis_sent']:.2f} commands sent ({r['redis_in_lua']:.2f} run in scripts) a request, "
        f"PostgreSQL {r['pg_xacts']:.2f} transactions, {r['pg_rows']:.2f} rows written a request"
    )


def _ratio(res: dict[str, Any]) -> float | None:
    found = {r["mode"]: r for r in res.get("rows", []) if "error" not in r}
    if "single" not in found or "cluster" not in found:
        return None
    return float(found["cluster"]["cpu_us"] / found["single"]["cpu_us"])


def target_rows(res: dict[str, Any]) -> list[list[str]]:
    """Issue 40's row of the targets table: (scenario, target, measured, met)."""
    ratio = _ratio(res)
    label, target = "(j) cluster mode's CPU a request, one worker", f"≤ {TARGET:g}x the single process's"
    if ratio is None:
        return [[label, target, "—", "not measured"]]
    return [[label, target, f"{ratio:.2f}x", "**met**" if ratio <= TARGET else "**missed**"]]


def section_lines(res: dict[str, Any]) -> list[str]:
    """The RESULTS.md section of this bench."""
    L = [HEADING, ""]
    if "error" in res:
        return [*L, f"error: {res['error']}", ""]
    L.append(
        f"`bourse serve` (one worker) with one `sim` product (answers at once), non-streamed requests at c={C} "
        f"(aiohttp), {WARM} of warm-up, then the requests measured: alone (embedded SQLite, the book in "
        "process) and in cluster mode (`[cluster]` Redis, a key prefix of its own; `--database` a fresh "
        "PostgreSQL database). *CPU*: the gateway process's user + sys (`/proc/<pid>/stat`) a request; "
        "of it, the event loop's thread and the others (the ledger's: SQLite's or psycopg's; `/proc/<pid>/task`). "
        "*Redis sent*: the commands the gateway sent a request (each a round trip or part of a pipeline; "
        "`MONITOR` over an eighth as many requests more), *in scripts*: those its Lua scripts ran. "
        "*PostgreSQL*: `pg_stat_database` of the gateway's database, transactions committed and rows "
        "written a request. The last two rows are each half of cluster mode alone: the book and limits in "
        "Redis with the ledger in SQLite, and the book in process with the ledger in PostgreSQL; the last is "
        "cluster mode again with Redis and PostgreSQL reached by Unix sockets (`unix://`, `?host=` the "
        "server's socket folder) rather than loopback TCP."
        + (
            " Redis: a server of the bench's own."
            if res.get("own_redis")
            else " Redis: shared with other clients."
        )
        + f" Each mode ran {res.get('rounds', 1)} times in turn; a row is its round of median CPU."
        + (" Quick run (a quarter of the requests)." if res.get("quick") else "")
    )
    L.append("")
    L.append(
        "| mode | requests | requests/s | CPU µs/request (each round) | loop's thread / others | x single | Redis sent/request | in scripts/request | PostgreSQL transactions/request | rows written/request |"
    )
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = next((r["cpu_us"] for r in res["rows"] if r["mode"] == "single" and "error" not in r), None)
    for r in res["rows"]:
        if "error" in r:
            L.append(f"| {r['mode']} | {r['n']:,} | {r['error']} | | | | | | | |")
            continue
        use_redis, use_pg, _unix = MODES[r["mode"]]
        rd = f"{r['redis_sent']:.2f} | {r['redis_in_lua']:.2f}" if use_redis else "— | —"
        pg = f"{r['pg_xacts']:.2f} | {r['pg_rows']:.2f}" if use_pg else "— | —"
        extra = f"{rd} | {pg}"
        x = f"{r['cpu_us'] / base:.2f}" if base else "—"
        each = ", ".join(str(c) for c in r.get("cpu_us_rounds", []))
        split = f"{r['loop_us']:.0f} / {r['threads_us']:.0f}" if "loop_us" in r else "—"
        L.append(
            f"| {r['mode']} | {r['n']:,} | {r['per_s']:,.0f} | {r['cpu_us']:.0f} ({each}) | {split} | {x} | {extra} |"
        )
    L.append("")
    for r in res["rows"]:
        if r.get("redis") and r["mode"] == "cluster":
            parts = ", ".join(f"`{k}` {v:.2f}" for k, v in list(r["redis"].items())[:12])
            L.append(
                f"Redis calls a request by command in cluster mode (`INFO commandstats`, scripts' inner calls "
                f"included): {parts}."
            )
            L.append("")
    L.append("| target (issue 40) | limit | measured | met |")
    L.append("|---|---|---|---|")
    for row in target_rows(res):
        L.append("| " + " | ".join(row) + " |")
    L.append("")
    L.append(
        "Command: `.venv/bin/python -m bench.cluster_cpu" + (" --quick" if res.get("quick") else "") + "`."
    )
    L.append("")
    return L


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--redis", default=None, help="a shared Redis (default: a server of the bench's own)")
    ap.add_argument("--postgres", default=None, help=f"a server to make a database on (default {PG_URL})")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--rounds", type=int, default=None, help=f"each mode this many times (default {ROUNDS})")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile both gateways; dumps in this folder")
    ap.add_argument(
        "--modes", default=None, help="only these modes (names of MODES, separated by semicolons)"
    )
    args = ap.parse_args()
    only = args.modes.split(";") if args.modes else None
    res = scenario(args.quick, args.redis, args.postgres, args.profile, args.rounds, only)
    report(res, section_lines(res), HEADING, args.out, args.json)


if __name__ == "__main__":
    main()
