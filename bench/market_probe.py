"""Why the gateway's own wait-forecast score misses (issue 38, item 1): each scored order
of a market bench run, its entry prediction replayed with what the gateway knew, with
the model's own odds, and with what happened put in place of what it guessed.

Run the market bench with the gateways' forecast log (``bench/gateway_site``) and the
bench's per-order dump, then this on both::

    BENCH_FORECAST_LOG=/tmp/p/fc BENCH_MARKET_DUMP=/tmp/p/dump \\
      PYTHONPATH=src:.:bench/gateway_site BOURSE_BENCH_SRC=$PWD/src \\
      .venv/bin/python -m bench.market --runs 3,8 --out /tmp/p/r.md
    PYTHONPATH=src:. .venv/bin/python -m bench.market_probe --dump /tmp/p/dump --log /tmp/p/fc

A row per run (its orders found by their ids in the dumps), of the orders each gateway
scored (admitted after resting in the book):

- **within 2x**, **median error / median wait**: the gateway's score (the same rule:
  :func:`bourse.domain.forecast_score.within_2x`);
- **model's odds**: the share within 2x the model itself expected: for each order, the
  chance it gave the starts its told wait is within 2x of (its walk,
  :class:`bourse.domain.forecast_starts.Starts`); an order told a wait in a lull (no
  chance to start otherwise) counts as it came out;
- **oracle**: the prediction replayed with, in place of the model's guesses, the
  slots' next frees as they came (upstream's generation ends), the rate of arrivals
  above its bid as it came (over its wait, at least 1 s), and the deadline orders that
  bid under it at its entry and were raised past it, ahead of it. What is left missed
  is the arrivals' timing itself, which a rate cannot tell.

Where the model's odds are well above the score, the prediction is surer than it has
reason to be; where the oracle is not much above the score, better guesses of those
inputs would not help.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import math
import statistics
from typing import Any

from bourse.domain import forecast as fc
from bourse.domain.forecast_score import within_2x


def _walk(call: dict[str, Any], **change: Any) -> tuple[float | None, list[tuple[float, float]]]:
    """The wait :func:`bourse.domain.forecast.wait_s` tells with the logged arguments
    (``change``: some replaced), and its walk (the chance of having started by each
    free: empty when it tells no such wait)."""
    args = {**call, **change}
    seen: list[tuple[float, float]] = []
    told = fc.within_2x_point

    def spy(walked: Any, median: float, *a: Any, **k: Any) -> float:
        seen[:] = list(walked)
        return told(walked, median, *a, **k)

    fc.within_2x_point = spy
    try:
        slots = [fc.SlotFree(f, at, run) for f, at, run in args["slots"]]
        ahead = [
            a if isinstance(a, fc.Ahead) else fc.Ahead(a[0], math.inf if a[1] is None else a[1], a[2], a[3])
            for a in args["ahead"]
        ]
        w = fc.wait_s(
            args["bid"],
            slots,
            ahead,
            args["above_per_s"],
            args["horizon_s"],
            if_started=args.get("if_started", False),
            gives_up_per_s=args.get("gives_up_per_s", 0.0),
            told=args.get("told", True),
        )
        if w is None and args.get("if_started"):  # as Forecaster.predict: its wait in a lull
            seen.clear()
            w = fc.wait_s(
                args["bid"], slots, ahead, 0.0, fc.HORIZON_S, gives_up_per_s=args.get("gives_up_per_s", 0.0)
            )
        return w, seen
    finally:
        fc.within_2x_point = told


def _odds(told: float | None, seen: list[tuple[float, float]]) -> float | None:
    """The model's chance that the wait is within 2x of ``told`` (None: no walk)."""
    if told is None or not seen or seen[-1][1] <= 0:
        return None
    total, prev, caught = seen[-1][1], 0.0, 0.0
    for t, p in seen:
        caught += (p - prev) / total * within_2x(told, t)
        prev = p
    return caught


def load(dumps: list[str], logs: list[str]) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each dump's orders with the forecast log's rows of its orders, by dump file."""
    runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    owner: dict[str, str] = {}
    for path in dumps:
        with open(path) as f:
            d = json.load(f)
        runs[path] = (d, [])
        for o in d["orders"]:
            if o.get("rid"):
                owner[o["rid"]] = path
    for path in logs:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                run = owner.get(row["id"])
                if run is not None:
                    runs[run][1].append(row)
    return runs


def probe(d: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    orders = d["orders"]
    starts = {n: (s, e) for n, s, e in d["records"]}
    ends = sorted(e for _, _, e in d["records"])
    by_id = {o["rid"]: o for o in orders if o.get("rid")}
    for o in orders:
        o["_start"] = starts.get(o["n"], (None, None))[0]
        xm = o.get("x_market") or {}
        o["_first"] = xm.get("start_bid") or o["bid"]
        o["_last"] = xm.get("bid") or o["bid"]
    hits, errors, waits, odds, oracle_hits, oracle_errors = 0, [], [], [], 0, []
    oracled = 0
    each: list[tuple[int, bool, bool, float]] = []
    for row in rows:
        actual, told = row["actual"], row["predicted"]
        hit = within_2x(told, actual)
        hits += hit
        waits.append(actual)
        if told is not None:
            errors.append(abs(told - actual))
        if not row["calls"]:
            continue
        call = row["calls"][0]
        w, seen = _walk(call)
        p = _odds(w, seen)
        odds.append(float(hit) if p is None else p)
        each.append((row["position"], hit, told is not None and told < actual, odds[-1]))
        o = by_id.get(row["id"])
        if o is None or o["_start"] is None:
            continue
        at = o["sent"]  # the client's send: the gateway's arrival, within milliseconds
        i = bisect.bisect_left(ends, at)
        came = [e - at for e in ends[i : i + len(call["slots"])]]
        slots = sorted(call["slots"], key=lambda s: s[1])
        slots = [[f, came[k] if k < len(came) else t, r] for k, (f, t, r) in enumerate(slots)]
        b = call["bid"]
        raised = [
            fc.Ahead(x["_last"])
            for x in orders
            if x is not o
            and x["sent"] < o["sent"]
            and x["_first"] < b
            and x["_start"]
            and at < x["_start"] < o["_start"]
        ]
        ahead = [fc.Ahead(a[0], math.inf if a[1] is None else a[1], a[2], a[3]) for a in call["ahead"]]
        span = max(actual, 1.0)
        rate = sum(1 for x in orders if at < x["sent"] <= at + span and x["_first"] > b) / span
        w2, _ = _walk(call, slots=slots, ahead=sorted(ahead + raised, key=lambda a: -a.bid), above_per_s=rate)
        oracled += 1
        oracle_hits += within_2x(w2, actual)
        oracle_errors.append(math.inf if w2 is None else abs(w2 - actual))
    n = len(rows)
    return {
        "scored": n,
        "within_2x": hits / n if n else math.nan,
        "median_error_s": statistics.median(errors) if errors else math.nan,
        "median_wait_s": statistics.median(waits) if waits else math.nan,
        "model_odds": statistics.fmean(odds) if odds else math.nan,
        "oracle_within_2x": oracle_hits / oracled if oracled else math.nan,
        "oracle_median_error_s": statistics.median(oracle_errors) if oracle_errors else math.nan,
        "orders": each,
    }


POSITIONS = ((0, 0), (1, 2), (3, 9), (10, 1 << 30))
"""The buckets of the orders' positions at entry in the table by position."""


def by_position(each: list[tuple[int, bool, bool, float]]) -> list[str]:
    """The orders of all runs by their position at entry: scored, within 2x, the model's
    odds, and the misses told too short (waited over twice as long) and too long."""
    out = [
        "| position at entry | scored | within 2x | model's odds | missed: waited longer | shorter |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lo, hi in POSITIONS:
        rows = [e for e in each if lo <= e[0] <= hi]
        if not rows:
            continue
        n = len(rows)
        hits = sum(1 for e in rows if e[1])
        longer = sum(1 for e in rows if not e[1] and e[2])
        name = f"{lo}" if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"
        out.append(
            f"| {name} | {n} | {hits / n:.1%} | {statistics.fmean(e[3] for e in rows):.1%} | {longer} | {n - hits - longer} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dump", required=True, help="BENCH_MARKET_DUMP of the run(s): its <dump>-<seed>.json files"
    )
    ap.add_argument("--log", required=True, help="BENCH_FORECAST_LOG of the run(s): its <log>.<pid> files")
    args = ap.parse_args()
    runs = load(sorted(glob.glob(args.dump + "-*.json")), sorted(glob.glob(args.log + ".*")))
    print(
        "| run (dump) | scored | within 2x | median error / median wait s | model's odds of within 2x "
        "| oracle: within 2x, median error s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    each: list[tuple[int, bool, bool, float]] = []
    for path, (d, rows) in runs.items():
        if not rows:
            continue
        r = probe(d, rows)
        each += r["orders"]
        print(
            f"| {path} | {r['scored']} | {r['within_2x']:.1%} | {r['median_error_s']:.2f} / {r['median_wait_s']:.2f} "
            f"({r['median_error_s'] / r['median_wait_s']:.0%}) | {r['model_odds']:.1%} "
            f"| {r['oracle_within_2x']:.1%}, {r['oracle_median_error_s']:.2f} |"
        )
    print()
    print("\n".join(by_position(each)))


if __name__ == "__main__":
    main()
