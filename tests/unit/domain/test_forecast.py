"""The wait forecast (issue 38, item 1): deterministic books whose waits are known,
and the forecast of one product fed an order's steps (:mod:`bourse.domain.forecast`,
:mod:`bourse.services.market_forecast`)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest

from bourse.domain.book import Order, expected_wait_s
from bourse.domain.forecast import (
    Ahead,
    ArrivalHistory,
    GiveUps,
    RunHistory,
    RunModel,
    SlotFree,
    frees,
    poisson_cdf,
    wait_s,
)
from bourse.domain.forecast_starts import Starts, within_2x_point
from bourse.ports.book import BookView, Clear, DeploymentView
from bourse.services.market_forecast import BookState, Forecaster, SlotState

TWO_S = [(100.0, 2.0)] * 10
"""Ten runs of 2 s, each of an order capped at 100 tokens."""


def test_one_slot_with_known_runs_gives_the_known_wait() -> None:
    model = RunModel.fit(TWO_S)
    assert model.total(100) == pytest.approx(2.0) and model.mean == pytest.approx(2.0)
    left = model.left(100, 0.5)  # has run 0.5 s of its 2
    assert left == pytest.approx(1.5)
    slot = SlotFree(0.1, left, model.mean)
    # two ahead: the slot frees at 1.5 (the first), 3.5 (the second), 5.5 (this one)
    assert wait_s(1.0, [slot], [Ahead(1.0), Ahead(1.0)]) == pytest.approx(5.5)
    assert wait_s(1.0, [slot], []) == pytest.approx(1.5)


def test_position_zero_with_a_slot_about_to_free_waits_little() -> None:
    """Issue 38: ``wait_s=15.08`` at position 0 on a one-slot product. The pace of the
    last admissions (two over 30 s: a quiet book, then a long run) said 15 s; the
    run in the slot has 0.1 s left of the 2 s runs seen, so the wait is 0.1 s."""
    assert expected_wait_s(0, 2, 30.16) == pytest.approx(15.08)  # the naive estimate
    model = RunModel.fit(TWO_S)
    slot = SlotFree(0.1, model.left(100, 1.9), model.mean)
    assert wait_s(1.0, [slot], []) == pytest.approx(0.1)


def test_the_runs_are_fitted_against_the_output_cap() -> None:
    runs = [(20.0, 1.0), (60.0, 3.0)] * 5  # 20 tokens/s
    model = RunModel.fit(runs)
    assert model.total(40) == pytest.approx(2.0)
    assert model.left(60, 1.0) == pytest.approx(2.0)
    assert model.left(20, 0.5) == pytest.approx(0.5)
    assert model.left(None, 2.0) == pytest.approx(1.0)  # cap unknown: the runs as seen, longer than 2 s
    assert model.left(20, 5.0) == pytest.approx(0.1)  # longer than any run like it: soon over
    # found running at a random instant: E[R^2] / 2E[R] = (1 + 9) / 2 / (2 * 2)
    assert model.left(None, None) == pytest.approx(1.25)


def test_the_first_of_several_uncertain_runs_ends_sooner_than_each_is_expected_to() -> None:
    model = RunModel.fit(TWO_S)
    assert model.spread(100, 0.5) == [pytest.approx(1.5)] * 16  # known runs: no spread
    assert frees([model.spread(100, 0.5), model.spread(100, 1.5)]) == [pytest.approx(0.5), pytest.approx(1.5)]
    # runs of 1 to 3 s, caps unknown (another replica's), both just started: each is
    # expected to end in 2 s, the first of the two in about 1.5 and the second in 2.5
    spread = RunModel.fit([(0.0, 1.0 + i / 50) for i in range(101)])
    first, second = frees([spread.spread(None, 0.0), spread.spread(None, 0.0)])
    assert spread.left(None, 0.0) == pytest.approx(2.0)
    assert first == pytest.approx(1.5, abs=0.1) and second == pytest.approx(2.5, abs=0.1)
    assert frees([]) == []


def test_a_dearer_deployment_takes_the_orders_ahead_that_bid_enough_for_it() -> None:
    cheap = SlotFree(0.1, 1.0, 2.0)
    dear = SlotFree(1.0, 0.2, 2.0)
    # the order at 2.0 ahead takes the dear slot at 0.2; the cheap one at 1.0 is this order's
    assert wait_s(0.5, [cheap, dear], [Ahead(2.0)]) == pytest.approx(1.0)
    # an order at 0.5 cannot take the dear slot: alone, the cheap slot's second free
    assert wait_s(0.5, [cheap], [Ahead(2.0)]) == pytest.approx(3.0)
    # no deployment at its bid: no wait predicted
    assert wait_s(0.05, [cheap, dear], []) is None


def test_an_order_ahead_that_times_out_first_does_not_delay_it() -> None:
    slot = SlotFree(0.1, 1.0, 2.0)
    assert wait_s(1.0, [slot], [Ahead(1.0, leaves_in=0.5)]) == pytest.approx(1.0)
    assert wait_s(1.0, [slot], [Ahead(1.0, leaves_in=1.5)]) == pytest.approx(3.0)


def test_arrivals_above_go_first_and_can_take_every_slot() -> None:
    """The wait is the median: the first free by which at most as many arrived above
    as the frees left over, with a chance of one half (a Poisson count)."""
    slot = SlotFree(0.1, 1.0, 1.0)  # frees every second
    # P(no arrival above in 1 s) = exp(-0.2) = 0.82: the first free
    assert wait_s(0.5, [slot], [], above_per_s=0.2) == pytest.approx(1.0)
    # exp(-0.7) = 0.497 < 1/2 at 1 s; P(N(2) <= 1) = exp(-1.4) * 2.4 = 0.59 at 2 s
    assert wait_s(0.5, [slot], [], above_per_s=0.7) == pytest.approx(2.0)
    # at 0.9 a second: P(N(3) <= 2) = 0.49, P(N(3.6) <= 3) = 0.52 at 4 s
    assert wait_s(0.5, [slot], [], above_per_s=0.9) == pytest.approx(4.0)
    assert wait_s(0.5, [slot], [], above_per_s=1.5) is None  # more arrive above than the slot takes
    assert wait_s(0.5, [slot], [], above_per_s=0.9, horizon_s=3.5) is None
    # the order ahead at its bid takes the first free; then P(N(2) <= 0) = 0.30,
    # P(N(3) <= 1) = 0.46, P(N(4) <= 2) = 0.57
    assert wait_s(0.5, [slot], [Ahead(0.5)], above_per_s=0.6) == pytest.approx(4.0)


def test_a_short_wait_is_not_lengthened_by_an_arrival_above_less_likely_than_not() -> None:
    """Issue 38: counted in expectation, 0.6 arrivals above in the 1 s to the first
    free pushed the wait to the second free; one arrives there with a chance of
    1 - exp(-0.6) = 0.45, so half the orders start at the first."""
    slot = SlotFree(0.1, 1.0, 1.0)
    assert wait_s(0.5, [slot], [], above_per_s=0.6) == pytest.approx(1.0)
    # exp(-0.75) = 0.47 at 1 s; P(N(2) <= 1) = exp(-1.5) * 2.5 = 0.56 at 2 s
    assert wait_s(0.5, [slot], [], above_per_s=0.75) == pytest.approx(2.0)


def test_the_wait_if_it_starts_is_the_median_of_the_waits_before_its_timeout() -> None:
    """An order likely to time out (its chance to start by then under one half) is
    told the median of the waits it has if it does start: the first free by which
    the chance reaches half the chance of starting at all."""
    slot = SlotFree(0.1, 0.5, 1.0)  # frees at 0.5, 1.5, 2.5
    # 2 a second above: P(started by 0.5) = exp(-1) = 0.37, later frees no better
    assert wait_s(0.5, [slot], [], above_per_s=2.0, horizon_s=3.0) is None
    assert wait_s(0.5, [slot], [], above_per_s=2.0, horizon_s=3.0, if_started=True) == pytest.approx(0.5)
    # 0.6 a second: 0.74 by 0.5, more later: the median of the waits before 3 s is 0.5
    assert wait_s(0.5, [slot], [], above_per_s=0.6, horizon_s=3.0, if_started=True) == pytest.approx(0.5)
    # one ahead: P(N(1.5) <= 0) = 0.41, P(N(2.5) <= 1) = 0.56 by 3 s: half of it by 1.5
    assert wait_s(0.5, [slot], [Ahead(0.5)], above_per_s=0.6, horizon_s=3.0) == pytest.approx(2.5)
    assert wait_s(
        0.5, [slot], [Ahead(0.5)], above_per_s=0.6, horizon_s=3.0, if_started=True
    ) == pytest.approx(1.5)


def test_the_wait_told_catches_most_waits_within_2x_not_the_median_between_two_groups() -> None:
    """Issue 38: the score counts a wait told within a factor of two of the wait had.
    When the waits an order may have fall apart (started at the next free, or only
    after the arrivals above took several), the median between them may be near few:
    here 4 s catches the 0.04 at 4 s and the 0.18 at 8 s, while the waits from 5.4 to
    6.67 s catch 4, 8 and 9 s (0.52) with room to spare (each wait's window narrowed by
    :data:`~bourse.domain.forecast_starts.EDGE` at each end: 1.2 * 9 / 2 = 5.4,
    2 * 4 / 1.2 = 6.67), more than 1 catches (0.48 at 1 and 1.2 s); of those, the
    nearest the median, 5.4."""
    seen = [(1.0, 0.3), (1.2, 0.48), (4.0, 0.52), (8.0, 0.7), (9.0, 1.0)]
    assert within_2x_point(seen, 4.0) == pytest.approx(5.4)
    # the median catches as much as any other wait, or nearly: it stays
    assert within_2x_point([(1.0, 0.5), (1.5, 0.9), (10.0, 1.0)], 1.0) == pytest.approx(1.0)
    assert within_2x_point([(1.0, 0.4), (1.5, 0.5), (2.5, 0.9), (10.0, 1.0)], 1.5) == pytest.approx(1.5)


def test_a_wait_told_is_not_at_the_very_end_of_its_window() -> None:
    """Issue 38: the slots free when predicted to within a few hundredths of a second,
    so an order's waits are a few times known closely. Starting at 0.5 s (0.55) or at
    2 s (0.45), a wait of 1 s catches both within a factor of two, but only at the
    very ends of its window (a start at 0.49 s or 2.01 s, and it catches one): the
    order is told 0.5 s, which catches the likelier with room to spare. A wait that
    is sure is told itself, whatever gain is asked (it was told half of it)."""
    assert within_2x_point([(0.5, 0.55), (2.0, 1.0)], 0.5) == pytest.approx(0.5)
    assert within_2x_point([(1.0, 1.0)], 1.0, gain=0.0) == pytest.approx(1.0)
    # two starts close enough: the wait nearest the median that catches both with room
    assert within_2x_point([(0.5, 0.55), (1.2, 1.0)], 0.5) == pytest.approx(0.72)


def test_the_chance_of_starting_counts_each_free_it_may_start_at() -> None:
    """Issue 38: an order starts at the first free left over at which no arrival above
    it is waiting. One free a second, an arrival above a second: it starts at 1 s with
    the chance exp(-1) = 0.37; at 2 s when one arrived by 1 s (it took that free) and
    none after: 0.37 * 0.37 more, 0.50 by 2 s; and so on, towards 1. The chance that at
    most ``k - 1`` arrived by the ``k``-th free (0.41 at 2 s, 0.46 by 10 s) misses the
    orders that started earlier and would have been passed by later arrivals."""
    starts = Starts(1.0)
    by = [starts.free(float(t)) for t in range(1, 11)]
    assert by[0] == pytest.approx(math.exp(-1.0))
    assert by[1] == pytest.approx(math.exp(-1.0) * (1 + math.exp(-1.0)))
    assert by[9] == pytest.approx(0.7545, abs=1e-4)
    assert poisson_cdf(9, 10.0) == pytest.approx(0.4579, abs=1e-4)
    assert Starts(0.0).free(0.3) == 1.0


def test_an_order_told_its_wait_if_it_starts_is_told_the_wait_most_within_2x() -> None:
    """One slot freeing at 0.2 s and every 1 s after, one order ahead (it takes the
    first), half an arrival above a second: it starts at 1.2 s with the chance
    exp(-0.6) = 0.55, else by 2.2 s (0.75), 3.2 s (0.85), ... (:class:`Starts`). The
    median of its waits if it starts is 1.2 s, whose window (narrowed: 0.72 to 2 s)
    catches 0.55 of it; 1.92 to 2 s catch the starts at 1.2, 2.2 and 3.2 s, more by
    over :data:`~bourse.domain.forecast_starts.WINDOW_GAIN`: 1.92, the nearest the
    median. A wait asked for a new order (a quote, not ``if_started``) stays the
    median."""
    slot = SlotFree(0.1, 0.2, 1.0)
    assert wait_s(0.5, [slot], [Ahead(0.5)], 0.5, 10.0) == pytest.approx(1.2)
    assert wait_s(0.5, [slot], [Ahead(0.5)], 0.5, 10.0, if_started=True) == pytest.approx(1.92)


def test_an_order_as_likely_to_be_passed_as_not_is_told_a_wait_between_its_likely_starts() -> None:
    """Issue 38: the orders at the head of the book with high bids missed most: whether
    an arrival above comes before the next free is near a coin flip. One free a
    second, an arrival above a second: it starts at 1 s (0.37), 2 s (0.50 by then),
    3 s (0.58), ... (:class:`Starts`); told 1.67 s, it is within 2x of the starts at
    1 and 2 s with room to spare (0.50 of its chance). The old walk, from its bound of
    the chance (0.37 at 1 s, barely more later), told it 1 s."""
    slot = SlotFree(0.1, 1.0, 1.0)
    assert wait_s(0.5, [slot], [], 1.0, 10.0, if_started=True) == pytest.approx(5 / 3)


def test_a_slot_taken_by_an_order_ahead_is_held_for_that_orders_run() -> None:
    """Issue 38: the slot the order ahead takes frees when its run ends (its output
    cap known: 0.5 s here, or 3 s), not a mean run (2 s) after it took it."""
    slot = SlotFree(0.1, 1.0, 2.0)
    assert wait_s(0.5, [slot], [Ahead(0.5)]) == pytest.approx(3.0)
    assert wait_s(0.5, [slot], [Ahead(0.5, run_s=0.5)]) == pytest.approx(1.5)
    assert wait_s(0.5, [slot], [Ahead(0.5, run_s=3.0), Ahead(0.5, run_s=0.5)]) == pytest.approx(4.5)
    # a dearer slot taken by an order ahead that bids enough for it is held as long:
    # here it frees again at 0.3 for the second, and the slot at 1 s is this order's
    dear = SlotFree(0.8, 0.2, 2.0)
    assert wait_s(0.5, [dear, slot], [Ahead(0.9)] * 2) == pytest.approx(3.0)
    assert wait_s(0.5, [dear, slot], [Ahead(0.9, run_s=0.1)] * 2) == pytest.approx(1.0)


def test_poisson_cdf() -> None:
    assert poisson_cdf(-1, 1.0) == 0.0
    assert poisson_cdf(0, 0.0) == 1.0
    assert poisson_cdf(0, 1.0) == pytest.approx(math.exp(-1.0))
    assert poisson_cdf(2, 1.5) == pytest.approx(math.exp(-1.5) * (1 + 1.5 + 1.5**2 / 2))
    assert poisson_cdf(300, 300.0) == pytest.approx(0.515, abs=0.005)  # the normal approximation
    assert poisson_cdf(10_000, 3.0) == 1.0


def test_orders_ahead_that_may_give_up_weigh_less_as_time_passes() -> None:
    slot = SlotFree(0.1, 1.0, 1.0)  # frees at 1, 2, 3 ...
    ahead = [Ahead(1.0)] * 4
    assert wait_s(0.5, [slot], ahead) == pytest.approx(5.0)
    # each still there at t with the chance exp(-0.5 t): 0.61 at 1 s, 0.37 at 2 s, 0.22
    # at 3 s: the frees at 1 and 2 s take 1 and 0.87 of them, the one at 3 s is its
    assert wait_s(0.5, [slot], ahead, gives_up_per_s=0.5) == pytest.approx(3.0)
    assert wait_s(0.5, [slot], ahead, gives_up_per_s=1.0) == pytest.approx(2.0)


def test_the_rate_at_which_waiting_orders_give_up() -> None:
    g = GiveUps(window_s=1e9)  # no decay: plain sums
    assert g.per_s() == 0.0
    g.waiting(0.0, 0)
    g.waiting(10.0, 4)  # 4 orders waited 10 s: 40 order-seconds
    g.gave_up()
    g.gave_up()
    assert g.per_s() == pytest.approx(2 / 40)
    g.waiting(20.0, 0)  # none waiting: no more order-seconds
    assert g.per_s() == pytest.approx(2 / 40)


def test_the_rate_of_arrivals_above_a_bid_is_by_price() -> None:
    arrivals = ArrivalHistory()
    for i in range(40):  # 40 arrivals over 20 s: half at 1.0, half at 0.5
        arrivals.add(i * 0.5, 1.0 if i % 2 else 0.5)
    assert arrivals.rate_above(0.5, 20.0) == pytest.approx(1.0)
    assert arrivals.rate_above(0.4, 20.0) == pytest.approx(2.0)
    assert arrivals.rate_above(1.0, 20.0) == 0.0
    assert arrivals.rate_above(0.5, 20.0, scale=2.0) == pytest.approx(2.0)  # another replica's too


def test_the_runs_are_per_deployment_once_there_are_enough() -> None:
    runs = RunHistory()
    assert runs.model() is None
    for _ in range(5):
        runs.add("fast", 10, 1.0, default_cap=100)
    runs.add("slow", 10, 4.0, default_cap=100)
    fast, slow = runs.model("fast"), runs.model("slow")
    assert fast is not None and fast.mean == pytest.approx(1.0)
    assert slow is not None and slow.mean == pytest.approx(1.5)  # one run of its own: every deployment's


# -- the forecast of one product ------------------------------------------------------------


def _order(oid: str, bid: float, seq: int, at: float = 0.0) -> Order:
    return Order(id=oid, bid=bid, seq=seq, arrived_at=at)


def _state(busy: int, slots: int = 1, floor: float = 0.1) -> BookState:
    return BookState((SlotState("d", floor, slots, busy, True),))


def _fed(fc: Forecaster, runs: int = 10, run_s: float = 2.0) -> None:
    """``runs`` orders capped at 100 tokens, each holding the slot ``run_s``."""
    for i in range(runs):
        o = _order(f"past{i}", 1.0, i)
        fc.entering(o, 0.0, None, 100)
        fc.admitted(o, "d", 0.0)
        fc.released(o.id, run_s)


def test_the_forecast_predicts_from_the_slot_in_use_and_the_orders_ahead() -> None:
    fc = Forecaster(default_cap=256)
    _fed(fc)
    running = _order("run", 1.0, 100)
    fc.entering(running, 10.0, None, 100)
    fc.admitted(running, "d", 10.0)  # runs 10.0 .. 12.0
    first = _order("a", 1.0, 101, 10.5)
    fc.entering(first, 10.5, 10.5 + 60, 100)
    assert fc.rested(first, 10.5, _state(1)) == pytest.approx(1.5)
    second = _order("b", 1.0, 102, 11.0)
    second.position_at_entry = 1
    fc.entering(second, 11.0, 11.0 + 60, 100)
    assert fc.rested(second, 11.0, _state(1)) == pytest.approx(3.0)  # after a's run of 2 s
    assert fc.predict(second, 1, 11.5, _state(1)) == pytest.approx(2.5)
    # the running order ends at 12.0; a gets the slot; b is next
    fc.released(running.id, 12.0)
    fc.admitted(first, "d", 12.0)
    assert fc.predict(second, 0, 12.0, _state(1)) == pytest.approx(2.0)
    fc.released(first.id, 14.0)
    fc.admitted(second, "d", 14.0)
    score = fc.score(14.0)
    assert score.orders == 2 and score.within_2x == 1.0 and score.median_abs_error_s == pytest.approx(0.0)


def test_the_order_ahead_holds_the_slot_for_the_run_its_cap_predicts() -> None:
    """Runs of 1 s at a cap of 50 tokens and 3 s at 150 (2 s on average): the order
    ahead, capped at 50, holds the slot 1 s once it has it, not the mean 2 s."""
    fc = Forecaster(default_cap=256)
    for i in range(10):
        cap, run_s = (50, 1.0) if i % 2 else (150, 3.0)
        o = _order(f"past{i}", 1.0, i)
        fc.entering(o, 0.0, None, cap)
        fc.admitted(o, "d", 0.0)
        fc.released(o.id, run_s)
    running = _order("run", 1.0, 100)
    fc.entering(running, 10.0, None, 100)
    fc.admitted(running, "d", 10.0)  # runs 10.0 .. 12.0
    first = _order("a", 1.0, 101, 10.5)
    fc.entering(first, 10.5, 10.5 + 60, 50)
    assert fc.rested(first, 10.5, _state(1)) == pytest.approx(1.5)
    second = _order("b", 1.0, 102, 11.0)
    second.position_at_entry = 1
    fc.entering(second, 11.0, 11.0 + 60, 150)
    assert fc.rested(second, 11.0, _state(1)) == pytest.approx(2.0)  # 12.0, then a's 1 s


def test_an_order_ahead_that_stands_for_others_holds_a_slot_a_mean_run() -> None:
    """A shared book: this replica's order ahead (capped at 50 tokens: a 1 s run) stands
    for two, the other of a cap not known: the slots they take are held a mean run
    (None: the slot's), not its own run for both."""
    fc = Forecaster(default_cap=256)
    for i in range(10):
        cap, run_s = (50, 1.0) if i % 2 else (150, 3.0)
        o = _order(f"past{i}", 1.0, i)
        fc.entering(o, 0.0, None, cap)
        fc.admitted(o, "d", 0.0)
        fc.released(o.id, run_s)
    a = _order("a", 1.0, 101)
    fc.entering(a, 0.0, 60.0, 50)
    fc.rested(a, 0.0, _state(1))
    known = fc._known_at(1.0, 0.0, None)
    assert [x.run_s for x in fc._ahead(1.0, 1, known, 0.0, _state(1))] == [pytest.approx(1.0)]
    assert [x.run_s for x in fc._ahead(1.0, 2, known, 0.0, _state(1))] == [None]


def test_a_resting_order_knows_its_slots_are_busy_whatever_a_stale_view_said() -> None:
    fc = Forecaster(default_cap=256)
    _fed(fc)
    running = _order("run", 1.0, 100)
    fc.entering(running, 0.0, None, 100)
    fc.admitted(running, "d", 0.0)
    o = _order("o", 1.0, 101)
    fc.entering(o, 0.5, 60.0, 100)
    stale = _state(0)  # a shared book's view from before the slot was taken
    assert fc.wait_at(1.0, 0.5, stale) == 0.0  # a new order: a free slot, as far as it says
    assert fc.rested(o, 0.5, stale) == pytest.approx(1.5)  # it rested: the slot is busy


def test_an_order_ahead_that_will_time_out_is_not_waited_for() -> None:
    fc = Forecaster(default_cap=256)
    _fed(fc)
    running = _order("run", 1.0, 100)
    fc.entering(running, 0.0, None, 100)
    fc.admitted(running, "d", 0.0)
    short = _order("short", 1.0, 101)
    fc.entering(short, 0.0, 1.0, 100)  # its timeout: 1 s, before the slot frees at 2
    fc.rested(short, 0.0, _state(1))
    patient = _order("patient", 1.0, 102)
    patient.position_at_entry = 1
    fc.entering(patient, 0.0, 60.0, 100)
    assert fc.rested(patient, 0.0, _state(1)) == pytest.approx(2.0)


def test_a_free_slot_is_no_wait_before_any_run_was_seen() -> None:
    fc = Forecaster(default_cap=256)
    o = _order("o", 1.0, 1)
    fc.entering(o, 0.0, None, 10)
    assert fc.wait_at(1.0, 0.0, _state(0)) == 0.0
    assert fc.wait_at(1.0, 0.0, _state(1)) is None  # busy, and no run seen: nothing to go by
    assert fc.wait_at(0.05, 0.0, _state(0)) is None  # under the floor


def test_before_any_run_ended_the_running_ones_are_taken_to_be_halfway() -> None:
    fc = Forecaster(default_cap=256)
    running = _order("run", 1.0, 1)
    fc.entering(running, 0.0, None, 100)
    fc.admitted(running, "d", 0.0)
    assert fc.wait_at(1.0, 0.1, _state(1)) is None  # it has run 0.1 s: too little to go by
    assert fc.wait_at(1.0, 1.0, _state(1)) == pytest.approx(1.0)  # 1 s run: 2 s runs, 1 s left


def test_an_order_no_slot_comes_to_in_time_is_told_its_wait_in_a_lull() -> None:
    """More arrive above it than the slot takes: the walk sees no slot for it before
    its timeout. It can start only in a lull of those arrivals: its wait at the first
    share of their rate that lets it start in time."""
    fc = Forecaster(default_cap=256)
    _fed(fc, run_s=1.0)
    for i in range(40):  # 2 a second above it, the slot takes 1 a second
        fc.arrivals.add(20.0 + i * 0.5, 1.0)
    running = _order("run", 1.0, 99)
    fc.entering(running, 39.5, None, 100)
    fc.admitted(running, "d", 39.5)  # frees at 40.5, then every second
    low = _order("low", 0.5, 100, 40.0)
    fc.entering(low, 40.0, 43.0, 100)  # 3 s to start in
    fc.arrivals = ArrivalHistory()
    for i in range(40):
        fc.arrivals.add(20.0 + i * 0.5, 1.0)
    # a new order at 0.5 is told no wait (a quote: the arrivals above take every free)
    assert fc.wait_at(0.5, 40.0, _state(1)) is None
    # at 2 a second (and at 1.5) they take every free before its timeout; at half that
    # rate, half of the first free is its, in expectation: 0.5 s
    assert fc.rested(low, 40.0, _state(1)) == pytest.approx(0.5)


def test_a_requeued_order_waits_again_without_being_scored_twice() -> None:
    fc = Forecaster(default_cap=256)
    _fed(fc)
    o = _order("o", 1.0, 100)
    fc.entering(o, 0.0, 60.0, 100)
    fc.rested(o, 0.0, _state(1))
    fc.admitted(o, "d", 1.0)
    fc.requeued(o)
    assert fc.predict(o, 0, 1.1, _state(1)) is not None
    fc.admitted(o, "d", 2.0)
    fc.released(o.id, 3.0)
    assert fc.score(3.0).orders == 1
    fc.gone(o)
    assert math.isclose(fc.runs.model("d").mean, (10 * 2.0 + 1.0) / 11)  # type: ignore[union-attr]


def test_a_raised_bid_moves_the_order_ahead_of_the_lower_ones() -> None:
    fc = Forecaster(default_cap=256)
    _fed(fc)
    running = _order("run", 1.0, 100)
    fc.entering(running, 0.0, None, 100)
    fc.admitted(running, "d", 0.0)  # frees at 2, then every 2 s
    first = _order("first", 1.0, 101)
    fc.entering(first, 0.0, 60.0, 100)
    fc.rested(first, 0.0, _state(1))
    late = _order("late", 0.5, 102)
    late.position_at_entry = 1
    fc.entering(late, 0.0, 60.0, 100)
    assert fc.rested(late, 0.0, _state(1)) == pytest.approx(4.0)
    fc.rebid(late, 2.0)  # raised over the first: next
    assert late.bid == 2.0
    assert fc.predict(late, 0, 0.0, _state(1)) == pytest.approx(2.0)
    assert fc.predict(first, 1, 0.0, _state(1)) == pytest.approx(4.0)


def test_runs_cut_short_do_not_bend_the_line_against_the_cap() -> None:
    """Runs are nearly set by their cap (20 tokens a second here); a run cut short (its
    client left) is off the line: left out of the fit, kept among the errors."""
    runs = [(float(c), c / 20.0) for c in range(20, 61, 2)]  # 21 runs, 1 to 3 s
    cut = [(60.0, 0.3), (56.0, 0.5), (50.0, 0.2)]  # cut after a fraction of a second
    model = RunModel.fit(runs + cut)
    assert model.b == pytest.approx(0.05) and model.a == pytest.approx(0.0, abs=1e-9)
    assert model.total(40) == pytest.approx(2.0)
    assert model.errors[0] < -2.0  # a cut run is among the errors still
    plain = RunModel.fit(runs)
    assert plain.total(40) == pytest.approx(2.0)


def test_the_rate_counts_the_newest_arrivals_not_a_quiet_spell_before_them() -> None:
    arrivals = ArrivalHistory()
    for i in range(5):  # a few, long ago (within the window)
        arrivals.add(i * 10.0, 1.0)
    for i in range(200):  # then 10 a second for 20 s, one in five above 0.5
        arrivals.add(100.0 + i * 0.1, 1.0 if i % 5 == 0 else 0.2)
    # the newest 100 arrivals span 9.9 s: 20 of them above 0.5
    assert arrivals.rate_above(0.5, 120.0) == pytest.approx(20 / 10.0, rel=0.05)


def test_the_rate_follows_a_burst_within_a_few_dozen_arrivals() -> None:
    arrivals = ArrivalHistory()
    for i in range(100):  # 1 a second, half above 0.5
        arrivals.add(i * 1.0, 1.0 if i % 2 else 0.2)
    assert arrivals.rate_above(0.5, 100.0) == pytest.approx(0.5, rel=0.05)
    for i in range(40):  # then 10 a second for 4 s
        arrivals.add(100.0 + i * 0.1, 1.0 if i % 2 else 0.2)
    # the newest 30 came at 10 a second; the share above 0.5 is still a half
    assert arrivals.rate_above(0.5, 104.0) == pytest.approx(5.0, rel=0.1)


def test_an_order_that_gave_up_counts_in_the_rate_a_timeout_does_not() -> None:
    fc = Forecaster(default_cap=256)
    orders = [_order(f"o{i}", 1.0, i) for i in range(4)]
    for o in orders:
        fc.entering(o, 0.0, 100.0, 100)
        fc.rested(o, 0.0, _state(1))
    fc.gone(orders[0], 10.0, gave_up=True)  # 4 waited 10 s: 40 order-seconds
    fc.gone(orders[1], 10.0)  # its timeout
    assert fc.give_ups.per_s() == pytest.approx(1 / 40, rel=0.1)
    fc.gone(orders[2], 10.0, gave_up=True)
    fc.gone(orders[2], 10.0, gave_up=True)  # once only
    assert fc.give_ups.per_s() == pytest.approx(2 / 40, rel=0.1)


def test_another_replicas_running_orders_are_read_from_the_shared_books_view() -> None:
    """A shared book's view names the orders holding a slot; this replica knows its own
    runs, and takes the others' start from their admissions in the view (not the
    newest admissions there, which may have ended)."""
    fc = Forecaster(default_cap=256)
    _fed(fc)  # runs of 2 s
    mine = _order("mine", 1.0, 100)
    fc.entering(mine, 0.0, None, 100)
    fc.admitted(mine, "d", 0.0)  # loop time 0: frees at 2.0
    wall = time.time()
    recent = [  # newest first
        Clear(wall - 0.7, 1.0, 1.0, "d", None, "done"),  # admitted, ended since
        Clear(wall - 1.5, 1.0, 1.0, "d", None, "theirs"),  # has run 1.5 s: frees in 0.5
    ]
    view = BookView(
        1.0, 0, None, 3, [DeploymentView("d", 0.1, 2, 2, True, "closed")],
        recent=recent, running=[("mine", "d", 100), ("theirs", "d", None)],
    )  # fmt: skip
    state = BookState((SlotState("d", 0.1, 2, 2, True),), view)
    o = _order("o", 1.0, 101, 1.0)
    fc.entering(o, 1.0, 60.0, 100)
    # one ahead (another replica's): it takes theirs at 0.5, o takes mine at 1.0
    assert fc.predict(o, 1, 1.0, state) == pytest.approx(1.0, abs=0.05)
    older = BookView(view.level, 0, None, 3, view.deployments, recent=recent)  # a view that does not say
    assert fc.predict(o, 1, 1.0, replace(state, view=older)) == pytest.approx(1.3, abs=0.05)
    # a view read before theirs was admitted names only mine: theirs is a run found at
    # a random instant (E[R^2] / 2E[R] = 1 s left), not the newest admission seen
    early = BookView(
        view.level, 0, None, 3, view.deployments, recent=recent[:1], running=[("mine", "d", 100)]
    )
    assert fc.predict(o, 1, 1.0, replace(state, view=early)) == pytest.approx(1.0, abs=0.05)


def test_an_order_admitted_at_once_is_neither_ranked_nor_scored() -> None:
    fc = Forecaster(default_cap=256)
    o = _order("o", 1.0, 1)
    fc.entering(o, 0.0, 60.0, 100)
    fc.admitted(o, "d", 0.0)  # a slot was free: it never rested
    assert len(fc._ranked) == 0 and fc.score(0.0).orders == 0
    assert fc.give_ups._at is None  # the give-up sums are not touched
    fc.released(o.id, 2.0)
    assert fc.runs.seen == 1  # its run is learnt all the same
    waiting = _order("w", 1.0, 2)
    fc.entering(waiting, 2.0, 60.0, 100)
    fc.rested(waiting, 2.0, _state(1))
    fc.rested(waiting, 2.0, _state(1))  # told twice: ranked once
    assert len(fc._ranked) == 1
    fc.admitted(waiting, "d", 3.0)
    assert len(fc._ranked) == 0 and fc.score(3.0).orders == 1


def test_another_replicas_running_order_is_known_by_its_cap() -> None:
    """Runs of 20 tokens a second: another replica's order capped at 20 tokens that has
    run 0.5 s frees in 0.5 s; not knowing its cap, in 1.5 s (the runs of 1 to 3 s
    longer than 0.5, on average)."""
    fc = Forecaster(default_cap=256)
    for i in range(21):  # runs of 1 to 3 s, caps 20 to 60
        o = _order(f"past{i}", 1.0, i)
        fc.entering(o, 0.0, None, 20 + 2 * i)
        fc.admitted(o, "d", 0.0)
        fc.released(o.id, (20 + 2 * i) / 20.0)
    wall = time.time()
    view = BookView(
        1.0, 0, None, 1, [DeploymentView("d", 0.1, 1, 1, True, "closed")],
        recent=[Clear(wall - 0.5, 1.0, 1.0, "d", None, "theirs")], running=[("theirs", "d", 20)],
    )  # fmt: skip
    state = BookState((SlotState("d", 0.1, 1, 1, True),), view)
    o = _order("o", 1.0, 100, 1.0)
    fc.entering(o, 1.0, 60.0, 100)
    assert fc.predict(o, 0, 1.0, state) == pytest.approx(0.5, abs=0.05)
    blind = BookView(
        view.level, 0, None, 1, view.deployments, recent=view.recent, running=[("theirs", "d", None)]
    )
    assert fc.predict(o, 0, 1.0, replace(state, view=blind)) == pytest.approx(1.5, abs=0.15)
