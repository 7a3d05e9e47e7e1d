"""Two source trees of bourse, side by side in one run: a change against its base.

    .venv/bin/python -m bench.ab BASE_SRC CHANGED_SRC [--rounds 6] [--conns 64] [--seconds 6]
    .venv/bin/python -m bench.ab /tmp/base/src src --observe on,off   # one tree, metrics on/off

Starts nginx as the harness does (``bench/nginx.conf``, core 1) and one gateway per
tree (``BOURSE_BENCH_SRC``, core 0; the harness's bourse config, one product), then
loads them in alternate rounds (A then B, B then A, ...) with wrk (c=``--conns``,
1 s warm-up, ``--seconds`` measured). A drifting machine falls on both alike, which
separate runs of the harness do not give: between two runs here, direct nginx moved
by 7 %, and one round of two identical gateways differs by up to ±3 %. Prints each
round and the medians: requests/s, the gateway's CPU per request (every thread, from
/proc), p50 and p99, and B over A.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from bench import harness as H
from bench.common import gateway_process


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_src", help="tree A's src folder (the base)")
    ap.add_argument("b_src", help="tree B's src folder (the change)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--observe", default="on,on", help="metrics and access log of A,B: on or off each")
    args = ap.parse_args()
    observe = [w.strip() == "on" for w in args.observe.split(",")]
    H.raise_nofile()
    H.LOGS.mkdir(parents=True, exist_ok=True)
    stack = H.Stack()
    with contextlib.ExitStack() as es:
        es.enter_context(H.nginx(stack))
        gws: dict[str, H.Gateway] = {}
        for (name, src), obs in zip((("A", args.a_src), ("B", args.b_src)), observe, strict=True):
            os.environ["BOURSE_BENCH_SRC"] = src
            cfg = H.bourse_config(stack, {"bench": "fast"}, observe=obs)
            base, key, proc = es.enter_context(
                gateway_process(cfg, cpu=H.GATEWAY_CPU, log=H.LOGS / f"ab-{name}.log")
            )
            gws[name] = H.Gateway(
                name, base + "/chat/completions", headers={"authorization": f"Bearer {key}"},
                models={"fast": "bench"}, pid=proc.pid,
            )  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for i in range(args.rounds):
            for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                r = H.wrk(gws[name], "fast", args.conns, args.seconds, 1.0)
                runs[name].append(r)
                print(
                    f"round {i} {name}: {r['rps']:.0f} req/s, {r.get('cpu_us', 0):.0f} us/request, "
                    f"p50 {r['p50_us'] / 1000:.3f} ms, p99 {r['p99_us'] / 1000:.3f} ms",
                    flush=True,
                )
    med = {n: {k: statistics.median(float(r.get(k, 0)) for r in rs) for k in ("rps", "cpu_us", "p50_us", "p99_us")}
           for n, rs in runs.items()}  # fmt: skip
    for n, m in med.items():
        print(
            f"{n} ({args.a_src if n == 'A' else args.b_src}): median {m['rps']:.0f} req/s, {m['cpu_us']:.0f} us/request, "
            f"p50 {m['p50_us'] / 1000:.3f} ms, p99 {m['p99_us'] / 1000:.3f} ms"
        )
    cpu = med["B"]["cpu_us"] / med["A"]["cpu_us"] if med["A"]["cpu_us"] else float("nan")
    print(f"B/A: req/s {med['B']['rps'] / med['A']['rps']:.3f}, CPU per request {cpu:.3f}")


if __name__ == "__main__":
    main()
