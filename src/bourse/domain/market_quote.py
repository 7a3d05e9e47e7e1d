"""Quotes (issue 38, item 2): the lowest bid predicted to be admitted within a wait,
searched over the prices that can matter. Pure: the caller passes the prediction.

A bid between two prices that matter waits as long as the lower one: the prices that
matter are each deployment's floor, each bid waiting (an order at it queues behind the
ones there) and the price just above each (:func:`just_above`: it goes before them).
Over a fixed book the quote is monotone: a longer wait never needs a higher bid.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from bourse.domain.values import immutable


def just_above(price: float) -> float:
    """The next price of three significant digits over ``price`` (0.9 -> 0.901; 1.0 ->
    1.01): enough to rank before the orders at ``price``."""
    if price <= 0:
        return 0.001
    step = 10.0 ** (math.floor(math.log10(price)) - 2)
    return round(math.floor(price / step + 1e-9) * step + step, 12)


def candidate_bids(floors: Iterable[float], bids: Iterable[float]) -> list[float]:
    """The prices that matter, lowest first, none under the lowest floor."""
    floors = list(floors)
    if not floors:
        return []
    low = min(floors)
    out = set(floors)
    for b in set(bids):
        if b >= low:
            out.add(b)
        out.add(max(low, just_above(b)))
    return sorted(out)


@immutable
class Quote:
    """The lowest bid predicted to start within ``within_s`` (None: no bid is), with
    its predicted wait; and the best predicted wait of any bid tried (at the highest)."""

    within_s: float
    bid: float | None
    wait_s: float | None
    top_bid: float | None
    top_wait_s: float | None


FULL_SCAN = 64
"""Up to this many prices, every one is predicted (and a higher bid is never shown
waiting longer than a lower one: each wait is the longest of the bids at or above
it); past it, the search halves them."""


def lowest_bid(candidates: list[float], wait_at: Callable[[float], float | None], within_s: float) -> Quote:
    """The lowest of ``candidates`` (ascending) whose predicted wait is ``within_s`` or
    less (the wait falls as the bid rises)."""
    if not candidates:
        return Quote(within_s, None, None, None, None)
    top = len(candidates) - 1
    if len(candidates) <= FULL_SCAN:
        waits: list[float | None] = [wait_at(b) for b in candidates]
        for i in range(top - 1, -1, -1):  # none waits less than a higher bid
            w, above = waits[i], waits[i + 1]
            waits[i] = None if w is None or above is None else max(w, above)
        for i, w in enumerate(waits):
            if w is not None and w <= within_s:
                return Quote(within_s, candidates[i], w, candidates[top], waits[top])
        return Quote(within_s, None, None, candidates[top], waits[top])
    memo: dict[int, float | None] = {}

    def at(i: int) -> float | None:
        if i not in memo:
            memo[i] = wait_at(candidates[i])
        return memo[i]

    def fits(i: int) -> bool:
        w = at(i)
        return w is not None and w <= within_s

    if not fits(top):
        return Quote(within_s, None, None, candidates[top], at(top))
    lo, hi = 0, top  # fits(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return Quote(within_s, candidates[hi], at(hi), candidates[top], at(top))
