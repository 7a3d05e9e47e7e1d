"""The periods a spend cap (a key's or an account's) counts over, on the calendar in
UTC: ``total`` (for ever), ``day``, ``week`` (ISO: from Monday 00:00) and ``month``.

A period is a number (:func:`cap_period`), stored with the counter it belongs to and
with each hold counted on it: a hold whose period is not the counter's starts the
counter again, so a new period resets a cap without a job, and a closed hold gives
back only to its own period. The kinds have disjoint ranges (``total`` 0, days under
:data:`WEEKS`, weeks from :data:`WEEKS`, months from :data:`MONTHS`), so when an operator changes
a cap's kind the old kind's count and holds never meet a period of the new one.
"""

from __future__ import annotations

import calendar
import time
from typing import Literal, assert_never, get_args

CapPeriod = Literal["total", "day", "week", "month"]
CAP_PERIODS: tuple[CapPeriod, ...] = get_args(CapPeriod)

_DAY_S = 86_400
WEEKS = 1_000_000_000
"""The number of the week of 1969-12-29 (days stay under it for 2.7 million years)."""
MONTHS = 2_000_000_000
"""The number of month 0 (year 0's January); a month is ``MONTHS + year * 12 + month - 1``."""
_MONDAY_BEFORE_EPOCH = 3
"""1970-01-01 was a Thursday: the Monday of its ISO week was 3 days earlier."""


def cap_period(period: CapPeriod, now: float) -> int:
    """The number of the ``period`` that ``now`` (epoch seconds) falls in: 0 for
    ``total``; days since 1970-01-01 for ``day`` (as stored before weeks and months
    existed); :data:`WEEKS` plus the weeks since Monday 1969-12-29 for ``week``;
    :data:`MONTHS` plus ``year * 12 + month - 1`` for ``month``; all in UTC."""
    day = int(now // _DAY_S)
    match period:
        case "total":
            return 0
        case "day":
            return day
        case "week":
            return WEEKS + (day + _MONDAY_BEFORE_EPOCH) // 7
        case "month":
            t = time.gmtime(day * _DAY_S)
            return MONTHS + t.tm_year * 12 + t.tm_mon - 1
        case _:
            assert_never(period)


def per_period(period: CapPeriod) -> str:
    """How a message says the period: ``in total``, ``per UTC day``, …"""
    return "in total" if period == "total" else f"per UTC {period}"


def period_end(period: CapPeriod, now: float) -> float | None:
    """When the ``period`` that ``now`` falls in ends and the next one starts its count at
    zero (epoch seconds, UTC): the next midnight, Monday or 1st; None for ``total``."""
    day = int(now // _DAY_S)
    match period:
        case "total":
            return None
        case "day":
            return float((day + 1) * _DAY_S)
        case "week":
            monday = day - (day + _MONDAY_BEFORE_EPOCH) % 7
            return float((monday + 7) * _DAY_S)
        case "month":
            t = time.gmtime(day * _DAY_S)
            year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
            return float(calendar.timegm((year, month, 1, 0, 0, 0)))
        case _:
            assert_never(period)


def spent_now(period: CapPeriod | None, counted_period: int, counted_micros: int, now: float) -> int:
    """What a cap's counter says the current period has taken: its count when the
    period it counts (``counted_period``) is the one ``now`` falls in, else 0 (the
    next hold starts it again). 0 when there is no cap (``period`` None)."""
    if period is None or counted_period != cap_period(period, now):
        return 0
    return counted_micros
