"""The wait forecast and the quotes in the market bench (issue 38, items 1 and 2): what
``bench/market.py`` adds to each run.

- **quote orders**: half an order a second (chosen by a generator of its own, so the
  rest of the plan is the same) first asks ``GET /v1/market/p/quote?within_s=S`` (S of
  :data:`QUOTE_WITHIN_S`) of its replica and bids the quoted price (its book timeout
  at least S + 3 s). The quote's **hit rate**: the share of those that bid a quoted
  price whose engine started within S of their arrival in the book;
- **the estimate's score as the bench measures it**: every ``: queued`` frame's
  ``wait_s`` against the wait that followed (``frames`` in ``bench/market.py``), here
  also per order (its first frame) and the median error over the median wait;
- **the gateway's own score**: ``forecast`` of ``GET /v1/market/p`` on each replica at
  the end of the run (each replica scores its own orders: the wait predicted when the
  order entered the book against the wait it had).

Targets (issue 38): within 2x for at least 90 % of orders, the median absolute error at
most 25 % of the median wait.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import aiohttp
import httpx

QUOTE_PER_S = 0.5
"""Quote orders a second, whatever the load (a quarter of the capacity: more of them
than the slots take would only bid against each other)."""
QUOTE_WITHIN_S = (2.0, 5.0)
WITHIN_2X = 0.9
ERROR_OF_MEDIAN = 0.25


def mark_quote_orders(orders: list[Any], seed: int, per_s: float) -> None:
    """Orders that ask a quote first (``o.quote_s``), :data:`QUOTE_PER_S` a second of the
    ``per_s`` arriving, their timeouts long enough for it."""
    rng = random.Random(seed)
    share = min(1.0, QUOTE_PER_S / per_s)
    for o in orders:
        if rng.random() < share:
            o.quote_s = rng.choice(QUOTE_WITHIN_S)
            o.timeout = max(o.timeout, o.quote_s + 3.0)


async def ask_quote(http: aiohttp.ClientSession, base: str, o: Any) -> None:
    """Ask the order's replica for the bid to start within ``o.quote_s``; bid it (no bid
    quoted: the order keeps its planned bid and is not counted in the hit rate)."""
    try:
        async with http.get(f"{base}/market/p/quote?within_s={o.quote_s:g}") as r:
            doc = await r.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        o.quoted = {"error": type(exc).__name__}
        return
    o.quoted = doc
    if r.status == 200 and doc.get("bid") is not None:
        o.bid = float(doc["bid"])


def quotes(orders: list[Any]) -> dict[str, Any]:
    """The quote orders: how many asked, got a bid, started within S."""
    asked = [o for o in orders if o.quote_s is not None]
    bid = [o for o in asked if o.quoted and o.quoted.get("bid") is not None]
    hits = [o for o in bid if o.start is not None and o.start - o.arrival <= o.quote_s]
    return {
        "quote_orders": len(asked),
        "quoted": len(bid),
        "quote_hits": len(hits),
        "quote_hit_rate": len(hits) / len(bid) if bid else float("nan"),
        "quote_started": sum(1 for o in bid if o.start is not None),
    }


def per_order(orders: list[Any]) -> dict[str, Any]:
    """Each started order's first ``: queued`` frame against the wait left then, and
    every frame's median error over the median wait left."""
    first_hits = first_n = 0
    errs: list[float] = []
    lefts: list[float] = []
    for o in orders:
        if o.start is None:
            continue
        for k, (t, w) in enumerate((t, w) for t, _p, w in o.frames if t <= o.start):
            left = o.start - t
            lefts.append(left)
            if w is not None:
                errs.append(abs(w - left))
            if k == 0:
                first_n += 1
                first_hits += w is not None and left / 2 <= w <= 2 * left
    med_err = statistics.median(errs) if errs else float("nan")
    med_left = statistics.median(lefts) if lefts else float("nan")
    return {
        "first_frame_orders": first_n,
        "first_frame_within_2x": first_hits / first_n if first_n else float("nan"),
        "wait_left_median_s": med_left,
        "wait_error_of_median": med_err / med_left if lefts and med_left > 0 else float("nan"),
    }


def gateway_scores(bases: list[str]) -> list[dict[str, Any]]:
    """Each replica's ``forecast`` of ``GET /v1/market/p``."""
    out = []
    for base in bases:
        try:
            out.append(httpx.get(base + "/market/p", timeout=10).json().get("forecast") or {})
        except httpx.HTTPError as exc:
            out.append({"error": type(exc).__name__})
    return out


def gateway_summary(scores: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' scores together: orders summed; the rest weighted by orders."""
    ok = [s for s in scores if s.get("orders")]
    n = sum(s["orders"] for s in ok)

    def weighted(key: str) -> float:
        vals = [(s[key], s["orders"]) for s in ok if s.get(key) is not None]
        total = sum(w for _, w in vals)
        return sum(v * w for v, w in vals) / total if total else float("nan")

    return {
        "gw_orders": n,
        "gw_within_2x": weighted("within_2x"),
        "gw_mae_s": weighted("median_abs_error_s"),
        "gw_median_wait_s": weighted("median_wait_s"),
    }


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def section_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The forecast's and the quotes' table of the market section."""
    L = [
        "Wait estimate and quotes (issue 38): the bench's own measure (every `: queued` frame's `wait_s` "
        "against the wait that followed, and each order's first frame), the gateway's own score "
        "(`forecast` of `/v1/market/p`: each order's wait predicted as it entered the book against the wait "
        f"it had; replicas weighted by their orders), and the quote orders ({QUOTE_PER_S:g} a second "
        f"ask `/v1/market/p/quote?within_s=S`, S of {', '.join(f'{s:g}' for s in QUOTE_WITHIN_S)} s, and bid "
        "the quoted price): the share that started within S. Targets: within 2x for "
        f"≥ {WITHIN_2X:.0%} of orders, median error ≤ {ERROR_OF_MEDIAN:.0%} of the median wait.",
        "",
        "| run | frames within 2x | first frame within 2x (orders) | frames: median error / median wait "
        "| gateway: orders scored | gateway: within 2x | gateway: median error s / median wait s "
        "| quote orders (bid quoted) | quote hit rate | targets: frames | targets: gateway |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    met = {"frames": 0, "gateway": 0}
    counted = 0
    for r in rows:
        if "failed" in r:
            continue
        med = r["gw_median_wait_s"]
        gw_ratio = r["gw_mae_s"] / med if med == med and med > 0 else float("nan")
        frames_ok = meets(r["wait_within_2x"], r["wait_error_of_median"])
        gateway_ok = meets(r["gw_within_2x"], gw_ratio)
        counted += 1
        met["frames"] += frames_ok
        met["gateway"] += gateway_ok
        L.append(
            f"| {r['name']} | {_f(r['wait_within_2x'] * 100, '.0f')} % "
            f"| {_f(r['first_frame_within_2x'] * 100, '.0f')} % ({r['first_frame_orders']}) "
            f"| {_f(r['wait_error_of_median'] * 100, '.0f')} % "
            f"| {r['gw_orders']} | {_f(r['gw_within_2x'] * 100, '.0f')} % "
            f"| {_f(r['gw_mae_s'], '.2f')} / {_f(r['gw_median_wait_s'], '.2f')} ({_f(gw_ratio * 100, '.0f')} %) "
            f"| {r['quote_orders']} ({r['quoted']}) | {_f(r['quote_hit_rate'] * 100, '.0f')} % "
            f"| {_met(frames_ok)} | {_met(gateway_ok)} |"
        )
    L += [
        "",
        f"Forecast targets (both at once: within 2x ≥ {WITHIN_2X:.0%}, median error ≤ {ERROR_OF_MEDIAN:.0%} of "
        f"the median wait): the frames in {met['frames']} of {counted} runs, the gateway's own score in "
        f"{met['gateway']} of {counted}.",
        "",
    ]
    return L


def meets(within_2x: float, error_of_median: float) -> bool:
    """Both targets of issue 38 (a NaN, nothing scored, meets neither)."""
    return within_2x >= WITHIN_2X and error_of_median <= ERROR_OF_MEDIAN


def _met(ok: bool) -> str:
    return "**met**" if ok else "**missed**"
