"""The calendar periods of a spend cap (:mod:`bourse.domain.periods`) at their edges, in
UTC: a week turns at Monday 00:00 (the last second of Sunday is the week before), a
month at its first second (Dec 31 / Jan 1, the end of February in a leap year and
not), a day at midnight; ``total`` is one period for ever. When a period ends (what
an account's cap refusal says) is the first second of the next one, and a counter of
another period than now's has taken nothing of it."""

from __future__ import annotations

import calendar

import pytest

from bourse.domain.periods import CAP_PERIODS, MONTHS, WEEKS, cap_period, per_period, period_end, spent_now
from bourse.ports.budgets import AccountBudgetExceeded, BudgetExceeded, KeyBudgetExceeded


def _at(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float:
    return float(calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)))


def test_a_week_turns_at_monday_midnight_utc() -> None:
    sunday_last = _at(2026, 12, 6, 23, 59, 59)  # Sunday 6 December 2026
    monday = _at(2026, 12, 7)
    assert cap_period("week", monday) == cap_period("week", sunday_last) + 1
    assert cap_period("week", monday + 6 * 86_400 + 86_399.999) == cap_period("week", monday)
    assert cap_period("week", _at(2026, 11, 30)) == cap_period("week", sunday_last)  # its Monday
    # the numbering: week 0 began on Monday 1969-12-29, so 1970-01-01 (a Thursday) is in it
    assert cap_period("week", _at(1970, 1, 1)) == WEEKS
    assert cap_period("week", _at(1970, 1, 4, 23, 59, 59)) == WEEKS
    assert cap_period("week", _at(1970, 1, 5)) == WEEKS + 1


def test_a_month_turns_on_its_first_second_utc() -> None:
    assert cap_period("month", _at(2026, 12, 31, 23, 59, 59)) == MONTHS + 2026 * 12 + 11
    assert cap_period("month", _at(2027, 1, 1)) == MONTHS + 2027 * 12
    assert cap_period("month", _at(2027, 1, 1)) == cap_period("month", _at(2026, 12, 31, 23, 59, 59)) + 1
    assert cap_period("month", _at(2027, 2, 28, 23, 59, 59)) == MONTHS + 2027 * 12 + 1  # not a leap year
    assert cap_period("month", _at(2027, 3, 1)) == MONTHS + 2027 * 12 + 2
    assert (
        cap_period("month", _at(2028, 2, 28, 23, 59, 59)) == MONTHS + 2028 * 12 + 1
    )  # a leap year: one more day
    assert cap_period("month", _at(2028, 2, 29, 23, 59, 59)) == MONTHS + 2028 * 12 + 1
    assert cap_period("month", _at(2028, 3, 1)) == MONTHS + 2028 * 12 + 2
    assert cap_period("month", _at(2028, 3, 1) - 0.001) == MONTHS + 2028 * 12 + 1  # a fraction before


def test_a_day_turns_at_midnight_and_total_never() -> None:
    assert cap_period("day", _at(2026, 12, 31, 23, 59, 59)) + 1 == cap_period("day", _at(2027, 1, 1))
    assert cap_period("day", _at(2028, 2, 28, 12)) + 1 == cap_period("day", _at(2028, 2, 29))
    assert cap_period("day", _at(2028, 2, 29, 23, 59, 59)) + 1 == cap_period("day", _at(2028, 3, 1))
    assert {cap_period("total", t) for t in (0.0, _at(2026, 12, 7), _at(2100, 1, 1))} == {0}


def test_the_kinds_never_share_a_number() -> None:
    """A key whose cap changes kind keeps its old count and holds under the old kind's
    numbers: no period of another kind may have one of them, from 1970 to 9999."""
    for year in (1970, 2026, 2036, 2058, 2400, 9999):
        for month in (1, 2, 12):
            t = _at(year, month, 28, 12)
            assert (
                0 < cap_period("day", t) < WEEKS <= cap_period("week", t) < MONTHS <= cap_period("month", t)
            )


@pytest.mark.parametrize("period", CAP_PERIODS)
def test_every_period_is_numbered_and_said(period: str) -> None:
    now = _at(2026, 12, 5, 3)
    assert isinstance(cap_period(period, now), int)  # type: ignore[arg-type]
    assert per_period(period) in {"in total", f"per UTC {period}"}  # type: ignore[arg-type]


def test_an_unknown_period_is_refused() -> None:
    with pytest.raises(AssertionError):
        cap_period("year", 0.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("period", "now", "end"),
    [
        ("day", _at(2026, 12, 31, 23, 59, 59), _at(2027, 1, 1)),
        ("day", _at(2027, 1, 1), _at(2027, 1, 2)),
        ("week", _at(2026, 12, 6, 23, 59, 59), _at(2026, 12, 7)),  # Sunday: ends at Monday 00:00
        ("week", _at(2026, 12, 7), _at(2026, 12, 14)),  # Monday 00:00: a whole week ahead
        ("week", _at(1970, 1, 1), _at(1970, 1, 5)),  # week 0, from Monday 1969-12-29
        ("month", _at(2026, 12, 31, 23, 59, 59), _at(2027, 1, 1)),  # December: next year
        ("month", _at(2028, 2, 29, 12), _at(2028, 3, 1)),  # a leap February
        ("month", _at(2027, 2, 1), _at(2027, 3, 1)),
    ],
)
def test_a_period_ends_where_the_next_one_is_numbered(period: str, now: float, end: float) -> None:
    assert period_end(period, now) == end  # type: ignore[arg-type]
    assert cap_period(period, end) == cap_period(period, now) + 1  # type: ignore[arg-type]
    assert cap_period(period, end - 0.001) == cap_period(period, now)  # type: ignore[arg-type]


def test_total_never_ends() -> None:
    assert period_end("total", _at(2026, 12, 5)) is None


def test_a_counter_of_another_period_has_taken_nothing() -> None:
    now = _at(2026, 12, 5, 3)
    today = cap_period("day", now)
    assert spent_now("day", today, 700, now) == 700
    assert spent_now("day", today - 1, 700, now) == 0  # yesterday's count
    assert spent_now("week", today, 700, now) == 0  # a count of another kind of period
    assert spent_now(None, today, 700, now) == 0  # no cap
    assert spent_now("total", 0, 700, now) == 700


def test_every_cap_refusal_is_a_budget_exceeded() -> None:
    """The ledger's batch catches both kinds as one; the account's is not the key's."""
    assert issubclass(KeyBudgetExceeded, BudgetExceeded) and issubclass(AccountBudgetExceeded, BudgetExceeded)
    assert not issubclass(AccountBudgetExceeded, KeyBudgetExceeded)
    assert str(AccountBudgetExceeded(5, 3, "day")) == "account's spend cap 5 micro-USD per day, 3 taken"
