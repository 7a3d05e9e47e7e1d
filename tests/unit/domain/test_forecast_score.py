"""The score of the wait forecast (issue 38, item 1): over the recent window (orders
and seconds), the median absolute error and the share within a factor of two."""

from __future__ import annotations

import pytest

from bourse.domain.forecast_score import WaitScore, within_2x


def test_within_2x_is_a_factor_of_two_either_way_or_a_few_milliseconds() -> None:
    assert within_2x(2.0, 1.0) and within_2x(0.5, 1.0) and within_2x(1.0, 1.0)
    assert not within_2x(2.1, 1.0) and not within_2x(0.49, 1.0)
    assert within_2x(0.0, 0.04)  # 40 ms off: within the slack
    assert not within_2x(0.0, 0.2)
    assert not within_2x(None, 1.0)  # no prediction: a miss


def test_the_score_is_the_median_error_and_the_share_within_2x() -> None:
    s = WaitScore()
    assert s.score(0.0).orders == 0 and s.score(0.0).within_2x is None
    for predicted, actual in [(1.0, 1.0), (1.0, 1.5), (3.0, 1.0), (None, 2.0), (2.0, 2.4)]:
        s.add(10.0, predicted, actual)
    got = s.score(10.0)
    assert got.orders == 5
    assert got.within_2x == pytest.approx(3 / 5)  # 3.0 for 1.0 and no prediction: misses
    assert got.median_abs_error_s == pytest.approx(0.45)  # of 0, 0.5, 2.0, 0.4
    assert got.median_wait_s == pytest.approx(1.5)
    assert got.doc()["window"] == {"orders": 1000, "seconds": 600.0}


def test_the_window_keeps_the_last_orders_and_none_too_old() -> None:
    s = WaitScore(max_orders=3, window_s=60.0)
    s.add(0.0, 10.0, 1.0)  # a miss, pushed out by count
    for t in (1.0, 2.0, 3.0):
        s.add(t, 1.0, 1.0)
    assert s.score(3.0).orders == 3 and s.score(3.0).within_2x == 1.0
    s.add(50.0, 9.0, 1.0)
    assert s.score(62.5).orders == 2  # the ones at 1 and 2 s are over a minute old
    assert s.score(62.5).within_2x == pytest.approx(0.5)
    assert s.score(200.0).orders == 0


def test_the_margin_is_how_much_longer_than_predicted_the_waits_were() -> None:
    s = WaitScore()
    for ratio in [1.0] * 15 + [1.5] * 5:
        s.add(0.0, 2.0, 2.0 * ratio)
    assert s.score(0.0).margin == pytest.approx(1.5)  # the 80th percentile of 20
    for _ in range(5):
        s.add(0.0, 2.0, 6.0)
    assert s.score(0.0).margin == pytest.approx(3.0)
    few = WaitScore()
    for _ in range(19):
        few.add(0.0, 1.0, 9.0)
    assert few.score(0.0).margin == 1.0  # too few to go by
    early = WaitScore()
    for _ in range(30):
        early.add(0.0, 2.0, 1.0)  # shorter than predicted: no margin under 1
        early.add(0.0, 0.0, 0.01)  # predictions of no wait are not ratios
    assert early.score(0.0).margin == 1.0


def test_the_margin_is_of_the_waits_over_their_predicted_medians() -> None:
    """Issue 38: a quote is a median wait, stretched by the margin. An order resting
    in the book may be told another wait than its median (one between two likely
    starts, later than the median: :func:`~bourse.domain.forecast_starts.within_2x_point`);
    the margin is how much longer than their medians the waits were, else quotes
    would be stretched less the better the waits told catch."""
    s = WaitScore()
    for _ in range(20):
        s.add(0.0, 3.0, 3.0, median=2.0)
    score = s.score(0.0)
    assert score.margin == pytest.approx(1.5)
    assert score.within_2x == 1.0 and score.median_abs_error_s == 0.0  # scored as told
    told_only = WaitScore()
    for _ in range(20):
        told_only.add(0.0, 2.0, 3.0)  # no median given: the wait told is the median
    assert told_only.score(0.0).margin == pytest.approx(1.5)
