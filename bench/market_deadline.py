"""Deadline orders in the market bench (issue 38, item 3): what ``bench/market.py`` adds
to each run, and the bids the book's invariants judge them at.

- **deadline orders**: one order in :data:`SHARE` (chosen by a generator of its own, so
  the rest of the plan is the same; never a quote order) sends ``deadline_s`` with
  ``max_price`` = its planned bid (one of the ten levels) as its ceiling. Its deadline
  is that of a buyer with slack: the wait a fixed order :data:`BELOW` (one or two,
  drawn) levels under the ceiling has seen so far in the run (the median of the plain
  fixed orders of that level that have ended: their ``queued_ms`` if they started,
  their book timeout if they got a 408; :data:`FIRST_WAIT_S` before any has ended; the
  lowest level for a ceiling with none under it) times a factor drawn from
  :data:`FACTOR`, within :data:`DEADLINE_S`. The draw reads only orders that have
  ended before it is sent, never its own outcome;
- **their control group**: the next order of the plan (not a quote order) becomes its
  twin, a fixed bid at the same ceiling with the deadline as its book timeout, in the
  same mix. Which of the two arrives first is drawn (even odds): with equal bids the
  first of them ranks first and pays the other's bid (the best other bid), so a
  deadline order raised to its ceiling always ahead of its control would always pay its
  control's price, and never the reverse. The first of the pair draws the deadline as
  it is sent; the second takes it. Both are streamed (so that every bid the deadline
  order had is seen: its ``: queued bid=`` frame, then ``bid=`` on each ``: queued
  level=`` frame) and neither is cancelled;
- **met share**: the share admitted (its engine started) before the deadline, of the
  deadline orders against the controls; **mean price**: the mean ``cleared_price`` of
  those admitted (and, over the pairs both admitted, what the deadline orders paid in
  all against their controls). Targets: met share at most :data:`MET_PP` percentage
  points below the control's; mean price at least :data:`SAVING` below it.

A deadline order's bid rises while it waits, so the book's invariants judge it at the
bid it had at each moment, known within bounds (:func:`lo`, :func:`hi`): each bid seen
held at some instant of an interval (its start bid from its arrival on; a frame's, at
most ``POS_TOL_S`` before the client read it; the receipt's ``bid``, at its admission),
and a bid only rises. Before any is seen it is at least the floor; after the last, at
most its ceiling.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

SHARE = 0.2
"""Deadline orders among all orders (and as many controls)."""
BELOW = (1, 2)
"""A deadline order's deadline is drawn from the waits of the level this many levels
(one of them, drawn) under its ceiling: enough time for a lower bid to clear."""
LEVEL = 0.1
"""The step between the bench's bid levels."""
FACTOR = (2.0, 4.0)
DEADLINE_S = (1.0, 10.0)
FIRST_WAIT_S = 2.0
"""A deadline order's base wait before any fixed order of its level has ended (about a
run's length)."""
MET_PP = 2.0
SAVING = 0.2


def mark(orders: list[Any], seed: int) -> None:
    """Make :data:`SHARE` of ``orders`` deadline orders (``role``), each next to its
    control (``twin``: the other's number both ways), the first of the two drawn."""
    rng = random.Random(seed)
    p = SHARE / (1.0 - SHARE)  # each pair takes two orders
    waiting: Any = None
    for o in orders:
        if o.quote_s is not None:
            continue
        if waiting is not None:
            o.role = "control" if waiting.role == "deadline" else "deadline"
            o.twin, waiting.twin = waiting.n, o.n
            o.bid, o.stream, o.cancel_after = waiting.bid, True, None
            o.factor, o.below = waiting.factor, waiting.below
            waiting = None
        elif rng.random() < p:
            o.role = "deadline" if rng.random() < 0.5 else "control"
            o.stream, o.cancel_after = True, None
            o.factor = rng.uniform(*FACTOR)
            o.below = rng.randint(*BELOW)
            waiting = o


class Seen:
    """The waits the plain fixed orders of each level have had so far in the run."""

    def __init__(self) -> None:
        self.waits: dict[float, list[float]] = {}

    def add(self, o: Any) -> None:
        if o.role or o.quote_s is not None:
            return
        xm = o.x_market or {}
        if xm.get("queued_ms") is not None:
            wait = float(xm["queued_ms"]) / 1000.0
        elif o.outcome == "timeout":
            wait = o.timeout  # it waited that long and was not admitted
        else:
            return
        self.waits.setdefault(o.bid, []).append(wait)

    def wait(self, level: float) -> float:
        got = self.waits.get(level)
        return statistics.median(got) if got else FIRST_WAIT_S


def level_below(ceiling: float, steps: int) -> float:
    """The bench's level ``steps`` under ``ceiling`` (the lowest level, :data:`LEVEL`, at least)."""
    return round(max(LEVEL, ceiling - steps * LEVEL), 1)


def prepare(o: Any, seen: Seen, by_n: dict[int, Any]) -> None:
    """Just before ``o`` is sent: a deadline order's deadline, a control's timeout: drawn
    by the first of the pair, taken by the second (its twin, earlier in the plan, was
    sent before it)."""
    if not o.role:
        return
    if o.twin is not None and o.twin < o.n:
        d = by_n[o.twin].timeout
    else:
        d = round(
            min(DEADLINE_S[1], max(DEADLINE_S[0], seen.wait(level_below(o.bid, o.below)) * o.factor)), 2
        )
    o.timeout = d
    if o.role == "deadline":
        o.deadline_s = d


# --------------------------------------------------------------------------- bids


def bid_points(orders: list[Any], floor: float, pos_tol_s: float) -> None:
    """Each deadline order's bids seen, as (earliest, latest instant, bid): call once
    its arrival and leaving are known."""
    for o in orders:
        if o.role != "deadline":
            continue
        xm = o.x_market or {}
        pts: list[tuple[float, float, float]] = []
        start = o.first_bid if o.first_bid is not None else xm.get("start_bid")
        if start is not None:
            pts.append((o.arr_lo, o.arr_hi, float(start)))
        pts += [(t - pos_tol_s, t, b) for t, b in o.bids]
        if o.start is not None and xm.get("bid") is not None:
            pts.append((o.leave_lo, o.leave_hi, float(xm["bid"])))
        o.bid_points = pts
        o.floor = floor


def lo(o: Any, t: float) -> float:
    """The least bid ``o`` can have had at ``t`` (a bid seen certainly before)."""
    if o.role != "deadline":
        return float(o.bid)
    return float(max((b for _a, z, b in o.bid_points if z <= t), default=o.floor))


def hi(o: Any, t: float) -> float:
    """The greatest bid ``o`` can have had at ``t`` (a bid seen certainly after)."""
    if o.role != "deadline":
        return float(o.bid)
    return min((b for a, _z, b in o.bid_points if a >= t), default=float(o.bid))


def cleared_bid(o: Any, t: float) -> float:
    """The bid an admitted order had when it cleared (at ``t``): its receipt's (a deadline
    order's last), else the most it can have been."""
    if o.role != "deadline":
        return float(o.bid)
    xm = o.x_market or {}
    return float(xm["bid"]) if xm.get("bid") is not None else hi(o, t)


# --------------------------------------------------------------------------- figures


def records(orders: list[Any]) -> list[dict[str, Any]]:
    """The deadline orders and their controls as :func:`summary_of` reads them (plain
    values: the runs of several seeds are pooled by putting their records together)."""
    return [
        {"n": o.n, "role": o.role, "twin": o.twin, "ceiling": float(o.bid), "deadline_s": o.timeout,
         "met": o.start is not None, "paid": _paid(o), "start_bid": _start_bid(o), "raised": _raised(o),
         "cleared_bid": (o.x_market or {}).get("bid") if o.start is not None else None}
        for o in orders if o.role in ("deadline", "control")
    ]  # fmt: skip


def summary(orders: list[Any]) -> dict[str, Any]:
    """Met share and mean price of the deadline orders and of their controls (and the
    records they are counted from, ``deadline_records``)."""
    recs = records(orders)
    return {**summary_of(recs), "deadline_records": recs}


def summary_of(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`summary` of :func:`records`."""
    out: dict[str, Any] = {}
    for role in ("deadline", "control"):
        group = [r for r in recs if r["role"] == role]
        met = [r for r in group if r["met"]]
        paid = [r["paid"] for r in met if r["paid"] is not None]
        rel = [r["paid"] / r["ceiling"] for r in met if r["paid"] is not None]
        out[f"{role}_orders"] = len(group)
        out[f"{role}_met"] = len(met)
        out[f"{role}_met_share"] = len(met) / len(group) if group else float("nan")
        out[f"{role}_mean_price"] = statistics.fmean(paid) if paid else float("nan")
        out[f"{role}_price_of_ceiling"] = statistics.fmean(rel) if rel else float("nan")
        out[f"{role}_mean_deadline_s"] = (
            statistics.fmean(r["deadline_s"] for r in group) if group else float("nan")
        )
    dl = [r for r in recs if r["role"] == "deadline"]
    by_n = {r["n"]: r for r in recs}
    out["deadline_raised"] = sum(1 for r in dl if r["raised"])
    out["deadline_start_of_ceiling"] = _mean(
        [r["start_bid"] / r["ceiling"] for r in dl if r["start_bid"] is not None]
    )
    out["deadline_cleared_at_ceiling"] = sum(1 for r in dl if r["met"] and r["cleared_bid"] == r["ceiling"])
    pairs = [(r["paid"], by_n[r["twin"]]["paid"]) for r in dl if r["twin"] in by_n]
    both = [(d, c) for d, c in pairs if d is not None and c is not None]
    out["pairs_both_met"] = len(both)
    out["pairs_saving"] = 1.0 - sum(d for d, _ in both) / sum(c for _, c in both) if both else float("nan")
    out["met_gap_pp"] = (out["deadline_met_share"] - out["control_met_share"]) * 100
    c, d = out["control_mean_price"], out["deadline_mean_price"]
    out["saving"] = 1.0 - d / c if c == c and d == d and c > 0 else float("nan")
    return out


def pooled(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row of the deadline table for the runs ``rows`` (one scenario, several seeds)
    together: their records pooled (numbered apart), their admissions summed."""
    recs = []
    for i, r in enumerate(rows):
        shift = i * 1_000_000
        recs += [{**x, "n": x["n"] + shift, "twin": None if x["twin"] is None else x["twin"] + shift}
                 for x in r["deadline_records"]]  # fmt: skip
    out = {"name": name, "pooled": len(rows), **summary_of(recs)}
    for k in ("judged_with_deadline", "admissions", "inversions", "fifo"):
        out[k] = sum(r[k] for r in rows)
    return out


def _paid(o: Any) -> float | None:
    """The price an admitted order paid (None: not admitted)."""
    p = (o.x_market or {}).get("cleared_price") if o.start is not None else None
    return None if p is None else float(p)


def _start_bid(o: Any) -> float | None:
    if o.first_bid is not None:
        return float(o.first_bid)
    s = (o.x_market or {}).get("start_bid")
    return None if s is None else float(s)


def _raised(o: Any) -> bool:
    """Its bid was seen above its start bid."""
    s = _start_bid(o)
    seen = [b for _t, b in o.bids] + [float((o.x_market or {}).get("bid") or 0.0)]
    return s is not None and max(seen) > s


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def _pct(x: float, fmt: str = ".0f") -> str:
    return "—" if x != x else f"{x * 100:{fmt}} %"


def checks(r: dict[str, Any]) -> tuple[bool, bool]:
    """(met share within :data:`MET_PP` of the control's, paid at least :data:`SAVING` less)."""
    gap, saving = r["met_gap_pp"], r["saving"]
    return gap == gap and gap >= -MET_PP, saving == saving and saving >= SAVING


def section_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The deadline orders' table of the market section."""
    L = [
        f"Deadline orders (issue 38): one order in {round(1 / SHARE)} sends `deadline_s` with `max_price` its "
        "planned level as the ceiling, the deadline that of a buyer with slack: the median wait the fixed "
        f"orders {BELOW[0]}-{BELOW[1]} levels (drawn) under the ceiling had so far in the run (their "
        f"`queued_ms`, or their timeout if they got a 408; {FIRST_WAIT_S:g} s before any; the lowest level "
        f"for the lowest ceilings) times {FACTOR[0]:g}-{FACTOR[1]:g}, within {DEADLINE_S[0]:g}-{DEADLINE_S[1]:g} "
        "s, drawn from orders ended before it is sent, never from its own outcome; the next order of the "
        "plan is its control, a fixed bid at the ceiling with the deadline as its book timeout, the first of "
        "the two to arrive drawn (with equal bids the first ranks first and pays the other's bid). Both streamed, "
        "neither cancelled. Met: admitted (engine started) before the deadline; price: the mean `cleared_price` "
        "of those met (and as a share of their ceiling). The inversions and FIFO violations of the first table "
        "judge a deadline order at the bid it had at each moment (its start bid, each frame's `bid=`, the "
        "receipt's `bid`; a bid only rises). Targets: met share no more than "
        f"{MET_PP:g} points below the control's; mean price at least {SAVING:.0%} lower.",
        "",
        "| run | deadline orders (mean deadline s) | met | controls | met | met gap, points "
        "| mean price: deadline (of ceiling) | control (of ceiling) | saving "
        "| start bid of ceiling | raised | cleared at ceiling | pairs both met: saving "
        "| admissions judged with a deadline order "
        "(inversions, FIFO) | met gap ≤ 2 points | saving ≥ 20 % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        if "failed" in r or "deadline_orders" not in r:
            continue
        met_ok, price_ok = checks(r)
        L.append(
            f"| {r['name']} | {r['deadline_orders']} ({_f(r['deadline_mean_deadline_s'], '.1f')}) "
            f"| {_pct(r['deadline_met_share'], '.1f')} ({r['deadline_met']}) "
            f"| {r['control_orders']} | {_pct(r['control_met_share'], '.1f')} ({r['control_met']}) "
            f"| {_f(r['met_gap_pp'], '+.1f')} "
            f"| {_f(r['deadline_mean_price'], '.3f')} ({_pct(r['deadline_price_of_ceiling'])}) "
            f"| {_f(r['control_mean_price'], '.3f')} ({_pct(r['control_price_of_ceiling'])}) "
            f"| {_pct(r['saving'], '.1f')} | {_pct(r['deadline_start_of_ceiling'])} "
            f"| {r['deadline_raised']} | {r['deadline_cleared_at_ceiling']} "
            f"| {r.get('pairs_both_met', '—')}: {_pct(r.get('pairs_saving', float('nan')), '.1f')} "
            f"| {r['judged_with_deadline']} of {r['admissions']} ({r['inversions']}, {r['fifo']}) "
            f"| {'**met**' if met_ok else '**missed**'} | {'**met**' if price_ok else '**missed**'} |"
        )
    done = [r for r in rows if "failed" not in r and "deadline_orders" in r and "pooled" not in r]
    pools = [r for r in rows if "pooled" in r]
    if done:
        met = sum(checks(r)[0] for r in done)
        cheap = sum(checks(r)[1] for r in done)
        pooled_note = "".join(
            f" {r['name']}: met share {'met' if checks(r)[0] else 'missed'}, price "
            f"{'met' if checks(r)[1] else 'missed'}."
            for r in pools
        )
        L += [
            "",
            f"Deadline targets: met share in {met} of {len(done)} runs, price in {cheap} of {len(done)}."
            f"{pooled_note} "
            'A deadline order pays less only when it clears below its ceiling: "start bid of ceiling" is the '
            'mean bid the gateway started them at (`Market.bid_for`) over their ceiling, "raised" how many '
            'were seen bidding more later, "cleared at ceiling" how many of those met cleared at it; "pairs '
            'both met" the pairs whose deadline order and control were both admitted, and the saving over '
            "them (the total the deadline orders paid against their controls', ceiling for ceiling).",
        ]
    L.append("")
    return L
