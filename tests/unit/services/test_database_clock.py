"""The database's clock as read from a process whose own clock is off
(:class:`bourse.services.clock.DatabaseClock`): the offset is measured against the
middle of the round trip, and ``now()`` follows the local clock plus that offset."""

from __future__ import annotations

from bourse.services.clock import DatabaseClock


def test_now_is_the_local_clock_plus_the_offset_measured_at_a_round_trip() -> None:
    local = [1_000_120.0]  # this process runs 120 s ahead of the database
    clock = DatabaseClock(lambda: local[0])
    assert clock.now() == 1_000_120.0  # nothing measured yet: the local clock
    sent = clock.local()
    local[0] += 0.004  # a 4 ms round trip; the database read its clock half-way
    clock.observe(1_000_000.002, sent, clock.local())
    assert abs(clock.offset_s - (-120.0)) < 1e-9
    local[0] += 10.0
    assert abs(clock.now() - 1_000_010.004) < 1e-6
    assert clock.local() == local[0]  # times no replica compares stay local
