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
from typing import Any

from bench import harness as H
from bench.common import gateway_process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_src", help="tree A's src folder (the base)")
    ap.add_argument("b_src", help="tree B's src folder (the change)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument(
        "--observe",
        default="on,on",
        help="metrics and access log of A,B: on, off, metrics (metrics only) or log (access log only) each",
    )
    ap.add_argument(
        "--together", action="store_true",
        help="load A and B at the same time in each round (they share the gateway core), not one after the other",
    )  # fmt: skip
    ap.add_argument("--upstream", default="fast", choices=("fast", "delay"), help="the product's upstream")
    ap.add_argument("--sse", action="store_true", help="streamed requests (bench/sse_load.py), not wrk")
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
        for gw in gws.values() if args.preload > 0 else ():
            served, _ = H.load(gw, 64, args.preload)
            print(f"{gw.name}: preloaded with {served} requests", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for i in range(args.rounds):
            if args.sse:
                done = _sse_round(gws, args, i)
            elif args.together:
                pair = H.wrk_together([gws["A"], gws["B"]], "fast", args.conns, args.seconds, 1.0)
                done = list(zip(("A", "B"), pair, strict=True))
            else:
                done = [(n, H.wrk(gws[n], "fast", args.conns, args.seconds, 1.0))
                        for n in (("A", "B") if i % 2 == 0 else ("B", "A"))]  # fmt: skip
            for name, r in done:
                runs[name].append(r)
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
    paired = sorted(b["rps"] / a["rps"] for a, b in zip(runs["A"], runs["B"], strict=True))
    print(
        f"B/A round by round: req/s median {statistics.median(paired):.3f} "
        f"(min {paired[0]:.3f}, max {paired[-1]:.3f}, {len(paired)} rounds)"
    )


def _sse_round(
    gws: dict[str, H.Gateway], args: argparse.Namespace, i: int
) -> list[tuple[str, dict[str, Any]]]:
    """One round of streamed load (bench/sse_load.py, c=``--conns``): both gateways at once
    (``--together``) or one after the other; each result as wrk's (``rps``: streams/s,
    ``cpu_us`` per stream, ``p50_us``/``p99_us``: time to the first token)."""
    order = ("A", "B") if args.together or i % 2 == 0 else ("B", "A")
    extra = ["--concurrency", str(args.conns), "--duration", str(args.seconds)]
    cpu0 = {n: H.cpu_s(gws[n].pid) for n in order}
    if args.together:
        with ThreadPoolExecutor(2) as pool:
            futures = {n: pool.submit(H.sse, gws[n], "fast", extra, args.seconds + 60) for n in order}
            raw = {n: f.result() for n, f in futures.items()}
        cpu1 = {n: H.cpu_s(gws[n].pid) for n in order}
    else:
        raw, cpu1 = {}, {}
        for n in order:
            raw[n] = H.sse(gws[n], "fast", extra, args.seconds + 60)
            cpu1[n] = H.cpu_s(gws[n].pid)
    out = []
    for n in order:
        r = raw[n]
        streams = r["streams_ok"]
        cpu = (cpu1[n] - cpu0[n]) / streams * 1e6 if streams else 0.0
        out.append((n, {"rps": r["streams_per_s"], "cpu_us": cpu,
                        "p50_us": r["ttft_p50_ms"] * 1000, "p99_us": r["ttft_p99_ms"] * 1000}))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
