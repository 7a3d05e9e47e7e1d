"""The circuit breaker's cool-down as fail fast reads it: :func:`cooling_for` is the time
until the first breaker can be tried again when every one is open, else None."""

from __future__ import annotations

from bourse.domain.breaker import CircuitBreaker, cooling_for


def opened(at: float, cooldown_s: float) -> CircuitBreaker:
    b = CircuitBreaker(threshold=1, cooldown_s=cooldown_s)
    b.record_failure(at)
    return b


def test_cooling_left_counts_down_and_ends() -> None:
    b = opened(100.0, 5.0)
    assert b.cooling_left(101.0) == 4.0
    assert b.cooling_left(105.0) == 0.0  # half-open: a trial may go
    assert CircuitBreaker().cooling_left(0.0) == 0.0


def test_cooling_for_is_the_first_end_when_every_breaker_is_open() -> None:
    assert cooling_for([opened(100.0, 5.0), opened(100.0, 30.0)], 102.0) == 3.0
    assert cooling_for([opened(100.0, 5.0), CircuitBreaker()], 102.0) is None  # one can run
    assert cooling_for([opened(100.0, 5.0)], 106.0) is None  # its cool-down is over
    assert cooling_for([], 0.0) is None
