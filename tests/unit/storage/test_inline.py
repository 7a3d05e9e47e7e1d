"""SQLite's inline writes (storage.inline): a hold and a close at low load run on the
event loop's thread, with no hand-off; the loop never waits on another connection's
lock or a slow write."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from bourse.ports.stores import Hold, StoreUnavailable, UsageRecord
from bourse.storage.inline import InlineGate
from bourse.storage.sqlite import SqliteStore

pytestmark = pytest.mark.anyio
NOW = 1_700_000_000.0


def _hold(n: int, amount: int = 100) -> Hold:
    return Hold(
        id=f"h{n}", account_id="a", request_id=f"r{n}", amount_micros=amount, state="open", created_at=NOW
    )


async def test_a_hold_and_its_settlement_alone_run_inline_and_the_books_balance(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "bourse.db")
    await store.open()
    try:
        await store.create_account("a", 10_000, NOW)
        before = store.inline_runs
        for n in range(5):
            await store.place_hold(_hold(n))
            await asyncio.sleep(0)  # a request's hold and its settlement: turns apart
            usage = UsageRecord(f"r{n}", "a", "p", NOW, "ok", 40, {"cost": 40})
            await store.settle(f"h{n}", 40, usage, NOW)
            await asyncio.sleep(0)
        assert store.inline_runs - before == 10
        account = await store.account("a")
        assert account is not None and account.balance_micros == 10_000 - 5 * 40
        assert (await store.totals()).balanced
        assert all([await store.usage("a", f"r{n}") for n in range(5)])  # every charge has its record
    finally:
        await store.close()
    again = SqliteStore(tmp_path / "bourse.db")  # committed: another connection reads it
    await again.open()
    try:
        account = await again.account("a")
        assert account is not None and account.balance_micros == 10_000 - 5 * 40
    finally:
        await again.close()


async def test_writes_of_one_turn_past_the_first_go_to_the_commit_thread_and_batch(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "bourse.db")
    await store.open()
    try:
        await store.create_account("a", 10_000, NOW)
        before = store.inline_runs
        await asyncio.gather(*(store.place_hold(_hold(n)) for n in range(6)))
        assert store.inline_runs - before == 1
        assert (await store.totals()).balanced
    finally:
        await store.close()


async def test_a_file_locked_by_another_connection_is_waited_for_off_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"
    store = SqliteStore(path, unavailable_timeout_s=0.3)
    await store.open()
    other = sqlite3.connect(path, isolation_level=None)
    try:
        await store.create_account("a", 10_000, NOW)
        before = store.inline_runs
        other.execute("BEGIN IMMEDIATE")
        gaps: list[float] = []

        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.place_hold(_hold(1))
        ticker.cancel()
        assert time.monotonic() - t0 >= 0.25  # the busy timeout, waited on the commit thread
        assert len(gaps) >= 10 and max(gaps) < 0.2  # while the loop ran on, never held
        assert store.inline_runs == before
        other.execute("ROLLBACK")
        await store.place_hold(_hold(2))  # the lock is free: inline again
        assert store.inline_runs == before + 1
        assert (await store.totals()).balanced
    finally:
        other.close()
        await store.close()


async def test_the_gate_admits_one_a_turn_and_closes_after_a_slow_one() -> None:
    loop = asyncio.get_running_loop()
    gate = InlineGate(per_turn=1, slow_s=0.005, slow_count=1, backoff_s=0.05, load_s=0.0)
    assert gate.admit(loop)
    assert not gate.admit(loop)  # the same turn
    await asyncio.sleep(0)
    assert gate.admit(loop)
    gate.ran(0.001)
    await asyncio.sleep(0)
    assert gate.admit(loop)
    gate.ran(0.006)  # slow: closed for backoff_s
    await asyncio.sleep(0)
    assert not gate.admit(loop)
    await asyncio.sleep(0.06)
    assert gate.admit(loop)


async def test_one_slow_write_alone_leaves_the_gate_open_two_of_the_last_eight_close_it() -> None:
    """A write slowed once (the loop's thread preempted on a busy machine) is not a slow
    disk: by default the gate closes at the second slow one of the last eight writes."""
    loop = asyncio.get_running_loop()
    gate = InlineGate(per_turn=1, backoff_s=0.05, load_s=0.0)
    for seconds in (0.006, *[0.001] * 8, 0.006, *[0.001] * 3):  # eight apart: never two of eight
        assert gate.admit(loop)
        gate.ran(seconds)
        await asyncio.sleep(0)
    assert gate.admit(loop)
    gate.ran(0.006)  # the second slow one of the last eight: closed for backoff_s
    await asyncio.sleep(0)
    assert not gate.admit(loop)
    await asyncio.sleep(0.06)
    assert gate.admit(loop)


async def test_a_disk_slow_on_every_other_write_closes_the_gate() -> None:
    """A fast hold and a slow settle, over and over: the loop is held by at most two
    slow writes before the gate closes, not by every settle."""
    loop = asyncio.get_running_loop()
    gate = InlineGate(per_turn=1, backoff_s=10.0, load_s=0.0)
    slow_inline = 0
    for n in range(100):
        if gate.admit(loop):
            seconds = 0.05 if n % 2 else 0.001
            slow_inline += seconds > 0.005
            gate.ran(seconds)
        await asyncio.sleep(0)
    assert 1 <= slow_inline <= 2


async def test_under_load_the_gate_stays_shut_a_while() -> None:
    """A turn asking for more than its budget, or a write finding another in flight
    (``loaded``), shuts the gate for ``load_s``: under load the commit thread runs the
    SQL beside the loop, inline would serialize it on the loop's thread."""
    loop = asyncio.get_running_loop()
    gate = InlineGate(per_turn=1, slow_s=1.0, backoff_s=1.0, load_s=0.05)
    assert gate.admit(loop)
    assert not gate.admit(loop)  # a second write in the turn: load
    await asyncio.sleep(0)
    assert not gate.admit(loop)  # still shut in the next turn
    await asyncio.sleep(0.06)
    assert gate.admit(loop)
    await asyncio.sleep(0)
    gate.loaded()  # a write found another in flight
    assert not gate.admit(loop)
    await asyncio.sleep(0.06)
    assert gate.admit(loop)
