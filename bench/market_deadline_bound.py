"""A clairvoyant bound on what deadline orders can save (issue 38, item 3), from the
book's own history of a market bench run (``bench/market.py`` with
``BENCH_MARKET_DUMP=PREFIX``, which writes ``PREFIX-SEED.json``).

    BENCH_MARKET_DUMP=/tmp/m PYTHONPATH=src:. .venv/bin/python -m bench.market --runs 8 --seeds 2
    PYTHONPATH=src:. .venv/bin/python -m bench.market_deadline_bound /tmp/m-23.json /tmp/m-1023.json \
        [--slack 0.5] [--replay] [--why] [--ceilings] [--moments] [--hi] [--name NAME] [--json OUT]

The target asks a deadline order (arrival ``a``, deadline ``d``, ceiling ``c``) to meet
its deadline as often as its control (a fixed bid at ``c``, timeout ``d``) and to pay
at least 20 % less. The book clears at a second price, min(bid, max(floor, best other
bid waiting)): what an order pays is set by the others, so a deadline order can save
only by being admitted at a moment when the best other bid waiting is low. This tool
replays the run's history (:func:`bench.market.attach`: each order's arrival and
leaving, the upstream's engine starts and ends) and, for each deadline order, finds the
**clairvoyant price**: the lowest price at which it could have been admitted at some
moment ``t`` in [a, a + d] when a slot was free to it:

- each generation's end and each engine start in the window (a slot freed, an
  admission): max(floor, best bid of the other orders waiting then), the order that
  took the slot included (it would have been beaten: ties are given to the
  clairvoyant order, an optimistic choice);
- its own arrival, when fewer than all slots were running then: the same price (the
  floor when nobody waited);

if that price is at most ``c``. A deadline order's bid at ``t`` is the least it can have
had (:func:`bench.market_deadline.lo`; ``--hi`` takes the most), the deadline order
itself is left out (it is the one replaced), and its effect on the others is ignored:
the bound is optimistic on every count, no strategy that knows only the past can pay
less. The bench places each deadline order beside its control (same ceiling, same
deadline): while the control waits, a deadline order admitted before it must outbid it
and pays the ceiling; the bound is given with the control among the others ("all")
and without it ("control left out": as if the buyer had sent the deadline order instead
of the fixed bid). Pairs whose deadline falls after the run's last arrival (the book
drains to the floor then: an end-of-run lull no steady market has) are also shown
apart. Per run (and over all files given, pooled), it reports:

- met share: the clairvoyant's (a moment at or under the ceiling existed) against the
  control's and the deadline order's actual;
- mean price: the clairvoyant's, the deadline orders' and the controls' actual, over
  the pairs whose control was met and the clairvoyant too, and the **bound on
  saving** = 1 - mean(clairvoyant) / mean(control price) over those pairs; the actual
  saving of the deadline orders over the pairs both met, beside it;
- with ``--slack S``, the same clairvoyant bound with the window cut at the control's
  own admission + S (a deadline order that must start no later than a fixed bid
  would, give or take S);
- with ``--replay``, simple causal bid schedules replayed on the same history (each
  alone, its effect on the others ignored: :meth:`History.replay`): the floor until a
  share of the deadline, then the ceiling (0: the control's own schedule, a check of
  the replay against the controls' actual figures), and the deadline orders' own bids;
- with ``--why``, what each deadline order did at its cheapest moment (:func:`why`);
- with ``--moments``, the share of slot-free moments over the run at which the price was the floor, and
  the mean price at such moments, per decile of the run's time (is the second price
  stationary? then no timing can save much).
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bench import market, market_deadline


@dataclass
class History:
    """A run's orders (arrivals, leavings, bids) and the upstream's generation spans."""

    orders: list[market.Order]
    spans: list[tuple[float, float]]
    starts: list[float]
    ends: list[float]
    solo: bool = False
    """Leave a deadline order's control out of the others (as if the buyer had sent the
    deadline order instead of, not beside, a fixed bid)."""
    last_arrival: float = 0.0

    def running(self, t: float) -> int:
        """Generations running at ``t`` (started at or before, not ended)."""
        return bisect.bisect_right(self.starts, t) - bisect.bisect_right(self.ends, t)

    def best_other(self, t: float, x: market.Order, hi: bool) -> float:
        """The best bid of the orders other than ``x`` waiting at ``t`` (0: none);
        ``x.twin`` left out too when :attr:`solo`."""
        best = 0.0
        for o in self.orders:
            if o is x or (self.solo and o.n == x.twin) or not (o.arrival <= t <= o.leave):
                continue
            b = market_deadline.hi(o, t) if hi else market_deadline.lo(o, t)
            best = max(best, b)
        return best

    def price(self, t: float, x: market.Order, hi: bool) -> float:
        """The price ``x`` would have paid admitted at ``t``: max(floor, best other bid)."""
        return max(market.FLOOR, self.best_other(t, x, hi))

    def clairvoyant(self, x: market.Order, a: float, d: float, hi: bool) -> float | None:
        """The lowest price ``x`` could have been admitted at in [a, d] at or under its
        ceiling (None: no slot-free moment in [a, d] at or under it)."""
        got = self.cheapest(x, a, d, hi)
        return None if got is None else got[0]

    def cheapest(self, x: market.Order, a: float, d: float, hi: bool) -> tuple[float, float] | None:
        """(price, the first moment at it) of :meth:`clairvoyant`."""
        moments = self.ends[bisect.bisect_left(self.ends, a) : bisect.bisect_right(self.ends, d)]
        moments += self.starts[bisect.bisect_left(self.starts, a) : bisect.bisect_right(self.starts, d)]
        if self.running(a) < market.SLOTS:
            moments.append(a)
        best: tuple[float, float] | None = None
        for t in sorted(moments):
            p = self.price(t, x, hi)
            if p <= x.bid + 1e-9 and (best is None or p < best[0] - 1e-9):
                best = (p, t)
        return best

    def best_rank(self, t: float, x: market.Order, hi: bool) -> tuple[float, float]:
        """(bid, arrival) of the order other than ``x`` (and its control, when
        :attr:`solo`) first in the book at ``t``: the best bid, the earliest arrival among
        its equals; (0, inf) when none waits."""
        best = (0.0, float("inf"))
        for o in self.orders:
            if o is x or (self.solo and o.n == x.twin) or not (o.arrival <= t <= o.leave):
                continue
            b = market_deadline.hi(o, t) if hi else market_deadline.lo(o, t)
            if b > best[0] + 1e-9 or (abs(b - best[0]) <= 1e-9 and o.arrival < best[1]):
                best = (b, o.arrival)
        return best

    def replay(self, x: market.Order, a: float, d: float, hi: bool, switch: float | None) -> float | None:
        """The price ``x`` would have paid bidding the floor until ``a + switch * (d - a)``
        and its ceiling from then on (``switch`` None: the bids it was seen to have,
        :func:`bench.market_deadline.lo`), admitted at the first slot-free moment of
        [a, d] at which it ranks first (a better bid, or an equal one that arrived later),
        paying max(floor, the best other bid); None: not admitted by ``d``. Its effect on
        the others is ignored, as in :meth:`cheapest`."""
        moments = self.ends[bisect.bisect_left(self.ends, a) : bisect.bisect_right(self.ends, d)]
        moments += self.starts[bisect.bisect_left(self.starts, a) : bisect.bisect_right(self.starts, d)]
        if self.running(a) < market.SLOTS:
            moments.append(a)
        for t in sorted(moments):
            if switch is None:
                bid = market_deadline.lo(x, t)
            else:
                bid = market.FLOOR if t < a + switch * (d - a) else float(x.bid)
            other, since = self.best_rank(t, x, hi)
            if bid > other + 1e-9 or (abs(bid - other) <= 1e-9 and a < since):
                return max(market.FLOOR, other)
        return None


SWITCHES = (0.0, 0.25, 0.5, 0.75, 0.9)
"""The shares of its deadline after which a replayed order (:meth:`History.replay`)
leaves the floor for its ceiling."""


def replays(hs: list[History], hi: bool) -> list[str]:
    """Met share and mean price of simple bid schedules replayed on the histories
    ``hs`` (pooled), against the controls' actual (0: the ceiling from the start, the
    control's own schedule: a check of the replay), and of the deadline orders' own bids
    replayed (a check too, against their actual outcome, in the table above)."""
    L = [
        "| schedule (replayed, control left out) | pairs | met | mean price (met) | pairs also control met "
        "| replayed price | control price | saving |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for switch in (None, *SWITCHES):
        n = 0
        met: list[float] = []
        both: list[tuple[float, float]] = []
        for h in hs:
            by_n = {o.n: o for o in h.orders}
            for x in h.orders:
                if x.role != "deadline" or x.twin not in by_n:
                    continue
                n += 1
                p = h.replay(x, x.arrival, x.arrival + x.timeout, hi, switch)
                c = _paid(by_n[x.twin])
                if p is not None:
                    met.append(p)
                    if c is not None:
                        both.append((p, c))
        rp, cp = _mean([p for p, _ in both]), _mean([c for _, c in both])
        name = (
            "its own bids (lo)" if switch is None else f"floor, then ceiling from {switch:g} of the deadline"
        )
        L.append(
            f"| {name} | {n} | {_p(len(met) / n if n else float('nan'))} | {_f(_mean(met))} "
            f"| {len(both)} | {_f(rp)} | {_f(cp)} | {_p(1 - rp / cp if both else float('nan'))} |"
        )
    return L


def load(path: Path) -> History:
    """A ``BENCH_MARKET_DUMP`` file as the bench's analysis sees it (:func:`market.attach`)."""
    doc = json.loads(path.read_text())
    names = {f.name for f in fields(market.Order)}
    orders = []
    for d in doc["orders"]:
        o = market.Order(**{k: v for k, v in d.items() if k in names})
        o.frames = [tuple(f) for f in o.frames]  # type: ignore[misc]
        o.bids = [(float(t), float(b)) for t, b in o.bids]
        orders.append(o)
    stop = market.Stop(**doc["stop"]) if doc.get("stop") else None
    spans = market.attach(orders, doc["records"], stop)
    last = max((o.arrival for o in orders), default=0.0)
    return History(orders, spans, sorted(s for s, _ in spans), sorted(e for _, e in spans), last_arrival=last)


def _paid(o: market.Order) -> float | None:
    p = (o.x_market or {}).get("cleared_price") if o.start is not None else None
    return None if p is None else float(p)


def pairs(h: History, hi: bool, slack: float | None) -> list[dict[str, Any]]:
    """Per deadline order: its ceiling, deadline, actual and control prices, and the
    clairvoyant's (over its deadline, and with ``slack``, up to its control's admission
    + slack)."""
    by_n = {o.n: o for o in h.orders}
    out = []
    for x in h.orders:
        if x.role != "deadline" or x.twin is None or x.twin not in by_n:
            continue
        c = by_n[x.twin]
        a, d = x.arrival, x.arrival + x.timeout
        rec: dict[str, Any] = {
            "n": x.n, "ceiling": x.bid, "deadline_s": x.timeout,
            "met": x.start is not None, "paid": _paid(x),
            "control_met": c.start is not None, "control_paid": _paid(c),
            "clair": h.clairvoyant(x, a, d, hi), "drain": d > h.last_arrival,
        }  # fmt: skip
        if slack is not None:
            end = min(d, c.start + slack) if c.start is not None else d
            rec["clair_slack"] = h.clairvoyant(x, a, end, hi) if end >= a else None
        out.append(rec)
    return out


def why(h: History, hi: bool) -> list[dict[str, Any]]:
    """Per deadline order whose clairvoyant was met (and its control): what it did
    against the cheapest moment ``t*`` of its window (price ``p*``): ``took`` it (paid at
    most ``p*``), ``early`` (admitted before ``t*``, at a higher price), ``low`` (still
    waiting at ``t*`` with a bid under ``p*``: a cheap moment it was priced out of),
    ``passed`` (waiting at ``t*`` bidding ``p*`` or more, not admitted then: another order
    of that bid ranked first; ``low or passed``: its bid then known only to be on either
    side), ``missed`` (never admitted). Also where ``t*`` fell against its control's
    admission (``after_control``)."""
    by_n = {o.n: o for o in h.orders}
    out = []
    for x in h.orders:
        if x.role != "deadline" or x.twin not in by_n:
            continue
        c = by_n[x.twin]
        a, d = x.arrival, x.arrival + x.timeout
        got = h.cheapest(x, a, d, hi)
        if got is None or c.start is None or _paid(c) is None:
            continue
        p, t = got
        paid = _paid(x)
        start_bid = x.first_bid if x.first_bid is not None else (x.x_market or {}).get("start_bid")
        at_ceiling = min((lo for lo, _z, b in x.bid_points if b >= x.bid - 1e-9), default=None)
        if x.start is None or paid is None:
            kind = "missed"
        elif paid <= p + 1e-9:
            kind = "took"
        elif x.start < t - market.TOL_S:
            kind = "early"
        elif market_deadline.hi(x, t) < p - 1e-9:
            kind = "low"
        elif market_deadline.lo(x, t) < p - 1e-9:
            kind = "low or passed"
        else:
            kind = "passed"
        out.append({
            "n": x.n, "kind": kind, "ceiling": x.bid, "p": p, "paid": paid, "control_paid": _paid(c),
            "t_share": (t - a) / x.timeout, "start_bid": start_bid,
            "ceiling_share": None if at_ceiling is None else (at_ceiling - a) / x.timeout,
            "admit_share": None if x.start is None else (x.start - a) / x.timeout,
            "bid_at_t": (market_deadline.lo(x, t), market_deadline.hi(x, t)),
            "cleared_bid": (x.x_market or {}).get("bid") if x.start is not None else None,
            "after_control": t > c.start + market.TOL_S,
            "start_at_ceiling": start_bid is not None and float(start_bid) >= x.bid - 1e-9,
            "before_control": x.start is not None and c.arrival <= x.start < c.start,
        })  # fmt: skip
    return out


def why_lines(recs: list[dict[str, Any]]) -> list[str]:
    """:func:`why` summed up by kind."""
    L = [
        "| what the deadline order did | pairs | ceiling | p* | t* (share of deadline) | deadline paid "
        "| control paid | start bid (at ceiling) | at ceiling from (share) | admitted at (share) "
        "| cleared at its ceiling | t* after control's admission |",
        "|---|" + "---:|" * 11,
    ]
    for kind in ("took", "early", "low", "low or passed", "passed", "missed"):
        rs = [r for r in recs if r["kind"] == kind]
        if not rs:
            continue

        def m(k: str, rs: list[dict[str, Any]] = rs) -> float:
            return _mean([float(r[k]) for r in rs if r[k] is not None])

        at_c = sum(1 for r in rs if r["cleared_bid"] is not None and r["cleared_bid"] >= r["ceiling"] - 1e-9)
        L.append(
            f"| {kind} | {len(rs)} | {_f(m('ceiling'))} | {_f(m('p'))} | {_f(m('t_share'))} | {_f(m('paid'))} "
            f"| {_f(m('control_paid'))} | {_f(m('start_bid'))} ({sum(r['start_at_ceiling'] for r in rs)}) "
            f"| {_f(m('ceiling_share'))} | {_f(m('admit_share'))} | {at_c} | {sum(r['after_control'] for r in rs)} |"
        )
    before = [r for r in recs if r["before_control"]]
    L += [
        "",
        f"admitted while its control (same ceiling) still waited: {len(before)} of {len(recs)}; they paid "
        f"{_f(_mean([r['paid'] for r in before]))} (ceiling {_f(_mean([r['ceiling'] for r in before]))}, "
        f"their controls {_f(_mean([r['control_paid'] for r in before]))})",
    ]
    return L


def moments(h: History, hi: bool, parts: int = 10) -> list[tuple[int, float, float]]:
    """Per tenth of the run (by time): slot-free moments (generation ends), the share
    at the floor, the mean price max(floor, best bid waiting)."""
    if not h.ends:
        return []
    t0, t1 = h.ends[0], h.ends[-1]
    step = (t1 - t0) / parts or 1.0
    buckets: list[list[float]] = [[] for _ in range(parts)]
    for t in h.ends:
        buckets[min(parts - 1, int((t - t0) / step))].append(
            h.price(t, market.Order(-1, 0, 0, False, 0, 0, None), hi)
        )
    return [
        (len(b), sum(p <= market.FLOOR for p in b) / len(b) if b else float("nan"), _mean(b)) for b in buckets
    ]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def summarize(recs: list[dict[str, Any]], slack: float | None) -> dict[str, Any]:
    """Met shares and the bound on saving over ``recs`` (:func:`pairs`)."""
    n = len(recs)
    out: dict[str, Any] = {"pairs": n}
    out["met_control"] = sum(r["control_met"] for r in recs) / n if n else float("nan")
    out["met_deadline"] = sum(r["met"] for r in recs) / n if n else float("nan")
    out["met_clair"] = sum(r["clair"] is not None for r in recs) / n if n else float("nan")
    keys = [("clair", "bound")] + ([("clair_slack", "bound_slack")] if slack is not None else [])
    for key, name in keys:
        both = [r for r in recs if r["control_met"] and r[key] is not None and r["control_paid"] is not None]
        cp = _mean([r["control_paid"] for r in both])
        kp = _mean([r[key] for r in both])
        out[f"{name}_pairs"] = len(both)
        out[f"{name}_control_price"] = cp
        out[f"{name}_clair_price"] = kp
        out[f"{name}_saving"] = 1 - kp / cp if both else float("nan")
        out[f"{name}_at_floor"] = (
            sum(r[key] <= market.FLOOR for r in both) / len(both) if both else float("nan")
        )
        if key == "clair_slack":
            out["met_clair_slack"] = sum(r[key] is not None for r in recs) / n if n else float("nan")
    act = [r for r in recs if r["paid"] is not None and r["control_paid"] is not None]
    out["actual_pairs"] = len(act)
    dp, cp = _mean([r["paid"] for r in act]), _mean([r["control_paid"] for r in act])
    out["actual_deadline_price"], out["actual_control_price"] = dp, cp
    out["actual_saving"] = 1 - dp / cp if act else float("nan")
    # by ceiling: where is the room?
    out["by_ceiling"] = {}
    for ceil in sorted({r["ceiling"] for r in recs}):
        rs = [r for r in recs if r["ceiling"] == ceil and r["control_met"] and r["clair"] is not None]
        rs = [r for r in rs if r["control_paid"] is not None]
        act_c = [
            r
            for r in recs
            if r["ceiling"] == ceil and r["paid"] is not None and r["control_paid"] is not None
        ]
        out["by_ceiling"][ceil] = (
            len(rs), _mean([r["control_paid"] for r in rs]), _mean([r["clair"] for r in rs]),
            len(act_c), _mean([r["paid"] for r in act_c]), _mean([r["control_paid"] for r in act_c]),
        )  # fmt: skip
    return out


def _p(x: float) -> str:
    return "—" if x != x else f"{x * 100:.1f} %"


def _f(x: float) -> str:
    return "—" if x != x else f"{x:.3f}"


HEAD = (
    "| run | others | pairs | met: control | deadline | clairvoyant | bound pairs | control paid "
    "| clairvoyant (at floor) | **bound on saving** | with slack: met | bound | actual pairs both met "
    "| deadline paid | control paid | actual saving |"
)


def row(name: str, others: str, s: dict[str, Any], slack: float | None) -> str:
    """One line of the table (:data:`HEAD`) for :func:`summarize` ``s``."""
    sl = (
        f"{_p(s['met_clair_slack'])} | {_p(s['bound_slack_saving'])} ({s['bound_slack_pairs']})"
        if slack is not None
        else "— | —"
    )
    return (
        f"| {name} | {others} | {s['pairs']} | {_p(s['met_control'])} | {_p(s['met_deadline'])} "
        f"| {_p(s['met_clair'])} | {s['bound_pairs']} | {_f(s['bound_control_price'])} "
        f"| {_f(s['bound_clair_price'])} ({_p(s['bound_at_floor'])}) | **{_p(s['bound_saving'])}** | {sl} "
        f"| {s['actual_pairs']} | {_f(s['actual_deadline_price'])} | {_f(s['actual_control_price'])} "
        f"| {_p(s['actual_saving'])} |"
    )


def by_ceiling(s: dict[str, Any]) -> list[str]:
    L = ["  by ceiling: ceiling | bound pairs | control | clairvoyant | pairs both met | deadline | control"]
    for ceil, (n, cp, kp, na, dp, ca) in s["by_ceiling"].items():
        if n or na:
            L.append(f"    {ceil:.1f} | {n} | {_f(cp)} | {_f(kp)} | {na} | {_f(dp)} | {_f(ca)}")
    return L


def _rows(name: str, others: str, recs: list[dict[str, Any]], slack: float | None) -> list[str]:
    """The table's rows for ``recs``: all, and those whose deadline fell before the run's
    last arrival."""
    steady = [r for r in recs if not r["drain"]]
    return [
        row(name, others, summarize(recs, slack), slack),
        row(f"{name} (deadline before last arrival)", others, summarize(steady, slack), slack),
    ]


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dumps", nargs="+", type=Path, help="BENCH_MARKET_DUMP files (PREFIX-SEED.json)")
    ap.add_argument("--name", default="pooled", help="the scenario's name in the pooled rows")
    ap.add_argument("--hi", action="store_true", help="a deadline order's bid at t: the most it can have had")
    ap.add_argument(
        "--slack", type=float, default=None, help="also cut the window at control's admission + S"
    )
    ap.add_argument("--moments", action="store_true", help="price at slot-free moments per tenth of each run")
    ap.add_argument("--ceilings", action="store_true", help="the pooled bound per ceiling too")
    ap.add_argument("--replay", action="store_true", help="replay simple bid schedules on the history")
    ap.add_argument("--why", action="store_true", help="what each deadline order did at its cheapest moment")
    ap.add_argument("--json", type=Path, default=None, help="write the per-pair records here")
    return ap.parse_args()


def main() -> None:
    args = _args()
    hs = [load(path) for path in args.dumps]
    pooled: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    per: dict[str, Any] = {}
    L = [HEAD, "|---|---|" + "---:|" * 14]
    for path, h in zip(args.dumps, hs, strict=True):
        for solo in (False, True):
            h.solo = solo
            recs = pairs(h, args.hi, args.slack)
            per[f"{path}{' solo' if solo else ''}"] = recs
            pooled[solo] += recs
            L += _rows(path.stem, "control left out" if solo else "all", recs, args.slack)
        if args.moments:
            L += [
                f"  tenth {i}: {k} slot-free moments, at floor {_p(share)}, mean price {_f(mean)}"
                for i, (k, share, mean) in enumerate(moments(h, args.hi))
            ]
    if len(hs) > 1:
        for solo in (False, True):
            others = "control left out" if solo else "all"
            L += _rows(f"{args.name}, {len(hs)} runs pooled", others, pooled[solo], args.slack)
            if args.ceilings:
                L += by_ceiling(summarize(pooled[solo], args.slack))
    for h in hs:
        h.solo = True
    if args.replay:
        L += ["", *replays(hs, args.hi)]
    if args.why:
        L += ["", *why_lines([r for h in hs for r in why(h, args.hi)])]
    print("\n".join(L))
    if args.json:
        args.json.write_text(json.dumps(per, indent=1))


if __name__ == "__main__":
    main()
