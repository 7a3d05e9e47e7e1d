"""The real gateway under granian's ASGI interface against ``bourse serve`` (uvicorn),
side by side: issue 40, item 1's feasibility step.

    PYTHONPATH=src:. .venv/bin/python -m bench.granian_app [--rounds 3] [--seconds 8] [--setup]

:func:`app` is a granian ``--factory`` target: the same ASGI app ``bourse serve``
builds (``container.app()``: its lifespan, the embedded SQLite, the config's
products), from ``GRANIAN_BOURSE_CONFIG`` and ``GRANIAN_BOURSE_DATA``; without
bourse's server around it: no drain on SIGTERM, no connection limits or deadlines,
no client-presence probe (the relay takes its task-group path), no sd_notify.

``main`` serves one product, ``sim`` answering at once (``ttft_ms = 0``,
``tokens_per_s = 0``), with each server pinned to core 0 (granian: 1 worker,
1 runtime thread, uvloop; uvicorn: ``bourse serve`` as it is) and the load on core 1,
alternating the two servers each round (the order reversed every other round): wrk
c=64 non-streamed (scenario (b)'s load, ``bench/wrk_post.lua``) and the SSE client
c=32 streamed (scenario (d)'s). Besides req/s (streams/s) it reports the server's CPU
per request: user + system of every process of the server (granian's worker is a
child process), from /proc. granian is installed with pip ``--target`` into
``bench/.work/granian-pkgs`` (``--setup``), never into the project's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import ADMIN_KEY, cpu_s, free_port, funded_key, gateway_process, process, process_tree

HERE = Path(__file__).resolve().parent
PKGS = HERE / ".work" / "granian-pkgs"
SERVER_CPU, LOAD_CPU = "0", "1"
CONFIG = """[server]
log_level = "warning"
metrics = true
[products.bench]
max_waiting = 1000000
[[products.bench.deployments]]
engine = "sim"
slots = 100000
floor = 0.10
ttft_ms = 0
tokens_per_s = 0
"""
BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "benchmark"}]})


def app() -> Any:
    """The gateway's ASGI app as ``bourse serve`` builds it (granian ``--factory`` target)."""
    from bourse.cli import settle_heap
    from bourse.container import build
    from bourse.observability.logs import configure_logging
    from bourse.services.accounts import demo_rule
    from bourse.settings import load_config, read_environment

    path = Path(os.environ["GRANIAN_BOURSE_CONFIG"])
    data_dir = Path(os.environ["GRANIAN_BOURSE_DATA"])
    config = load_config(path)
    configure_logging(config.server.log_level, config.server.log_format)
    container = build(config, data_dir=data_dir, env=read_environment(), database=None, worker=0, link=None)
    container.data_dir = data_dir
    container.config_path = str(path)
    container.adopt_secret_key = False
    container.demo = demo_rule(asked=False, built_in_config=False, single_node=container.store.single_node)
    app = container.app()
    settle_heap()  # as serve does: the start-up heap frozen, the young generation's threshold raised
    if os.environ.get("GRANIAN_BOURSE_PROFILE"):
        _profile_on_sigusr1(os.environ["GRANIAN_BOURSE_PROFILE"])
    return app


def _profile_on_sigusr1(out: str) -> None:
    """SIGUSR1 to the worker starts cProfile on its main thread (the event loop's);
    the next one writes what it counted to ``out`` (``--profile``)."""
    import cProfile
    import signal

    prof = cProfile.Profile()
    on = [False]

    def toggle(signum: int, frame: object) -> None:
        if on[0]:
            prof.disable()
            prof.dump_stats(out)
        else:
            prof.enable()
        on[0] = not on[0]

    signal.signal(signal.SIGUSR1, toggle)


@contextmanager
def granian(
    config: str, extra_env: dict[str, str] | None = None
) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bourse-granian-") as tmp:
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(config)
        env = {"BOURSE_ADMIN_KEY": ADMIN_KEY, "BOURSE_DRAIN_GRACE_S": "0", "GRANIAN_BOURSE_CONFIG": str(cfg),
               "GRANIAN_BOURSE_DATA": tmp, "PYTHONPATH": f"{HERE.parent / 'src'}:{HERE.parent}:{PKGS}", **(extra_env or {})}  # fmt: skip
        args = [sys.executable, "-m", "granian", "--interface", "asgi", "--factory", "bench.granian_app:app",
                "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--runtime-threads", "1",
                "--loop", "uvloop", "--no-ws", "--log-level", "warning", "--no-access-log"]  # fmt: skip
        with process(
            args,
            f"http://127.0.0.1:{port}/healthz",
            env=env,
            cpu=int(SERVER_CPU),
            log=PKGS.parent / "granian.log",
        ) as proc:
            base = f"http://127.0.0.1:{port}"
            yield base + "/v1", funded_key(base), proc


def wrk(url: str, key: str, conns: int, seconds: float) -> dict[str, float]:
    env = {**os.environ, "BENCH_BODY": BODY, "BENCH_HEADERS": f"authorization: Bearer {key}"}
    args = ["taskset", "-c", LOAD_CPU, "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s",
            "--timeout", "10s", "-s", str(HERE / "wrk_post.lua"), url]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True).stdout
    r = json.loads(next(x for x in out.splitlines() if x.startswith("WRKJSON "))[len("WRKJSON ") :])
    errors = sum(r[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
    return {"n": r["requests"], "rate": r["requests"] / (r["duration_us"] / 1e6),
            "p99_ms": r["p99_us"] / 1000, "errors": errors}  # fmt: skip


def sse(url: str, key: str, conns: int, seconds: float) -> dict[str, float]:
    args = ["taskset", "-c", LOAD_CPU, sys.executable, "-m", "bench.sse_load", "--url", url, "--model", "bench",
            "--header", f"authorization: Bearer {key}", "--concurrency", str(conns), "--duration", str(seconds)]  # fmt: skip
    out = subprocess.run(
        args, capture_output=True, text=True, check=True, cwd=HERE.parent, timeout=seconds + 90
    )
    r = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    errors = sum(int(n) for n in r["errors"].values())
    return {"n": r["streams_ok"], "rate": r["streams_per_s"], "p99_ms": float("nan"), "errors": errors}


def measure(server: str, o: argparse.Namespace) -> dict[str, dict[str, float]]:
    started = granian(CONFIG) if server == "granian" else gateway_process(CONFIG, cpu=int(SERVER_CPU))
    out = {}
    with started as (base, key, proc):
        url = base + "/chat/completions"
        wrk(url, key, o.conns, o.warmup)
        for kind, run, conns in (("b", wrk, o.conns), ("d", sse, o.sse_conns)):
            before = cpu_s(proc.pid)
            r = run(url, key, conns, o.seconds)
            r["cpu_us"] = (cpu_s(proc.pid) - before) / max(1, r["n"]) * 1e6
            out[kind] = r
    return out


def profile(o: argparse.Namespace) -> None:
    """cProfile of granian's worker (its event loop's thread) over one wrk run at c=64."""
    import pstats
    import signal

    out = PKGS.parent / "granian.prof"
    with granian(CONFIG, {"GRANIAN_BOURSE_PROFILE": str(out)}) as (base, key, proc):
        url = base + "/chat/completions"
        wrk(url, key, o.conns, o.warmup)
        worker = process_tree(proc.pid)[1]
        os.kill(worker, signal.SIGUSR1)
        r = wrk(url, key, o.conns, o.seconds)
        os.kill(worker, signal.SIGUSR1)
        time.sleep(1)
    print(f"{r['n']:.0f} requests, {r['rate']:.0f} req/s (under cProfile)")
    pstats.Stats(str(out)).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--sse-conns", type=int, default=32)
    ap.add_argument("--setup", action="store_true", help=f"pip install granian into {PKGS}")
    ap.add_argument("--profile", action="store_true", help="only: cProfile of granian's worker at --conns")
    o = ap.parse_args()
    if o.setup or not (PKGS / "granian").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(PKGS), "granian[uvloop]"],
                       check=True)  # fmt: skip
    if o.profile:
        profile(o)
        return
    runs: dict[str, list[dict[str, dict[str, float]]]] = {"uvicorn": [], "granian": []}
    print(f"load {os.getloadavg()[0]:.1f}; server on core {SERVER_CPU}, load on core {LOAD_CPU}", flush=True)
    for rnd in range(o.rounds):
        for server in ("uvicorn", "granian") if rnd % 2 == 0 else ("granian", "uvicorn"):
            r = measure(server, o)
            runs[server].append(r)
            print(f"  round {rnd + 1} {server:8} (b) c={o.conns} {r['b']['rate']:7.0f} req/s "
                  f"{r['b']['cpu_us']:5.0f} µs/req p99 {r['b']['p99_ms']:6.1f} ms err {r['b']['errors']:.0f} | "
                  f"(d) c={o.sse_conns} {r['d']['rate']:6.0f} streams/s {r['d']['cpu_us']:5.0f} µs/stream "
                  f"err {r['d']['errors']:.0f}", flush=True)  # fmt: skip
    print("\n| server | (b) req/s (each round) | (b) CPU µs/req | (d) streams/s | (d) CPU µs/stream |")
    print("|---|---|---|---|---|")
    for server, rs in runs.items():
        cells = [", ".join(f"{r[k][f]:,.0f}" for r in rs) for k, f in
                 (("b", "rate"), ("b", "cpu_us"), ("d", "rate"), ("d", "cpu_us"))]  # fmt: skip
        print(f"| {server} | " + " | ".join(cells) + " |")
    for k, f in (("b", "rate"), ("b", "cpu_us"), ("d", "rate"), ("d", "cpu_us")):
        ratios = [g[k][f] / u[k][f] for u, g in zip(runs["uvicorn"], runs["granian"], strict=True)]
        print(f"granian/uvicorn ({k}) {f}: median {statistics.median(ratios):.3f} "
              f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main()
