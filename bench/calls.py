"""Python calls per request: one or more source trees of bourse under cProfile.

    .venv/bin/python -m bench.calls BASE_SRC CHANGED_SRC [--conns 1] [--upstream delay] [--seconds 10]
    .venv/bin/python -m bench.calls /tmp/base/src src --observe on,off --top 60
    .venv/bin/python -m bench.calls /tmp/base/src src --sse --conns 32   # per stream

Each tree's ``bourse serve`` runs on the gateway core with
``bench/gateway_site/sitecustomize.py`` on its PYTHONPATH, which profiles the event
loop's thread (where a request's Python runs; the database threads are not seen). The
gateway is warmed up with wrk for 4 s, its counts are reset (SIGUSR1), it serves wrk for
``--seconds``, and the counts of that window are written (SIGUSR1 again). Printed, over
the requests wrk saw answered: the calls per request of each tree in all and by module,
and the functions whose calls per request changed most from the first tree.

A call count does not depend on how busy the machine is, so this says *which* Python
runs more often after a change, where timed runs here scatter by 10 % and more and
``bench.callgrind`` gives one number. cProfile's own cost per call (about 1 µs) makes
its times useless for comparing trees: only the counts are printed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pstats
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import harness as H
from bench.common import (
    ADMIN_KEY,
    GATEWAY_SITE,
    free_port,
    funded_key,
    observe_per_tree,
    process,
    tree_arguments,
)

WARMUP_S = 4.0

Counts = dict[str, float]
"""Calls per request by function (``module:function``)."""


def _where(filename: str) -> str:
    """A function's file as a module path (``bourse/http/relay.py``, ``asyncio/tasks.py``)."""
    if filename == "~":
        return "builtins"
    if "/bourse/" in filename:  # a tree's package, wherever the tree is
        return "bourse/" + filename.rsplit("/bourse/", 1)[1]
    for marker in ("site-packages/", "python3.11/", "python3.12/", "python3.13/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return filename


def counts(path: str, requests: int) -> Counts:
    """Calls per request of each function in one cProfile dump."""
    out: collections.defaultdict[str, float] = collections.defaultdict(float)
    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    for (filename, _line, function), (_prim, calls, _tt, _ct, _callers) in stats.items():
        name = re.sub(r" at 0x[0-9a-f]+", "", function)  # a type's address differs by process
        out[f"{_where(filename)}:{name}"] += calls / max(requests, 1)
    return dict(out)


def opcodes(path: str, requests: int) -> Counts:
    """Bytecode instructions per request of each function in one dump of the
    ``BENCH_OPCODES_OUT`` hook."""
    out: collections.defaultdict[str, float] = collections.defaultdict(float)
    for filename, _line, function, n in json.loads(Path(path).read_text()):
        out[f"{_where(filename)}:{function}"] += n / max(requests, 1)
    return dict(out)


def measure(
    stack: H.Stack, src: str, tag: str, args: argparse.Namespace, out: Path, observe: bool = True
) -> tuple[int, int, Counts]:
    """One tree: requests answered, errors, and the calls per request while measured."""
    prefix = str(out / tag)
    for k in (0, 1):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f"{prefix}.{k}")
    with tempfile.TemporaryDirectory(prefix="bourse-calls-") as d:
        cfg = Path(d) / "bench.toml"
        cfg.write_text(H.bourse_config(stack, {"bench": args.upstream}, observe=observe))
        port = free_port()
        cmd = [sys.executable, "-m", "bourse", "serve", "--config", str(cfg), "--port", str(port), "--data-dir", d]  # fmt: skip
        env = {
            "BOURSE_ADMIN_KEY": ADMIN_KEY,
            "PYTHONPATH": f"{Path(src).resolve()}{os.pathsep}{GATEWAY_SITE}",
            "BENCH_OPCODES_OUT" if args.opcodes else "BENCH_CPROFILE_OUT": prefix,
        }
        base = f"http://127.0.0.1:{port}"
        with process(cmd, base + "/healthz", env=env, cpu=H.GATEWAY_CPU, log=out / f"{tag}.log") as proc:
            key = funded_key(base)
            gw = H.Gateway(
                tag, base + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                models={"fast": "bench"}, pid=proc.pid,
            )  # fmt: skip
            H.load(gw, args.conns, WARMUP_S, streamed=args.sse)
            _signal_and_wait(proc.pid, f"{prefix}.0")
            n, errors = H.load(gw, args.conns, args.seconds, streamed=args.sse)
            _signal_and_wait(proc.pid, f"{prefix}.1")
    return n, errors, (opcodes if args.opcodes else counts)(f"{prefix}.1", n)


def _signal_and_wait(pid: int, path: str, timeout_s: float = 30.0) -> None:
    """SIGUSR1 to the gateway, then wait for the dump it writes."""
    os.kill(pid, signal.SIGUSR1)
    end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise RuntimeError(f"no profile written to {path} within {timeout_s:.0f} s")
        time.sleep(0.05)


def by_module(c: Counts) -> Counts:
    """Calls per request summed by module."""
    out: collections.defaultdict[str, float] = collections.defaultdict(float)
    for name, n in c.items():
        out[name.rsplit(":", 1)[0]] += n
    return dict(out)


def report(results: list[tuple[str, Counts]], top: int, unit: str = "calls") -> None:
    """Totals, then for each later tree the modules and functions that changed most."""
    base_name, base = results[0]
    for name, c in results[1:]:
        print(
            f"\n{name} over {base_name}: {unit} per request {sum(c.values()):.1f} vs {sum(base.values()):.1f}"
        )
        for title, a, b, n in (
            ("modules", by_module(base), by_module(c), top // 2),
            ("functions", base, c, top),
        ):
            print(f"  {title} whose {unit} per request changed most (base, this, difference):")
            keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))
            for k in keys[:n]:
                x, y = a.get(k, 0.0), b.get(k, 0.0)
                if abs(y - x) < 0.005:
                    break
                print(f"    {x:8.2f} {y:8.2f} {y - x:+8.2f}  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_arguments(ap, conns=1, seconds=10.0, out=str(H.LOGS / "calls"))
    ap.add_argument("--top", type=int, default=40, help="functions listed per tree")
    ap.add_argument(
        "--opcodes", action="store_true",
        help="count bytecode instructions per function (sys.settrace, ~50 times slower) instead of calls",
    )  # fmt: skip
    args = ap.parse_args()
    observe = observe_per_tree(ap, args)
    unit = "bytecodes" if args.opcodes else "calls"
    out = Path(args.out)
    stack = H.tool_stack(out)
    results: list[tuple[str, Counts]] = []
    with H.nginx(stack):
        for i, (src, on) in enumerate(zip(args.srcs, observe, strict=True)):
            word = "on" if on else "off"
            n, errors, c = measure(stack, src, f"tree{i}", args, out, on)
            results.append((f"{src} (observing {word})", c))
            print(
                f"{src} (observing {word}): {n} requests ({errors} errors), {sum(c.values()):.1f} {unit} per request"
            )
    report(results, args.top, unit)


if __name__ == "__main__":
    main()
