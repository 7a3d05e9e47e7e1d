"""The wait forecast of one product as this replica keeps it (issue 38, items 1 and
2): the book's history it is fed (its orders' arrivals, waits and runs), its orders
waiting and running, the predictions (:mod:`bourse.domain.forecast`), their score
(:mod:`bourse.domain.forecast_score`) and the quotes (:mod:`bourse.domain.market_quote`).

No I/O and no clock of its own: :class:`~bourse.services.market.Market` calls it at
each step of an order (entering, resting, admitted, released, requeued, gone) with the
loop's time, and passes the book's state in (:class:`BookState`).

With the book in process every order of the product passes through here: the orders
ahead, their timeouts, the slots in use and how long each has run are all known. With
the shared book (Redis) a replica knows its own orders only, and reads the rest from
the book's view (at most :data:`~bourse.services.market_outlook.VIEW_FRESH_S` old; when
an order rests, at most :data:`~bourse.services.market_outlook.WAIT_VIEW_FRESH_S`, so its
scored prediction has the slots as they are): the slots in use, the
orders holding them, the bids waiting and the recent admissions' times. Its own
orders ahead stand for the other replicas' (their timeouts), the other replicas'
running orders are the view's, with their output caps, each admitted when the
view's recent admissions say, and the rate of arrivals is its own scaled by the book's
admissions over its own. Its runs seen are its own, as are the give-ups it counts.
The score is of its own orders.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace

from sortedcontainers import SortedKeyList

from bourse.domain.book import Order
from bourse.domain.forecast import (
    HORIZON_S,
    Ahead,
    ArrivalHistory,
    GiveUps,
    RunHistory,
    RunModel,
    SlotFree,
    frees,
    wait_s,
)
from bourse.domain.forecast_score import Score, WaitScore
from bourse.domain.market_quote import Quote, candidate_bids, lowest_bid
from bourse.domain.values import immutable
from bourse.ports.book import BookView

MIN_RUNNING_S = 0.25
"""Before any run has ended, the runs are guessed from the orders running this long."""
QUOTE_HORIZON_S = 120.0
"""A quote predicts no wait past this, or four times the wait asked about."""
STALE_AFTER_S = 3600.0
"""A waiting order kept past its timeout by this long was lost track of: forgotten."""


@immutable
class SlotState:
    """One deployment as the forecast reads it now."""

    name: str
    floor: float
    slots: int
    busy: int
    usable: bool
    """Takes orders now (available, breaker not open)."""


@immutable
class BookState:
    """The book now: its deployments, and (shared book) its last view."""

    deployments: tuple[SlotState, ...]
    view: BookView | None = None
    """The shared book's last view (None: the book is in this process, known exactly)."""


@dataclass(slots=True, eq=False)
class _Waiting:
    order: Order
    entered: float
    deadline: float | None
    cap: int | None
    predicted: float | None = None
    median: float | None = None
    """The median of the waits predicted as it rested, where it was told another."""
    scored: bool = False
    """Rested in the book at its entry: its wait is scored when it is admitted."""
    resting: bool = False
    """In ``_ranked`` (an order admitted at once never is: it costs no more than this)."""

    def rank(self) -> tuple[float, int]:
        return (-self.order.bid, self.order.seq)


@dataclass(slots=True)
class _Running:
    deployment: str
    since: float
    wall: float
    cap: int | None


@dataclass(slots=True)
class Forecaster:
    """One product's forecast on this replica."""

    default_cap: int
    """The output cap of an order that names none (the product's ``max_output_tokens``)."""
    runs: RunHistory = field(default_factory=RunHistory)
    arrivals: ArrivalHistory = field(default_factory=ArrivalHistory)
    scores: WaitScore = field(default_factory=WaitScore)
    give_ups: GiveUps = field(default_factory=GiveUps)
    _waiting: dict[str, _Waiting] = field(default_factory=dict)
    _ranked: SortedKeyList[_Waiting, tuple[float, int]] = field(
        default_factory=lambda: SortedKeyList(key=_Waiting.rank)
    )
    _running: dict[str, _Running] = field(default_factory=dict)
    _admissions: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    """This replica's recent admissions (wall time), against the shared book's."""
    _swept: float = -math.inf

    # -- an order's steps -----------------------------------------------------------

    def entering(self, order: Order, now: float, deadline: float | None, cap: int | None) -> None:
        """``order`` arrives (before the book has it): counted in the arrivals."""
        self.arrivals.add(now, order.bid)
        self._waiting[order.id] = _Waiting(order, order.arrived_at, deadline, cap)
        if now - self._swept > 60.0:
            self._sweep(now)

    def rested(self, order: Order, now: float, state: BookState) -> float | None:
        """``order`` rests in the book (not admitted at once): its wait predicted at its
        place (``order.position_at_entry``), kept for its score, and returned."""
        w = self._waiting.get(order.id)
        if w is None:
            return None
        if not w.resting:
            self.give_ups.waiting(now, len(self._ranked))
            self._ranked.add(w)
            w.resting = True
        w.predicted = self.predict(order, order.position_at_entry, now, state)
        w.median = self.predict(order, order.position_at_entry, now, state, told=False)
        w.scored = True
        return w.predicted

    def admitted(self, order: Order, deployment: str, now: float) -> None:
        """``order`` got a slot on ``deployment`` (at once, or after waiting)."""
        w = self._waiting.pop(order.id, None)
        if w is None:
            return
        if w.resting:
            self.give_ups.waiting(now, len(self._ranked))
            self._ranked.discard(w)
            w.resting = False
            if w.scored:
                self.scores.add(now, w.predicted, now - w.entered, w.median)
                w.scored = False
        wall = time.time()
        self._running[order.id] = _Running(deployment, now, wall, w.cap)
        self._admissions.append(wall)

    def released(self, order_id: str, now: float) -> None:
        """The slot of ``order_id`` came back: its run is seen."""
        r = self._running.pop(order_id, None)
        if r is not None:
            self.runs.add(r.deployment, r.cap, now - r.since, default_cap=self.default_cap)

    def requeued(self, order: Order) -> None:
        """Its engine failed before any output: its slot goes back (no run to learn
        from) and it waits again in its place (its wait was scored already)."""
        r = self._running.pop(order.id, None)
        cap = None if r is None else r.cap
        w = self._waiting.get(order.id)
        if w is None:
            w = self._waiting[order.id] = _Waiting(order, order.arrived_at, None, cap)
        if w.resting:
            self._ranked.discard(w)
        self._ranked.add(w)
        w.resting = True

    def rebid(self, order: Order, bid: float, *, was: float | None = None) -> None:
        """``order``'s bid is ``bid`` from now on (a deadline order raised): call this in
        place of setting ``order.bid`` while it waits (its place here is by its bid), or
        right after the book set it, with ``was`` the bid it had (it is found by that)."""
        w = self._waiting.get(order.id)
        if was is not None:
            order.bid = was  # at once, no await: the book's own ranking is not read meanwhile
        if w is None or not w.resting:
            order.bid = bid
            return
        self._ranked.remove(w)
        order.bid = bid
        self._ranked.add(w)

    def gone(self, order: Order, now: float | None = None, *, gave_up: bool = False) -> None:
        """``order`` left the book unadmitted (timeout, its client left: ``gave_up``), or
        its slot was given back without a run. ``now``: when (None: not counted in the
        rate at which waiting orders give up)."""
        w = self._waiting.pop(order.id, None)
        if w is not None and w.resting:
            if now is not None:
                self.give_ups.waiting(now, len(self._ranked))
                if gave_up:
                    self.give_ups.gave_up()
            self._ranked.discard(w)
            w.resting = False
        self._running.pop(order.id, None)

    def _sweep(self, now: float) -> None:
        self._swept = now
        for w in list(self._waiting.values()):
            if w.deadline is not None and now > w.deadline + STALE_AFTER_S:
                self.gone(w.order)

    # -- predictions ---------------------------------------------------------------

    def predict(
        self, order: Order, position: int, now: float, state: BookState, *, told: bool = True
    ) -> float | None:
        """The predicted wait of ``order``, waiting with ``position`` orders ahead: the
        wait told from the waits it may have if it starts before its timeout
        (:func:`~bourse.domain.forecast.wait_s` with ``if_started``; ``told`` false:
        their median); when it has almost no chance to (more arrive above it than the
        slots take), its wait in a lull of the arrivals above (none arriving), the only
        way it can start."""
        if position < 0:
            return None
        w = self._waiting.get(order.id)
        if w is not None and w.resting:
            known = list(self._ranked.islice(0, self._ranked.index(w)))
        else:
            known = self._known_at(order.bid, now, exclude=order)
        horizon = HORIZON_S if w is None or w.deadline is None else max(0.0, w.deadline - now)
        state = _resting(state, order.bid)
        wait = self._wait(
            order.bid, position, known, now, state, horizon, if_started=w is not None, told=told
        )
        if wait is not None or w is None:
            return wait
        return self._wait(order.bid, position, known, now, state, HORIZON_S, above=0.0)

    def wait_at(
        self,
        bid: float,
        now: float,
        state: BookState,
        exclude: Order | None = None,
        horizon: float = HORIZON_S,
        *,
        steady: bool = False,
    ) -> float | None:
        """The predicted wait of a new order at ``bid`` (behind the orders at ``bid``);
        None when no slot comes to it within ``horizon``. ``steady``: the arrivals above
        it at their mean rate over the recent minutes, not the newest ones' (a burst
        passes; :meth:`~bourse.domain.forecast.ArrivalHistory.rate_above`)."""
        known = self._known_at(bid, now, exclude)
        if state.view is None:
            position = len(known)
        else:
            position = sum(1 for b in state.view.bids if b >= bid)
            if exclude is not None and exclude.id in self._waiting and exclude.bid >= bid:
                position = max(0, position - 1)
        return self._wait(bid, position, known, now, state, horizon, steady=steady)

    def _known_at(self, bid: float, now: float, exclude: Order | None) -> list[_Waiting]:
        """This replica's waiting orders a new order at ``bid`` would have ahead."""
        end = self._ranked.bisect_key_right((-bid, sys.maxsize))
        return [w for w in self._ranked.islice(0, end) if exclude is None or w.order is not exclude]

    def _wait(
        self,
        bid: float,
        position: int,
        known: list[_Waiting],
        now: float,
        state: BookState,
        horizon: float,
        *,
        above: float = 1.0,
        if_started: bool = False,
        steady: bool = False,
        told: bool = True,
    ) -> float | None:
        if position <= 0 and any(d.usable and d.floor <= bid and d.busy < d.slots for d in state.deployments):
            return 0.0  # a slot is free for it
        slots = self._slots(state, now)
        if slots is None:
            return None
        ahead = self._ahead(bid, position, known, now, state)
        scale = 1.0 if state.view is None else self._scale(state.view)
        rate = self.arrivals.rate_above(bid, now, scale, steady=steady) * above
        return wait_s(
            bid,
            slots,
            ahead,
            rate,
            horizon,
            if_started=if_started,
            gives_up_per_s=self.give_ups.per_s(),
            told=told,
        )

    def _ahead(
        self, bid: float, position: int, known: list[_Waiting], now: float, state: BookState
    ) -> list[Ahead]:
        if position <= 0:
            return []
        if known:
            weight = position / len(known)
            model = self.runs.model()
            return [
                Ahead(
                    w.order.bid,
                    math.inf if w.deadline is None else w.deadline - now,
                    weight,
                    # its run, where it stands for itself only (the others' caps are not known)
                    None if model is None or weight > 1.0 else model.total(w.cap or self.default_cap),
                )
                for w in known
            ]
        bids = [b for b in state.view.bids if b >= bid][:position] if state.view is not None else []
        bids += [bid] * (position - len(bids))
        return [Ahead(b) for b in bids]

    def _scale(self, view: BookView) -> float:
        """How many of the shared book's arrivals each of this replica's stands for:
        the book's recent admissions over this replica's in the same span."""
        if len(view.recent) < 2:
            return 1.0
        since = view.recent[-1].at
        own = sum(1 for t in self._admissions if t >= since)
        return max(1.0, len(view.recent) / own) if own else 1.0

    def _slots(self, state: BookState, now: float) -> list[SlotFree] | None:
        """When each slot of the deployments taking orders frees next; None before any
        run was seen or has run :data:`MIN_RUNNING_S` (nothing to go by)."""
        prior = None
        if self.runs.model() is None:  # a first guess: each running order is halfway through
            running = [(r.cap or self.default_cap, 2 * (now - r.since)) for r in self._running.values()]
            running = [(c, s) for c, s in running if s >= 2 * MIN_RUNNING_S]
            if not running:
                return None
            prior = RunModel.fit(running)
        wall = time.time()
        out: list[SlotFree] = []
        for d in state.deployments:
            if not d.usable:
                continue
            model = prior or self.runs.model(d.name)
            assert model is not None
            own = [r for r in self._running.values() if r.deployment == d.name]
            spreads = [model.spread(r.cap, now - r.since) for r in own]
            others = max(0, d.busy - len(own))
            if others:
                for since, cap in _others_since(state.view, d.name, self._running, others):
                    spreads.append(model.spread(cap, None if since is None else max(0.0, wall - since)))
            lefts = frees(spreads)
            excess = max(0, len(lefts) - d.slots)  # slots in use above ``slots``: given back, not out
            ats = [0.0] * max(0, d.slots - len(lefts)) + lefts[excess:]
            out += [SlotFree(d.floor, at, model.mean) for at in ats]
        return out

    # -- scores and quotes ---------------------------------------------------------------

    def score(self, now: float) -> Score:
        return self.scores.score(now)

    def quote(
        self,
        within_s: float,
        now: float,
        state: BookState,
        exclude: Order | None = None,
        *,
        steady: bool = False,
    ) -> Quote:
        """The lowest bid whose predicted wait, stretched by the score's margin (how much
        longer than predicted the recent waits were, :attr:`~bourse.domain.forecast_score.Score.margin`),
        is ``within_s`` or less; its wait as predicted (not stretched). ``steady``: the
        arrivals above at their mean rate (:meth:`wait_at`) and the wait not stretched:
        the bid a deadline order tries while it has time to spare (it keeps a reserve
        for its ceiling of its own, :mod:`bourse.services.deadline`)."""
        floors = [d.floor for d in state.deployments if d.usable]
        if state.view is not None:
            bids: list[float] = state.view.bids
        else:
            bids = [w.order.bid for w in self._ranked if w.order is not exclude]
        horizon = max(QUOTE_HORIZON_S, 4 * within_s)
        margin = 1.0 if steady else self.scores.score(now).margin
        q = lowest_bid(
            candidate_bids(floors, bids),
            lambda b: self.wait_at(b, now, state, exclude, horizon, steady=steady),
            within_s / margin,
        )
        return replace(q, within_s=within_s)


def _resting(state: BookState, bid: float) -> BookState:
    """The book as an order resting at ``bid`` knows it: no slot it may take is free (it
    would have been admitted), whatever a view read a moment ago said."""
    deps = tuple(
        replace(d, busy=max(d.busy, d.slots)) if d.usable and d.floor <= bid else d for d in state.deployments
    )
    return replace(state, deployments=deps)


def _others_since(
    view: BookView | None, deployment: str, own: dict[str, _Running], n: int
) -> list[tuple[float | None, int | None]]:
    """When the ``n`` orders other replicas run on ``deployment`` were admitted (wall
    time) and their output caps (None: not known): the orders holding a slot there in
    the shared book's view (:attr:`~bourse.ports.book.BookView.running`, with their caps)
    that are not this replica's, each admitted when the view's newest admission of it
    says (the rest, taken since the view was read, not known); where the view does not
    say (an older book), the newest admissions there less the ones nearest this
    replica's own."""
    unknown: tuple[float | None, int | None] = (None, None)
    if view is None:
        return [unknown] * n
    if view.running is not None:
        admitted: dict[str, float] = {}
        for c in reversed(view.recent):  # oldest first: the newest admission of each order wins
            admitted[c.order_id] = c.at
        held = [
            (admitted.get(oid), cap) for oid, dep, cap in view.running if dep == deployment and oid not in own
        ]
        held.sort(key=lambda h: -math.inf if h[0] is None else -h[0])  # newest first, unknown last
        return (held + [unknown] * n)[:n]
    times = [c.at for c in view.recent if c.deployment == deployment]  # newest first
    for r in own.values():
        if r.deployment != deployment:
            continue
        if times:
            nearest = min(range(len(times)), key=lambda i: abs(times[i] - r.wall))
            if abs(times[nearest] - r.wall) < 0.5:
                del times[nearest]
    out: list[tuple[float | None, int | None]] = [(t, None) for t in times[:n]]
    return out + [unknown] * (n - len(out))
