"""The circuit breaker tells its listener when it opens and when it closes, once each."""

from __future__ import annotations

from bourse.domain.breaker import CircuitBreaker


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
