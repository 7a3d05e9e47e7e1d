"""Two source trees of bourse, side by side in one run: a change against its base.

    .venv/bin/python -m bench.ab BASE_SRC CHANGED_SRC [--rounds 6] [--conns 64] [--seconds 6]
    .venv/bin/python -m bench.ab /tmp/base/src src --observe on,off   # one tree, metrics on/off
    .venv/bin/python -m bench.ab A_SRC B_SRC --together               # both loaded at once

Starts nginx as the harness does (``bench/nginx.conf``, core 1) and one gateway per
tree (``BOURSE_BENCH_SRC``, core 0; the harness's bourse config, one product), then
loads them in alternate rounds (A then B, B then A, ...) with wrk (c=``--conns``,
1 s warm-up, ``--seconds`` measured). A drifting machine falls on both alike, which
separate runs of the harness do not give: between two runs here, direct nginx moved
by 7 %, and one round of two identical gateways differs by up to ±3 %. Prints each
round and the medians: requests/s, the gateway's CPU per request (every thread, from
/proc), p50 and p99, and B over A (of the medians, and round by round).

``--upstream delay`` puts the product on the upstream that answers 50 ms late (scenario
(c) of the harness, with ``--conns 256``); ``--sse`` loads streamed requests with the
harness's SSE client (``bench/sse_load.py``, 16-chunk upstream streams: scenario (d),
with ``--conns 32``) instead of wrk, and compares streams/s and the gateway's CPU per
stream.

``--preload SECONDS`` first loads each gateway with wrk (c=64) for that long, so that
its ledger holds what a gateway of bench/run.sh holds by its later scenarios (the
ledger's threads spend more a request as it grows).

``--threads`` splits each gateway's CPU per request by thread (grouped by name: the
event loop, the SQLite commit and checkpoint threads, ...) into user and kernel time,
from ``/proc/PID/task`` (clock ticks, so rounds of a few seconds read to ~5 %), and
prints B over A for each: which thread, and which side of the system call, a change's
CPU moved to.

``--together`` loads both at the same time in each round instead: they share the
gateway core, so their throughputs stand in the inverse ratio of their CPU per
request, and whatever disturbs the machine falls on both in the same seconds. Two
identical gateways read 0.977-1.019 round by round this way (median 0.993, 8 rounds),
against ±3 % for alternate rounds. ``--observe`` takes ``metrics`` or ``log`` too
(only that one on), to split what observing costs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench import harness as H
from bench.common import cpu_s, gateway_process


def pair_arguments(ap: argparse.ArgumentParser, *, rounds: int) -> None:
    """The arguments of a run that loads two trees' gateways (this tool's and
    ``bench.perf``'s): the trees, rounds, load, observing and upstream."""
    ap.add_argument("a_src", help="tree A's src folder (the base)")
    ap.add_argument("b_src", help="tree B's src folder (the change)")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument(
        "--observe",
        default="on,on",
        help="metrics and access log of A,B: on, off, metrics (metrics only) or log (access log only) each",
    )
    ap.add_argument("--upstream", default="fast", choices=("fast", "delay"), help="the product's upstream")
    ap.add_argument("--sse", action="store_true", help="streamed requests (bench/sse_load.py), not wrk")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pair_arguments(ap, rounds=6)
    ap.add_argument(
        "--together", action="store_true",
        help="load A and B at the same time in each round (they share the gateway core), not one after the other",
    )  # fmt: skip
    ap.add_argument("--threads", action="store_true", help="CPU per request by thread, user and kernel")
    ap.add_argument(
        "--preload", type=float, default=0.0,
        help="seconds of wrk (c=64, non-streamed) on each gateway before the rounds: the ledger a gateway of "
        "bench/run.sh has built up by its later scenarios",
    )  # fmt: skip
    args = ap.parse_args()
    observe = [w.strip() for w in args.observe.split(",")]
    H.raise_nofile()
    H.LOGS.mkdir(parents=True, exist_ok=True)
    stack = H.Stack()
    with contextlib.ExitStack() as es:
        es.enter_context(H.nginx(stack))
        gws = _gateways(es, stack, args, observe)
        for gw in gws.values() if args.preload > 0 else ():
            served, _ = H.load(gw, 64, args.preload)
            print(f"{gw.name}: preloaded with {served} requests", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        split: dict[str, list[dict[str, Counts]]] = {"A": [], "B": []}
        for i in range(args.rounds):
            ticks0 = {n: thread_ticks(gw.pid) for n, gw in gws.items()} if args.threads else {}
            done = _round(gws, args, i)
            for name, r in done:
                runs[name].append(r)
                if args.threads:
                    split[name].append(_delta(ticks0[name], thread_ticks(gws[name].pid)))
                print(
                    f"round {i} {name}: {r['rps']:.0f} req/s, {r.get('cpu_us', 0):.0f} us/request, "
                    f"p50 {r['p50_us'] / 1000:.3f} ms, p99 {r['p99_us'] / 1000:.3f} ms",
                    flush=True,
                )
            if args.together:
                print(f"round {i} B/A: req/s {done[1][1]['rps'] / done[0][1]['rps']:.3f}", flush=True)
    med = {n: {k: statistics.median(float(r.get(k, 0)) for r in rs) for k in ("rps", "cpu_us", "p50_us", "p99_us")}
           for n, rs in runs.items()}  # fmt: skip
    for n, m in med.items():
        print(
            f"{n} ({args.a_src if n == 'A' else args.b_src}): median {m['rps']:.0f} req/s, {m['cpu_us']:.0f} us/request, "
            f"p50 {m['p50_us'] / 1000:.3f} ms, p99 {m['p99_us'] / 1000:.3f} ms"
        )
    cpu = med["B"]["cpu_us"] / med["A"]["cpu_us"] if med["A"]["cpu_us"] else float("nan")
    print(f"B/A: req/s {med['B']['rps'] / med['A']['rps']:.3f}, CPU per request {cpu:.3f}")
    if args.threads:
        _print_threads(runs, split)
    paired = sorted(b["rps"] / a["rps"] for a, b in zip(runs["A"], runs["B"], strict=True))
    print(
        f"B/A round by round: req/s median {statistics.median(paired):.3f} "
        f"(min {paired[0]:.3f}, max {paired[-1]:.3f}, {len(paired)} rounds)"
    )


def _gateways(
    es: contextlib.ExitStack, stack: H.Stack, args: argparse.Namespace, observe: list[str]
) -> dict[str, H.Gateway]:
    """One gateway per tree, each observing as ``observe`` says."""
    gws: dict[str, H.Gateway] = {}
    for (name, src), obs in zip((("A", args.a_src), ("B", args.b_src)), observe, strict=True):
        os.environ["BOURSE_BENCH_SRC"] = src
        cfg = H.bourse_config(stack, {"bench": args.upstream}, observe=obs == "on")
        if obs == "metrics":
            cfg = cfg.replace("metrics = false\n", "")
        elif obs == "log":
            cfg = cfg.replace("access_log = false\n", "")
        base, key, proc = es.enter_context(
            gateway_process(cfg, cpu=H.GATEWAY_CPU, log=H.LOGS / f"ab-{name}.log")
        )
        gws[name] = H.Gateway(
            name, base + "/chat/completions", headers={"authorization": f"Bearer {key}"},
            models={"fast": "bench"}, pid=proc.pid,
        )  # fmt: skip
    return gws


def _round(gws: dict[str, H.Gateway], args: argparse.Namespace, i: int) -> list[tuple[str, dict[str, Any]]]:
    """Round ``i``: each gateway's result (streamed, together, or one after the other)."""
    if args.sse:
        return _sse_round(gws, args, i)
    if args.together:
        pair = H.wrk_together([gws["A"], gws["B"]], "fast", args.conns, args.seconds, 1.0)
        return list(zip(("A", "B"), pair, strict=True))
    return [(n, H.wrk(gws[n], "fast", args.conns, args.seconds, 1.0))
            for n in (("A", "B") if i % 2 == 0 else ("B", "A"))]  # fmt: skip


Counts = tuple[int, int, int, int]
"""A thread's user and kernel clock ticks, and its voluntary and involuntary context switches."""


def thread_ticks(pid: int | None) -> dict[str, Counts]:
    """The process's threads' :data:`Counts`: ``main`` (the event loop), then the others
    by the order they started in (``thread 1`` the first), which Python does not name
    for the system."""
    out: dict[str, Counts] = {}
    tasks = sorted((int(t.name), t) for t in Path(f"/proc/{pid}/task").iterdir()) if pid else []
    for rank, (tid, task) in enumerate(tasks):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line
            )
        except OSError:  # the thread ended
            continue
        out["main" if tid == pid else f"thread {rank}"] = (
            int(fields[11]), int(fields[12]),
            int(status.get("voluntary_ctxt_switches", 0)), int(status.get("nonvoluntary_ctxt_switches", 0)),
        )  # fmt: skip
    return out


def _delta(a: dict[str, Counts], b: dict[str, Counts]) -> dict[str, Counts]:
    zero = (0, 0, 0, 0)
    return {n: (c[0] - a.get(n, zero)[0], c[1] - a.get(n, zero)[1], c[2] - a.get(n, zero)[2], c[3] - a.get(n, zero)[3])
            for n, c in b.items()}  # fmt: skip


def _print_threads(runs: dict[str, list[dict[str, Any]]], split: dict[str, list[dict[str, Counts]]]) -> None:
    """Per thread: user and kernel µs per request (the round's CPU per request shared out
    by the threads' ticks in that round), and context switches per request (voluntary:
    the thread waited; involuntary: it was preempted), means over the rounds; A, B, B/A."""
    per: dict[str, dict[str, list[float]]] = {}
    for n, rounds in split.items():
        acc: dict[str, list[float]] = {}
        for r, d in zip(runs[n], rounds, strict=True):
            ticks = sum(c[0] + c[1] for c in d.values())
            served = float(r.get("requests", 0)) or 1.0
            scale = float(r.get("cpu_us", 0)) / ticks / len(rounds) if ticks else 0.0
            for t, (u, k, vol, invol) in d.items():
                row = acc.setdefault(t, [0.0, 0.0, 0.0, 0.0])
                row[0] += u * scale
                row[1] += k * scale
                row[2] += vol / served / len(rounds)
                row[3] += invol / served / len(rounds)
        per[n] = acc
    print(
        "per thread, per request: us user + kernel, context switches voluntary/involuntary; A, B, B/A of the CPU:"
    )
    zero = [0.0, 0.0, 0.0, 0.0]
    for t in sorted(set(per["A"]) | set(per["B"])):
        a, b = per["A"].get(t, zero), per["B"].get(t, zero)
        if a[0] + a[1] + b[0] + b[1] < 1:
            continue
        ratio = f"{(b[0] + b[1]) / (a[0] + a[1]):.3f}" if a[0] + a[1] else "-"
        print(
            f"  {t:<10} A {a[0]:6.1f} + {a[1]:5.1f} us, {a[2]:5.2f}/{a[3]:5.2f} cs"
            f"   B {b[0]:6.1f} + {b[1]:5.1f} us, {b[2]:5.2f}/{b[3]:5.2f} cs   B/A {ratio}"
        )


def _sse_round(
    gws: dict[str, H.Gateway], args: argparse.Namespace, i: int
) -> list[tuple[str, dict[str, Any]]]:
    """One round of streamed load (bench/sse_load.py, c=``--conns``): both gateways at once
    (``--together``) or one after the other; each result as wrk's (``rps``: streams/s,
    ``cpu_us`` per stream, ``p50_us``/``p99_us``: time to the first token)."""
    order = ("A", "B") if args.together or i % 2 == 0 else ("B", "A")
    extra = ["--concurrency", str(args.conns), "--duration", str(args.seconds)]
    cpu0 = {n: cpu_s(gws[n].pid) for n in order}
    if args.together:
        with ThreadPoolExecutor(2) as pool:
            futures = {n: pool.submit(H.sse, gws[n], "fast", extra, args.seconds + 60) for n in order}
            raw = {n: f.result() for n, f in futures.items()}
        cpu1 = {n: cpu_s(gws[n].pid) for n in order}
    else:
        raw, cpu1 = {}, {}
        for n in order:
            raw[n] = H.sse(gws[n], "fast", extra, args.seconds + 60)
            cpu1[n] = cpu_s(gws[n].pid)
    out = []
    for n in order:
        r = raw[n]
        streams = r["streams_ok"]
        cpu = (cpu1[n] - cpu0[n]) / streams * 1e6 if streams else 0.0
        out.append((n, {"rps": r["streams_per_s"], "cpu_us": cpu, "requests": streams,
                        "p50_us": r["ttft_p50_ms"] * 1000, "p99_us": r["ttft_p99_ms"] * 1000}))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
