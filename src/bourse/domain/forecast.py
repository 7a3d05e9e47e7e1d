"""The wait forecast of one product's book (issue 38, item 1): how long an order at a
bid and a place in the book should wait for its slot, predicted from the book's own
history. Pure and synchronous: callers pass ``now`` and the book's state in.

What it goes by:

- **run lengths** (:class:`RunHistory`): how long a slot was held, per deployment,
  against the order's output cap (``max_tokens``): a least-squares line ``seconds =
  a + b * cap`` and the spread around it (:class:`RunModel`). A running order's slot
  frees after its predicted run less what it has run already, conditioned on it still
  running (the mean of the seen runs that would last longer than it has run);
- **slots that will free**: each slot of a deployment eligible at the bid (floor at or
  below it, taking orders) frees when its running order ends, then every mean run
  length after that (several running orders: the expected order statistics of their
  times left, :func:`frees`); slots of dearer deployments free too and take the
  orders ahead that bid enough for them;
- **the orders ahead** (:class:`Ahead`), in rank order, each with when it would leave
  unadmitted (its book timeout, where known) and a weight (an order of another
  replica of a shared book is stood for by this replica's own);
- **arrivals above** (:class:`ArrivalHistory`): orders that arrive later with a higher
  bid go before it; the rate of those over the recent arrivals, per price.

:func:`wait_s` walks the slots' frees in time order: at each, the orders ahead whose
timeout passed leave, and the free goes to the first order ahead, else to an arrival
above (counted at its rate, in expectation), else to this order. None when no slot
comes to it within the horizon (more arrive above than the slots take), or nothing
is known yet (no run seen).

What it does not see: clients that give up before their timeout (one in ten in the
market bench), bursts in the arrivals above (a rate over the recent arrivals), runs of
a kind not seen yet. :mod:`bourse.domain.forecast_score` scores it against the waits
that followed.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bourse.domain.values import immutable

HORIZON_S = 3600.0
"""No wait is predicted past this (None: not within it)."""
MAX_EVENTS = 20_000
"""Slot frees walked at most per prediction."""
RUNS_KEPT = 500
"""Run lengths kept per deployment (the newest)."""
MIN_FIT = 5
"""Runs needed before the line against the cap is fitted (fewer: their mean)."""
SPREAD = 16
"""Quantiles of a running order's time left (:meth:`RunModel.spread`)."""
ARRIVALS_KEPT = 4000
ARRIVAL_WINDOW_S = 120.0
"""Arrivals older than this are not counted in a rate."""
MIN_RATE_SPAN_S = 2.0
"""A rate is counted over at least this span (the first arrivals make no burst)."""


def _suffix_sums(values: Sequence[float]) -> tuple[float, ...]:
    """``out[i]``: the sum of ``values[i:]`` (``len(values) + 1`` entries)."""
    out = [0.0] * (len(values) + 1)
    for i in range(len(values) - 1, -1, -1):
        out[i] = out[i + 1] + values[i]
    return tuple(out)


def _mean_over(values: tuple[float, ...], sums: tuple[float, ...], x: float) -> float | None:
    """The mean of the sorted ``values`` over ``x`` less ``x`` (None: none is over)."""
    i = bisect_right(values, x)
    n = len(values) - i
    return None if n == 0 else sums[i] / n - x


@immutable
class RunModel:
    """How long a slot is held, from the runs seen (``cap``: the order's output cap,
    None when not known)."""

    a: float
    b: float
    errors: tuple[float, ...]
    """The seen runs less the line, sorted."""
    error_sums: tuple[float, ...]
    runs: tuple[float, ...]
    """The seen runs, sorted."""
    run_sums: tuple[float, ...]
    mean: float
    """The mean run length."""
    stationary_left: float
    """The mean time left of a run found running at a random instant: E[R²] / 2E[R]."""

    @classmethod
    def fit(cls, runs: Sequence[tuple[float, float]]) -> RunModel:
        """The model of ``runs``, (cap, seconds) each; at least one."""
        n = len(runs)
        secs = sorted(s for _, s in runs)
        mean = sum(secs) / n
        a, b = mean, 0.0
        if n >= MIN_FIT:
            mc = sum(c for c, _ in runs) / n
            var = sum((c - mc) ** 2 for c, _ in runs)
            if var > 0:
                slope = sum((c - mc) * (s - mean) for c, s in runs) / var
                if slope > 0:
                    a, b = mean - slope * mc, slope
        errors = sorted(s - (a + b * c) for c, s in runs)
        second = sum(s * s for s in secs) / n
        stationary = second / (2 * mean) if mean > 0 else 0.0
        return cls(
            a, b, tuple(errors), _suffix_sums(errors), tuple(secs), _suffix_sums(secs), mean, stationary
        )

    def total(self, cap: float | None) -> float:
        """The expected run of an order of output cap ``cap`` (None: the mean run)."""
        if cap is None:
            return self.mean
        return max(0.0, self.a + self.b * cap)

    def left(self, cap: float | None, elapsed: float | None) -> float:
        """The expected time left of a run of cap ``cap`` (None: unknown) that has run
        ``elapsed`` s (None: unknown, the time left of a run found at a random instant):
        the mean over the seen runs like it that would still be running."""
        if elapsed is None:
            return self.stationary_left
        if cap is None:
            over = _mean_over(self.runs, self.run_sums, elapsed)
        else:
            base = self.a + self.b * cap
            over = _mean_over(self.errors, self.error_sums, elapsed - base)
        if over is None:  # running longer than any run seen: soon over, as far as is known
            return max(0.05, 0.1 * self.total(cap))
        return max(0.0, over)

    def spread(self, cap: float | None, elapsed: float | None, k: int = SPREAD) -> list[float]:
        """``k`` evenly spaced quantiles of the time left of such a run (see :meth:`left`):
        what it may be, for :func:`frees`."""
        if elapsed is None:
            return [self.stationary_left] * k
        if cap is None:
            values, shift = self.runs, elapsed
        else:
            values, shift = self.errors, elapsed - (self.a + self.b * cap)
        i = bisect_right(values, shift)
        n = len(values) - i
        if n == 0:
            return [self.left(cap, elapsed)] * k
        return [max(0.0, values[i + int((j + 0.5) * n / k)] - shift) for j in range(k)]


def frees(spreads: Sequence[Sequence[float]]) -> list[float]:
    """When the slots of ``len(spreads)`` running orders free, soonest first, each order's
    time left given by its :meth:`RunModel.spread`: the expected order statistics of
    their pooled spreads (the first of several uncertain runs ends sooner than the
    soonest expected end: the fewer known the runs, the more so)."""
    n = len(spreads)
    if n == 0:
        return []
    pooled = sorted(x for s in spreads for x in s)
    return [pooled[int((j + 0.5) * len(pooled) / n)] for j in range(n)]


@dataclass(slots=True)
class RunHistory:
    """The runs seen of one product: per deployment, (cap, seconds), newest kept."""

    kept: int = RUNS_KEPT
    _runs: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _models: dict[str, RunModel | None] = field(default_factory=dict)
    _all: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, deployment: str, cap: float | None, seconds: float, *, default_cap: float) -> None:
        """A slot of ``deployment`` was held ``seconds`` by an order of output cap ``cap``."""
        run = (default_cap if cap is None else cap, max(0.0, seconds))
        runs = self._runs.get(deployment)
        if runs is None:
            runs = self._runs[deployment] = deque(maxlen=self.kept)
        runs.append(run)
        if self._all.maxlen is None:
            self._all = deque(maxlen=self.kept)
        self._all.append(run)
        self._models.pop(deployment, None)
        self._models.pop("", None)

    def model(self, deployment: str | None = None) -> RunModel | None:
        """The model of ``deployment``'s runs (of every deployment's while it has fewer
        than :data:`MIN_FIT`); None before any run was seen."""
        key = deployment or ""
        if key in self._models:
            return self._models[key]
        runs = self._runs.get(key) if key else None
        if runs is None or len(runs) < MIN_FIT:
            runs = self._all
        model = RunModel.fit(runs) if runs else None
        self._models[key] = model
        return model

    @property
    def seen(self) -> int:
        return len(self._all)


@dataclass(slots=True)
class ArrivalHistory:
    """The recent arrivals' bids (time, bid), for the rate of arrivals above a bid."""

    window_s: float = ARRIVAL_WINDOW_S
    _arrivals: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=ARRIVALS_KEPT))
    _sorted: list[float] = field(default_factory=list)
    _span: float = 0.0
    _at: float = -math.inf

    def add(self, now: float, bid: float) -> None:
        self._arrivals.append((now, bid))
        self._at = -math.inf

    def rate_above(self, bid: float, now: float, scale: float = 1.0) -> float:
        """Arrivals per second with a bid over ``bid`` (``scale``: this replica's
        arrivals stand for that many times as many in the shared book)."""
        self._refresh(now)
        if not self._sorted:
            return 0.0
        above = len(self._sorted) - bisect_right(self._sorted, bid)
        return scale * above / self._span

    def _refresh(self, now: float) -> None:
        if now - self._at < 0.25:
            return
        arr = self._arrivals
        while arr and arr[0][0] < now - self.window_s:
            arr.popleft()
        self._sorted = sorted(b for _, b in arr)
        oldest = arr[0][0] if arr else now
        self._span = max(MIN_RATE_SPAN_S, min(self.window_s, now - oldest))
        self._at = now


@immutable
class Ahead:
    """An order ahead of the one predicted for, in rank order."""

    bid: float
    leaves_in: float = math.inf
    """Seconds from now until it leaves the book unadmitted (its timeout); inf: unknown."""
    weight: float = 1.0
    """How many orders it stands for."""


@immutable
class SlotFree:
    """One slot: when it frees next (seconds from now), then every ``run_s``."""

    floor: float
    at: float
    run_s: float


def wait_s(
    bid: float,
    slots: Iterable[SlotFree],
    ahead: Sequence[Ahead],
    above_per_s: float = 0.0,
    horizon_s: float = HORIZON_S,
) -> float | None:
    """The predicted wait of an order at ``bid`` behind ``ahead`` (rank order: every
    one bids at least ``bid``), with ``above_per_s`` orders a second arriving later
    that bid more (they go before it and before the orders ahead at its own bid).
    None: no slot comes to it within ``horizon_s``."""
    heap = [(s.at, s.floor, s.run_s) for s in slots]
    pace = sum(1.0 / r for _, f, r in heap if f <= bid and r > 0)  # frees a second of its slots
    if not any(f <= bid for _, f, _ in heap):
        return None
    heapq.heapify(heap)
    left = [a.weight for a in ahead]
    leaves = [(a.leaves_in, i) for i, a in enumerate(ahead) if a.leaves_in < math.inf]
    heapq.heapify(leaves)
    head = 0
    owed = mine = 0.0
    last = 0.0
    for _ in range(MAX_EVENTS):
        t, floor, run = heapq.heappop(heap)
        if t > horizon_s:
            return None
        heapq.heappush(heap, (t + run if run > 0 else math.inf, floor, run))
        owed += above_per_s * (t - last)
        last = t
        while leaves and leaves[0][0] < t:  # gone unadmitted before this free
            left[heapq.heappop(leaves)[1]] = 0.0
        while head < len(left) and left[head] <= 1e-9:
            head += 1
        if floor > bid:  # a dearer slot: an order ahead that bids enough for it takes it
            _take(left, ahead, head, 1.0, floor)
            continue
        unit, i = _take(left, ahead, head, 1.0, bid, strictly=True)  # the ones ahead that bid more
        if unit > 1e-9 and owed > 0:  # then the arrivals above
            take = min(unit, owed)
            owed -= take
            unit -= take
        unit, i = _take(left, ahead, i, unit, bid)  # then the ones ahead at its bid
        mine += unit  # what is left is its, in expectation: its turn once that is half a free
        if mine >= 0.5 - 1e-9:
            return t
        if i >= len(left) and owed >= 1.0 and above_per_s >= pace:
            return None  # the arrivals above take every slot from here on
    return None


def _take(
    left: list[float], ahead: Sequence[Ahead], i: int, unit: float, bid: float, *, strictly: bool = False
) -> tuple[float, int]:
    """One free (``unit`` of it) taken by the orders ahead from ``i`` on that bid
    ``bid`` or more (``strictly``: more); what is left of it and where they stop."""
    while unit > 1e-9 and i < len(left) and (ahead[i].bid > bid if strictly else ahead[i].bid >= bid):
        take = min(unit, left[i])
        left[i] -= take
        unit -= take
        if left[i] <= 1e-9:
            i += 1
    return unit, i
