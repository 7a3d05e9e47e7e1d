"""The wait forecast of one product's book (issue 38, item 1): how long an order at a
bid and a place in the book should wait for its slot, predicted from the book's own
history. Pure and synchronous: callers pass ``now`` and the book's state in.

What it goes by:

- **run lengths** (:class:`RunHistory`): how long a slot was held, per deployment,
  against the order's output cap (``max_tokens``): a line ``seconds = a + b * cap``
  (least squares over the runs near a resistant line, so that runs cut short do not
  bend it) and the spread of the runs around it (:class:`RunModel`). A running
  order's slot frees after its predicted run less what it has run already,
  conditioned on it still running (the seen runs that would last longer than it has
  run);
- **slots that will free**: each slot of a deployment eligible at the bid (floor at or
  below it, taking orders) frees when its running order ends, then when the run of
  the order ahead that took it ends (its output cap known: :attr:`Ahead.run_s`), else
  a mean run length after (several running orders: the expected order statistics of
  their times left, :func:`frees`); slots of dearer deployments free too and take the
  orders ahead that bid enough for them;
- **the orders ahead** (:class:`Ahead`), in rank order, each with when it would leave
  unadmitted (its book timeout, where known) and a weight (an order of another
  replica of a shared book is stood for by this replica's own), each still there at
  ``t`` with the chance ``exp(-r t)``, ``r`` the rate at which waiting orders gave up
  lately (:class:`GiveUps`: clients that leave before their timeout);
- **arrivals above** (:class:`ArrivalHistory`): orders that arrive later with a higher
  bid go before it; the rate of all arrivals (the larger over the newest 30 and the
  newest 100, so a burst shows soon) times the share of the newest 100 above the bid.

:func:`wait_s` answers the **median** of the wait, not its mean (the score counts the
share within a factor of two and the median error, both best served by the median):
it walks the slots' frees in time order; the orders ahead take them first; the frees
they leave over go to the arrivals above that came (a Poisson count), else to this
order. An order waiting in the book is told its wait *if it starts* before its
timeout (one likely to time out starts, if it does, in a lull of the arrivals
above): the chance that it starts at each free is followed exactly
(:class:`~bourse.domain.forecast_starts.Starts`), and it is told, rather than the
median, the wait that catches the most of that chance within a factor of two when
that catches more (:func:`~bourse.domain.forecast_starts.within_2x_point`: the frees
come when predicted to within a few hundredths of a second, so its waits fall on a
few known times, and which one is for the arrivals above to decide). None when no
slot is likely to come to it within the horizon, or nothing is known yet (no run
seen).

What it does not see: bursts in the arrivals above (a rate over the newest arrivals
follows a burst, does not foresee it), runs of a kind not seen yet, a raised bid
(a deadline order's) before it is raised. :mod:`bourse.domain.forecast_score` scores
it against the waits that followed.
"""

from __future__ import annotations

import heapq
import math
import statistics
from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bourse.domain.forecast_starts import Starts, within_2x_point
from bourse.domain.values import immutable

HORIZON_S = 3600.0
"""No wait is predicted past this (None: not within it)."""
MAX_EVENTS = 20_000
"""Slot frees walked at most per prediction."""
SURE = 0.99
"""The walk of an order told its wait if it starts stops once it starts by then with
this chance, or at 4 times its median wait (what is left moves the answer by little)."""
EXACT_POISSON_MEAN = 60.0
RUNS_KEPT = 500
"""Run lengths kept per deployment (the newest)."""
MIN_FIT = 5
"""Runs needed before the line against the cap is fitted (fewer: their mean)."""
OFF_LINE_MADS = 6.0
OFF_LINE_SHARE = 0.05
"""A run is off the line when its error is further from the median error than this many
median absolute deviations, and this share of the mean run (:meth:`RunModel.fit`)."""
SPREAD = 16
"""Quantiles of a running order's time left (:meth:`RunModel.spread`)."""
ARRIVALS_KEPT = 4000
ARRIVAL_WINDOW_S = 120.0
"""Arrivals older than this are not counted in a rate."""
RATE_ARRIVALS = 100
"""The share of the arrivals above a bid is counted over the newest this many (within
the window)."""
RATE_ARRIVALS_SOON = 30
"""The rate of all arrivals is the larger of the rates over the newest
:data:`RATE_ARRIVALS` and the newest this many: a burst, or the end of a quiet spell,
shows within a few dozen arrivals."""
GIVE_UP_WINDOW_S = 120.0
"""The time constant of the rate at which waiting orders give up (:class:`GiveUps`)."""
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


def _line(runs: Sequence[tuple[float, float]], mean: float) -> tuple[float, float]:
    """The least-squares line ``seconds = a + b * cap`` of ``runs`` (``mean``: their
    mean seconds); flat (the mean) when the caps do not vary or the slope is not positive."""
    n = len(runs)
    mc = sum(c for c, _ in runs) / n
    var = sum((c - mc) ** 2 for c, _ in runs)
    if var > 0:
        slope = sum((c - mc) * (s - mean) for c, s in runs) / var
        if slope > 0:
            return mean - slope * mc, slope
    return mean, 0.0


def _resistant_line(runs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Tukey's resistant line of ``runs``: the slope through the medians of the third
    with the lowest caps and of the third with the highest, the intercept the median
    of what is left; flat (the median) when the caps do not vary or the slope is not
    positive."""
    by_cap = sorted(runs)
    k = max(1, len(by_cap) // 3)
    lo, hi = by_cap[:k], by_cap[-k:]
    c_lo, c_hi = statistics.median(c for c, _ in lo), statistics.median(c for c, _ in hi)
    b = 0.0
    if c_hi > c_lo:
        b = max(
            0.0, (statistics.median(s for _, s in hi) - statistics.median(s for _, s in lo)) / (c_hi - c_lo)
        )
    return statistics.median(s - b * c for c, s in runs), b


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
        """The model of ``runs``, (cap, seconds) each; at least one. The line is the
        least-squares one of the runs near a resistant line (:func:`_resistant_line`,
        which a few runs far off do not move): a run cut short (its client left, its
        engine failed) says nothing of how long a run of its cap lasts, yet it stays
        among the errors (a running order may be cut short too)."""
        n = len(runs)
        secs = sorted(s for _, s in runs)
        mean = sum(secs) / n
        a, b = mean, 0.0
        if n >= MIN_FIT:
            a, b = _resistant_line(runs)
            errs = sorted(s - (a + b * c) for c, s in runs)
            mid = errs[n // 2]
            mad = sorted(abs(e - mid) for e in errs)[n // 2]
            tol = max(OFF_LINE_MADS * mad, OFF_LINE_SHARE * mean)
            kept = [(c, s) for c, s in runs if abs(s - (a + b * c) - mid) <= tol]
            if len(kept) >= MIN_FIT:
                a, b = _line(kept, sum(s for _, s in kept) / len(kept))
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
    _rate: float = 0.0
    _steady: float = 0.0
    _at: float = -math.inf

    def add(self, now: float, bid: float) -> None:
        self._arrivals.append((now, bid))
        self._at = -math.inf

    def rate_above(self, bid: float, now: float, scale: float = 1.0, *, steady: bool = False) -> float:
        """Arrivals per second with a bid over ``bid`` (``scale``: this replica's
        arrivals stand for that many times as many in the shared book): the rate of all
        arrivals times the share of them above ``bid`` (of the newest
        :data:`RATE_ARRIVALS`). ``steady``: the rate of all arrivals is their mean over
        the window, not the newest ones' (a burst, or a lull, passes: what an order with
        time to spare can expect over that time)."""
        self._refresh(now)
        if not self._sorted:
            return 0.0
        above = len(self._sorted) - bisect_right(self._sorted, bid)
        rate = self._steady if steady else self._rate
        return scale * rate * above / len(self._sorted)

    def _refresh(self, now: float) -> None:
        if now - self._at < 0.25:
            return
        arr = self._arrivals
        while arr and arr[0][0] < now - self.window_s:
            arr.popleft()
        counted = list(arr)[-RATE_ARRIVALS:]
        self._sorted = sorted(b for _, b in counted)
        self._rate = max(
            _rate(counted, now, self.window_s), _rate(counted[-RATE_ARRIVALS_SOON:], now, self.window_s)
        )
        self._steady = _rate(arr, now, self.window_s)
        self._at = now


def _rate(arrivals: Sequence[tuple[float, float]], now: float, window_s: float) -> float:
    """Arrivals a second over the span from the oldest of ``arrivals`` to ``now`` (at
    least :data:`MIN_RATE_SPAN_S`)."""
    if not arrivals:
        return 0.0
    return len(arrivals) / max(MIN_RATE_SPAN_S, min(window_s, now - arrivals[0][0]))


@dataclass(slots=True)
class GiveUps:
    """How often a waiting order leaves the book unadmitted before its timeout (its
    client gave up): give-ups per second waited, over the recent past (sums decaying
    with a time constant of :data:`GIVE_UP_WINDOW_S`)."""

    window_s: float = GIVE_UP_WINDOW_S
    _left: float = 0.0
    _waited: float = 0.0
    _at: float | None = None

    def waiting(self, now: float, n: int) -> None:
        """``n`` orders waited since the last call (call before the count changes)."""
        if self._at is not None and now > self._at:
            dt = now - self._at
            keep = math.exp(-dt / self.window_s)
            self._left *= keep
            self._waited = self._waited * keep + n * dt
        if self._at is None or now > self._at:
            self._at = now

    def gave_up(self) -> None:
        self._left += 1.0

    def per_s(self) -> float:
        """Give-ups per order and second waited (0 until some waiting was seen)."""
        return self._left / self._waited if self._waited > 1.0 else 0.0


@immutable
class Ahead:
    """An order ahead of the one predicted for, in rank order."""

    bid: float
    leaves_in: float = math.inf
    """Seconds from now until it leaves the book unadmitted (its timeout); inf: unknown."""
    weight: float = 1.0
    """How many orders it stands for."""
    run_s: float | None = None
    """How long it holds the slot it takes (None: not known, the slot's mean run)."""


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
    *,
    if_started: bool = False,
    gives_up_per_s: float = 0.0,
    told: bool = True,
) -> float | None:
    """The predicted wait of an order at ``bid`` behind ``ahead`` (rank order: every
    one bids at least ``bid``), with ``above_per_s`` orders a second arriving later
    that bid more (they go before it): the **median** of its wait. The slots' frees are
    walked in time order; the orders ahead take them first (less those gone at their
    timeout); each free they leave over (``spare``) goes to an arrival above if one is
    waiting, else to this order. It has started by the ``k``-th free left over at
    ``t`` when at most ``k - 1`` arrived above by ``t``: a Poisson count of mean
    ``above_per_s * t`` (:func:`poisson_cdf`), so the wait is the first free at which
    that chance reaches one half (a short wait is not lengthened by an arrival above
    that is less likely than not to come).

    ``if_started``: ``horizon_s`` is its timeout, and the wait is told from the waits
    it may have *if it starts* before then: an order that will likely time out starts,
    if it does, in a lull of the arrivals above. The chance of starting at each free
    left over is then followed exactly (:class:`~bourse.domain.forecast_starts.Starts`:
    the bound above misses the orders that started at an earlier free and would have
    been passed later), and the wait told is their median (the first free at which the
    chance reaches half the chance of starting at all) or a wait that catches more of
    them within a factor of two (:func:`~bourse.domain.forecast_starts.within_2x_point`).
    Else None when that chance does not reach one half within ``horizon_s``.

    ``told``: false, the median of the waits if it starts, not the wait told
    (for the quotes' margin, :attr:`~bourse.domain.forecast_score.Score.margin`).

    ``gives_up_per_s``: each order ahead is still there at ``t`` with the chance
    ``exp(-gives_up_per_s * t)`` (clients that give up before their timeout,
    :class:`GiveUps`): it weighs that much then."""
    heap = [(s.at, s.floor, s.run_s) for s in slots]
    pace = sum(1.0 / r for _, f, r in heap if f <= bid and r > 0)  # frees a second of its slots
    if not any(f <= bid for _, f, _ in heap):
        return None
    heapq.heapify(heap)
    left = [a.weight for a in ahead]
    leaves = [(a.leaves_in, i) for i, a in enumerate(ahead) if a.leaves_in < math.inf]
    heapq.heapify(leaves)
    head = 0
    spare = 0.0
    best = 0.0
    seen: list[tuple[float, float]] = []  # (t, chance it started by t)
    half = -1.0  # the median wait, once walked to
    frees_at_most = 2.0 * pace * horizon_s + len(heap) + 2  # in the walk, with runs shorter than the mean
    starts = Starts(above_per_s, int(min(frees_at_most, MAX_EVENTS))) if if_started else None
    for _ in range(MAX_EVENTS):
        t, floor, run = heapq.heappop(heap)
        if t > horizon_s:
            break
        while leaves and leaves[0][0] < t:  # gone unadmitted before this free
            left[heapq.heappop(leaves)[1]] = 0.0
        while head < len(left) and left[head] <= 1e-9:
            head += 1
        decay = math.exp(-gives_up_per_s * t)
        if floor > bid:  # a dearer slot: an order ahead that bids enough for it takes it
            _, _, held = _take(left, ahead, head, 1.0, floor, decay, run)
            heapq.heappush(heap, (t + held if run > 0 else math.inf, floor, run))
            continue
        unit, _, held = _take(left, ahead, head, 1.0, bid, decay, run)  # the orders ahead, in rank order
        heapq.heappush(heap, (t + held if run > 0 else math.inf, floor, run))
        if unit <= 1e-9:
            continue
        spare += unit
        room = math.floor(spare + 0.5 + 1e-9) - 1  # arrivals above it may have had by now
        mean = above_per_s * t
        chance = _chance(starts, best, room, mean, t, len(seen))
        if chance is None:
            continue
        best = chance
        seen.append((t, best))
        half = (
            t if half < 0 <= best - 0.5 else half
        )  # the first free by which it starts with a chance of one half
        if _walked(t, best, half, if_started) or (
            above_per_s >= pace and room < mean - 6.0 * math.sqrt(mean) - 2.0
        ):
            break  # known well enough, or the arrivals above take every free from here on
    if not seen or best <= 1e-12:
        return None
    target = 0.5 * best if if_started else 0.5
    median = next((t for t, p in seen if p >= target - 1e-12), None)
    if not if_started or median is None or not told:
        return median
    return within_2x_point(seen, median)


def _chance(starts: Starts | None, best: float, room: int, mean: float, t: float, frees: int) -> float | None:
    """The chance an order has started by ``t`` in the walk of :func:`wait_s`, ``room``
    arrivals above a Poisson count of ``mean`` may have had by then (``frees``: the
    frees walked so far): the bound (the best chance so far that no more arrived), or
    (``starts``) its chance exactly. None: no new free for it."""
    if room < 0:
        return None
    if starts is None:
        return max(best, poisson_cdf(room, mean))
    return starts.free(t) if room + 1 > frees else None


def _walked(t: float, best: float, half: float, if_started: bool) -> bool:
    """Whether the walk of :func:`wait_s` (at ``t``, a start by then with the chance
    ``best``, the median wait ``half``, -1 before it) has gone far enough: to the
    median wait, or (``if_started``) to a start with the chance :data:`SURE`, or to 4
    times the median wait."""
    if best >= SURE:
        return True
    if half < 0:
        return False
    return not if_started or t > 4 * half


def poisson_cdf(k: int, mean: float) -> float:
    """P(N <= k) for N Poisson of ``mean`` (a normal approximation over a mean of
    :data:`EXACT_POISSON_MEAN`)."""
    if k < 0:
        return 0.0
    if mean <= 0.0:
        return 1.0
    sd = math.sqrt(mean)
    if k > mean + 12.0 * sd + 10.0:
        return 1.0
    if mean > EXACT_POISSON_MEAN:
        return 0.5 * math.erfc((mean - k - 0.5) / (sd * math.sqrt(2.0)))
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return min(1.0, total)


def _take(
    left: list[float],
    ahead: Sequence[Ahead],
    i: int,
    unit: float,
    bid: float,
    decay: float = 1.0,
    run: float = 0.0,
) -> tuple[float, int, float]:
    """One free (``unit`` of it) taken by the orders ahead from ``i`` on that bid
    ``bid`` or more, each weighing ``left[i] * decay`` now; what is left of it, where
    they stop, and how long the slot is held next: the takers' runs
    (:attr:`Ahead.run_s`, ``run`` where not known) and ``run`` for what is left,
    weighted by their shares of the free."""
    held, whole = 0.0, unit
    while unit > 1e-9 and i < len(left) and ahead[i].bid >= bid:
        have = left[i] * decay
        take = min(unit, have)
        unit -= take
        r = ahead[i].run_s
        held += take * (run if r is None else r)
        if have - take <= 1e-9:
            left[i] = 0.0
            i += 1
        else:
            left[i] -= take / decay
    return unit, i, (held + unit * run) / whole if whole > 0 else run
