"""``bourse serve --workers N``: throughput with 1 and with 2 workers, unpinned.

    .venv/bin/python -m bench.workers [--seconds 10] [--conns 64] [--rounds 2]

Each run starts a gateway with ``[cluster]`` (Redis, a fresh PostgreSQL database)
serving one in-process ``sim`` product (no upstream, instant answers, 4096 slots),
funds an account, then runs wrk (1 thread, ``bench/wrk_post.lua``) for a warm-up
and ``--seconds``. Runs alternate 1, 2, 1, 2 workers (a busy machine drifts). Besides
req/s it reports the gateway's CPU per request (the gateway process and its workers,
from /proc), which a shared machine disturbs less than the rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from bench.common import cpu_s, gateway_process
from bench.ledger import drop_pg, fresh_pg

HERE = Path(__file__).resolve().parent


def _config(redis_url: str, prefix: str) -> str:
    return f"""
[server]
log_level = "warning"
[cluster]
redis_url = "{redis_url}"
key_prefix = "{prefix}"
[products.fast]
max_waiting = 100000
[[products.fast.deployments]]
engine = "sim"
slots = 4096
floor = 0.01
ttft_ms = 0
tokens_per_s = 0
"""


def _wrk(url: str, key: str, conns: int, seconds: float) -> dict[str, float]:
    env = {**os.environ, "BENCH_BODY": json.dumps({"model": "fast", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_price": 1.0}),
           "BENCH_HEADERS": f"authorization: Bearer {key}"}  # fmt: skip
    args = [
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{max(1, round(seconds))}s",
        "-s",
        str(HERE / "wrk_post.lua"),
        url + "/chat/completions",
    ]
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
    r = json.loads(line[len("WRKJSON ") :])
    errors = sum(r[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
    return {"rps": r["requests"] / (r["duration_us"] / 1e6), "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000, "requests": r["requests"], "errors": errors}  # fmt: skip


def run(workers: int, o: argparse.Namespace) -> dict[str, float]:
    dsn = fresh_pg_sync(o.postgres)
    prefix = "bw" + os.urandom(4).hex()
    try:
        with gateway_process(
            _config(o.redis, prefix), database=dsn, extra_args=["--workers", str(workers)]
        ) as (url, key, proc):
            _wrk(url, key, o.conns, o.warmup)
            cpu = cpu_s(proc.pid)
            r = _wrk(url, key, o.conns, o.seconds)
            r["cpu_us_per_req"] = (cpu_s(proc.pid) - cpu) / max(1, r["requests"]) * 1e6
            return r
    finally:
        drop_pg_sync(o.postgres, dsn)


def fresh_pg_sync(url: str) -> str:
    import asyncio

    return asyncio.run(fresh_pg(url))


def drop_pg_sync(url: str, dsn: str) -> None:
    import asyncio

    asyncio.run(drop_pg(url, dsn))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    o = ap.parse_args()
    print(
        f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}; wrk c={o.conns} {o.seconds:.0f}s, unpinned"
    )
    print(f"{'workers':>7} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'gateway CPU µs/req':>19}")
    for _ in range(o.rounds):
        for n in (1, 2):
            r = run(n, o)
            print(f"{n:7} {r['rps']:8.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} {r['errors']:6.0f} "
                  f"{r['cpu_us_per_req']:19.0f}", flush=True)  # fmt: skip
            time.sleep(1)


if __name__ == "__main__":
    main()
