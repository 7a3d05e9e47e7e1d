"""Availability in the book (:mod:`bourse.domain.availability`): an unavailable
deployment takes no order, is not counted by its breaker, and its floor is not the
lowest available one."""

from __future__ import annotations

from bourse.domain.availability import Availability
from bourse.domain.book import Deployment, Order, ProductBook


def _book() -> tuple[ProductBook, Deployment, Deployment]:
    dead, live = Deployment("dead", 0.01, 1), Deployment("live", 0.02, 1)
    return ProductBook("p", [dead, live]), dead, live


def test_set_reports_changes_only() -> None:
    heard: list[str | None] = []
    a = Availability(on_change=heard.append)
    assert a.ok and not a.set(None)
    assert a.fail("down") and not a.ok and a.reason == "down"
    assert not a.fail("still down") and a.reason == "still down"  # a new reason, no change
    assert a.set(None) and a.ok
    assert heard == ["down", None]


def test_an_unavailable_deployment_is_skipped_and_its_floor_left_out() -> None:
    book, dead, _live = _book()
    assert book.available_floor(0.0) == 0.01
    dead.availability.fail("unreachable")
    assert book.available_floor(0.0) == 0.02
    book.add(Order("o", 0.02, book.next_seq(), 0.0))
    [adm] = book.dispatch(0.0)
    assert adm.deployment == "live"
    book.add(Order("p", 1.0, book.next_seq(), 0.0))
    assert book.dispatch(0.0) == []  # live is busy; dead is free but out
    assert book.level(0.0) == 1.0
    assert book.healthy(0.0)
    book.release("live")
    book.deployment("live").availability.fail("gone too")
    assert not book.healthy(0.0) and book.available_floor(0.0) is None


def test_failures_while_unavailable_are_not_counted() -> None:
    book, dead, _ = _book()
    dead.breaker.threshold = 1
    dead.availability.fail("no route")
    book.report_failure("dead", 0.0)
    assert dead.breaker.failures == 0
    dead.availability.set(None)
    book.report_failure("dead", 0.0)
    assert dead.breaker.state == "open"


def test_an_open_breaker_leaves_the_floor_out_too() -> None:
    book, dead, _ = _book()
    dead.breaker.threshold = 1
    book.report_failure("dead", 0.0)
    assert book.available_floor(0.5) == 0.02  # cooling down
    assert book.available_floor(10.0) == 0.01  # cooled down: its one trial
