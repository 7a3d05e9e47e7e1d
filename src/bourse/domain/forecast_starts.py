"""When an order waiting in the book starts, frees by frees (issue 38, item 1): the
chance that it has started by each slot free the orders ahead leave over, with
orders arriving later above its bid (a Poisson stream) going before it. Pure.

Each free left over goes to the highest order waiting: an arrival above if one is
waiting, else this order. So the order starts at the first free at which no
arrival above is waiting: the backlog of arrivals above grows by a Poisson count
between frees and falls by one at each free it takes. :class:`Starts` follows the
distribution of that backlog exactly (to a small pruned tail), so that the chance of
starting by each free is that chance, not a bound of it: the chance that at most
``k - 1`` arrived by the ``k``-th free (the best so far of which
:func:`~bourse.domain.forecast.wait_s` takes for a new order's wait) is less, since
it misses the orders that started at an earlier free and would have been passed by
later arrivals.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from bourse.domain.forecast_score import SCORE_SLACK_S

PRUNE = 1e-9
"""Backlogs less likely than this (together, at the tail) are dropped."""
MAX_BACKLOG = 200
"""A backlog of more arrivals above than this never clears in the walk: dropped."""
EDGE = 1.2
"""A wait walked at ``t`` counts as caught by a told wait ``w`` when ``w`` is this factor
inside the ends of its window (``1.2 t / 2 <= w <= 2 t / 1.2``): the slots free when
predicted to within a few hundredths of a second, yet a told wait at the very end of
a window catches them or not by chance (:func:`within_2x_point`)."""
WINDOW_GAIN = 0.05
NEAR_TOP = 0.03
"""An order told its wait if it starts is told another wait than its median when that
catches this share more of its chance (:data:`WINDOW_GAIN`): of the waits that catch
the most, within :data:`NEAR_TOP` of it, the nearest the median (:func:`within_2x_point`)."""


def _poisson_pmf(mean: float) -> list[float]:
    """P(N = k) for k = 0, 1, ... until what is left is under :data:`PRUNE`."""
    term = math.exp(-mean)
    out = [term]
    total = term
    k = 0
    while 1.0 - total > PRUNE and k < 10 * (mean + 10):
        k += 1
        term *= mean / k
        out.append(term)
        total += term
    return out


@dataclass(slots=True)
class Starts:
    """The backlog of arrivals above an order not started yet (``backlog[b]``: the
    chance that ``b`` are waiting and the order has not started), from time 0 on,
    with ``rate`` arrivals above a second."""

    rate: float
    limit: int = MAX_BACKLOG
    """The frees there may be in the walk at most: a backlog larger than the frees left
    never clears in it (dropped)."""
    backlog: list[float] = field(default_factory=lambda: [1.0])
    at: float = 0.0
    started: float = 0.0
    """The chance it has started by the last free."""

    def free(self, t: float) -> float:
        """A slot frees at ``t`` for the arrivals above or this order: the chance it has
        started by then."""
        mean = self.rate * max(0.0, t - self.at)
        self.at = max(self.at, t)
        if mean > 0.0:
            pmf = _poisson_pmf(mean)
            grown = [0.0] * (len(self.backlog) + len(pmf) - 1)
            for i, p in enumerate(self.backlog):
                if p > 0.0:
                    for k, q in enumerate(pmf):
                        grown[i + k] += p * q
            self.backlog = grown
        self.started += self.backlog[0]
        self.limit -= 1
        rest = self.backlog[1 : max(1, min(self.limit, MAX_BACKLOG) + 1)]
        tail = 0.0
        while rest and tail + rest[-1] < PRUNE:
            tail += rest.pop()
        self.backlog = rest or [0.0]
        return self.started


def catching(t: float, slack: float = SCORE_SLACK_S, edge: float = 1.0) -> tuple[float, float]:
    """The told waits ``w`` that a wait of ``t`` is scored within 2x of (``t / 2 <= w
    <= 2 t``, or within ``slack``: :func:`~bourse.domain.forecast_score.within_2x`),
    narrowed by the factor ``edge`` at each end."""
    return max(0.0, min(t / 2, t - slack)) * edge, max(2 * t, t + slack) / edge


def within_2x_point(
    seen: Sequence[tuple[float, float]], median: float, gain: float = WINDOW_GAIN, near: float = NEAR_TOP
) -> float:
    """The wait to tell an order whose chance of having started by ``t`` is ``p`` for
    each ``(t, p)`` of ``seen`` (its walk, times and chances ascending; the last chance
    is its chance of starting at all): a told wait ``w`` whose window (the waits it is
    scored within 2x of, :func:`catching`, kept :data:`EDGE` inside its ends: a wait
    may fall a little off the time walked) holds the most of that chance; of the waits
    that hold as much (within ``near`` of it), the run nearest ``median``, and in it the
    wait nearest ``median`` (the error stays small). So waits that
    fall in two groups within a factor of four of each other are told a wait between
    them, two far apart groups the likelier. ``median`` itself when no ``w`` holds
    ``gain`` of the chance more."""
    total = seen[-1][1] if seen else 0.0
    if total <= 1e-12 or median <= 0:
        return median
    atoms: list[tuple[float, float, float]] = []  # (from, to: the waits that catch it, its chance)
    prev = 0.0
    for t, p in seen:
        if p > prev + 1e-12:
            atoms.append((*catching(t, edge=EDGE), p - prev))
            prev = p

    def caught(w: float) -> float:
        return sum(m for a, b, m in atoms if a - 1e-12 <= w <= b + 1e-12)

    edges = sorted({e for a, b, _ in atoms for e in (a, b) if e > 0})
    cuts = [(a, b, caught(math.sqrt(a * b))) for a, b in itertools.pairwise(edges)]
    top = max((m for _, _, m in cuts), default=0.0)
    if top - caught(median) < gain * total - 1e-12 or top <= 0.0:
        return median
    runs: list[tuple[float, float]] = []  # the runs of cuts within ``near`` of the top
    for a, b, m in cuts:
        if m < top - near * total - 1e-12:
            continue
        if runs and abs(runs[-1][1] - a) <= 1e-12:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))

    def off(run: tuple[float, float]) -> float:
        return max(0.0, math.log(run[0] / median), math.log(median / run[1]))

    a, b = min(runs, key=off)
    return min(b, max(a, median))
