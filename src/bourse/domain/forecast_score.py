"""The score of the wait forecast (issue 38, item 1): per admitted order, the wait
predicted when it entered the book against the wait it had; over a recent window (the
last :data:`SCORE_ORDERS` orders, none older than :data:`SCORE_WINDOW_S`), the median
absolute error and the share within a factor of two. Pure: callers pass ``now``.

Scored are the orders that rested in the book (an order admitted as it arrived, a slot
being free, waited nothing, as predicted). A prediction of none (nothing known yet, or
no slot predicted to come) counts as a miss, with no error to add to the median.
Within 2x: ``wait / 2 <= predicted <= 2 * wait``, or off by at most
:data:`SCORE_SLACK_S` (a wait of a few milliseconds is not missed by twice as few).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from bourse.domain.values import immutable

SCORE_ORDERS = 1000
SCORE_WINDOW_S = 600.0
SCORE_SLACK_S = 0.05
MARGIN_QUANTILE = 0.8
"""A quote stretches its predicted waits by this quantile of the recent waits over their
predictions (:attr:`Score.margin`), so that about as many of its quotes come true."""
MARGIN_MIN_ORDERS = 20
MARGIN_MAX = 4.0


@immutable
class Score:
    """How well the waits were predicted over the window."""

    orders: int
    """Orders scored in the window."""
    median_abs_error_s: float | None
    within_2x: float | None
    """Share of the orders whose wait was predicted within a factor of two (0 to 1)."""
    median_wait_s: float | None
    """The median wait the scored orders had (the error's scale)."""
    window_s: float
    max_orders: int
    margin: float = 1.0
    """The :data:`MARGIN_QUANTILE` quantile of the actual waits over the predicted
    medians (at least 1, at most :data:`MARGIN_MAX`; 1 with fewer than
    :data:`MARGIN_MIN_ORDERS` scored): a quote is a median too."""

    def doc(self) -> dict[str, object]:
        """The score as the market view and the quote show it."""
        return {
            "orders": self.orders,
            "median_abs_error_s": _r(self.median_abs_error_s),
            "within_2x": _r(self.within_2x),
            "median_wait_s": _r(self.median_wait_s),
            "margin": round(self.margin, 3),
            "window": {"orders": self.max_orders, "seconds": self.window_s},
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def within_2x(predicted: float | None, actual: float) -> bool:
    if predicted is None:
        return False
    return abs(predicted - actual) <= SCORE_SLACK_S or actual / 2 <= predicted <= 2 * actual


@dataclass(slots=True)
class WaitScore:
    """The recent (at, predicted, actual, median) of the orders admitted after waiting."""

    max_orders: int = SCORE_ORDERS
    window_s: float = SCORE_WINDOW_S
    _seen: deque[tuple[float, float | None, float, float | None]] = field(default_factory=deque)

    def add(self, now: float, predicted: float | None, actual: float, median: float | None = None) -> None:
        """An order admitted after waiting ``actual`` s, told ``predicted`` (None: no
        wait) as it entered; ``median``: the median of the waits it was predicted to
        have, where the wait told was another (for the margin; None: the wait told)."""
        self._seen.append((now, predicted, max(0.0, actual), predicted if median is None else median))
        while len(self._seen) > self.max_orders:
            self._seen.popleft()

    def score(self, now: float) -> Score:
        seen = self._seen
        while seen and seen[0][0] < now - self.window_s:
            seen.popleft()
        errors = [abs(p - a) for _, p, a, _ in seen if p is not None]
        hits = sum(1 for _, p, a, _ in seen if within_2x(p, a))
        n = len(seen)
        return Score(
            orders=n,
            median_abs_error_s=statistics.median(errors) if errors else None,
            within_2x=hits / n if n else None,
            median_wait_s=statistics.median(a for _, _, a, _ in seen) if n else None,
            window_s=self.window_s,
            max_orders=self.max_orders,
            margin=_margin([a / m for _, _, a, m in seen if m is not None and m >= SCORE_SLACK_S]),
        )


def _margin(ratios: list[float]) -> float:
    if len(ratios) < MARGIN_MIN_ORDERS:
        return 1.0
    ratios.sort()
    q = ratios[min(len(ratios) - 1, int(MARGIN_QUANTILE * len(ratios)))]
    return min(MARGIN_MAX, max(1.0, q))
