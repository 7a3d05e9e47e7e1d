"""The circuit breaker: its listener hears each opening and closing once; its cool-down as
fail fast reads it (:func:`cooling_for` is the time until the first breaker can be tried
again when every one is open, else None)."""

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


def test_opening_and_closing_are_heard_once_each() -> None:
    heard: list[str] = []
    b = CircuitBreaker(threshold=2, cooldown_s=5.0, on_change=heard.append)
    b.record_failure(0.0)
    assert heard == []
    b.record_failure(0.1)
    assert heard == ["open"]
    b.record_failure(0.2)  # still cooling: no second opening
    assert heard == ["open"]
    b.record_failure(10.0)  # the half-open trial failed: open again
    assert heard == ["open", "open"]
    b.record_success()
    assert heard == ["open", "open", "closed"]
    b.record_success()  # already closed
    assert heard == ["open", "open", "closed"]


def test_a_breaker_without_a_listener_works_as_before() -> None:
    b = CircuitBreaker(threshold=1, cooldown_s=1.0)
    b.record_failure(0.0)
    assert b.state == "open" and not b.available(0.5) and b.available(1.5)
    b.record_success()
    assert b.state == "closed"
