"""Retention over SQLite and PostgreSQL (``[storage] retention_s``, issue 35 item 9):
which records a pass deletes, what it keeps, the sums it keeps in their place, and an
idle pass that asks for no write transaction.

The rows are written with times in the past (the store takes the caller's times for
holds and usage records); the age is judged on the database's clock.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest

from bourse.ports.stores import Hold, Job, UsageRecord
from bourse.services.housekeeping import Housekeeping
from tests.support.databases import StoreFactory

pytestmark = pytest.mark.anyio

RETENTION_S = 3600.0


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(6)


def _hold(account: str, at: float, request_id: str | None = None, amount: int = 100) -> Hold:
    return Hold(_id("h_"), account, request_id or _id("req_"), amount, "open", owner="gw", product="p",
                created_at=at)  # fmt: skip


def _usage(hold: Hold, at: float, cost: int) -> UsageRecord:
    return UsageRecord(hold.request_id, hold.account_id, "p", at, "completed", cost, {"cost_micros": cost})


def _writes_of(store: Any) -> list[str]:
    """The write transactions asked of ``store`` from now on (its reads not counted)."""
    writes: list[str] = []
    run, read = store._run, store._read
    reading = [False]

    def counted_run(fn: Callable[..., Any], *args: Any) -> Any:
        if not reading[0]:
            writes.append(getattr(fn, "__name__", repr(fn)))
        return run(fn, *args)

    def counted_read(fn: Callable[..., Any], *args: Any) -> Any:
        reading[0] = True  # a read that the adapter runs through its own transaction path
        try:
            return read(fn, *args)
        finally:
            reading[0] = False

    store._run, store._read = counted_run, counted_read
    return writes


async def test_a_pass_prunes_old_closed_requests_and_keeps_their_sums(store_factory: StoreFactory) -> None:
    now = time.time()
    old, recent = now - 2 * RETENTION_S, now - 60
    async with store_factory() as s:
        await s.create_account("a", 100_000, old)
        await s.create_account("b", 100_000, old)
        gone: list[Hold] = []
        kept: list[Hold] = []

        settled = _hold("a", old)  # charged long ago: goes, its charge kept in the sums
        await s.place_hold(settled)
        await s.settle(settled.id, 40, _usage(settled, old, 40), old)
        released = _hold("b", old)  # released with no usage record (a 503, a hand-back)
        await s.place_hold(released)
        await s.release(released.id, None, old)
        zero = _hold("b", old)  # released with its usage record of 0
        await s.place_hold(zero)
        await s.release(zero.id, _usage(zero, old, 0), old)
        gone += [settled, released, zero]

        fresh = _hold("a", recent)  # younger than the retention
        await s.place_hold(fresh)
        await s.settle(fresh.id, 25, _usage(fresh, recent, 25), recent)
        reconciling = _hold("a", old)  # an operator's to settle: never pruned
        await s.place_hold(reconciling)
        await s.to_reconciling(reconciling.id, _usage(reconciling, old, 0), "no usage", old)
        open_ = _hold("b", old)  # still running
        await s.place_hold(open_)
        resumed_old = _hold("a", old)  # a job resumed: its first run released long ago ...
        await s.place_hold(resumed_old)
        await s.release(resumed_old.id, None, old)
        resumed_new = _hold("a", recent, request_id=resumed_old.request_id)  # ... its second charged now
        await s.place_hold(resumed_new)
        await s.settle(resumed_new.id, 30, _usage(resumed_new, old, 30), recent)
        running = _hold("b", old)  # the earlier run of a job still unfinished (its resume reads it)
        await s.place_hold(running)
        await s.settle(running.id, 10, _usage(running, old, 10), old)
        await s.put_job(Job(id=_id("job_"), account_id="b", key_id="k", endpoint="/v1/chat/completions",
                            body={}, status="running", request_id=running.request_id, bid=1.0, created_at=old,
                            expires_at=now + 3600, owner="gw"))  # fmt: skip
        kept += [fresh, reconciling, open_, resumed_old, resumed_new, running]

        before = await s.totals()
        spent_before = {a: (await s.account(a)).spent_micros for a in ("a", "b")}
        assert before.balanced, before

        hk = Housekeeping(s, interval_s=60, retention_s=RETENTION_S, retention_batch=2)
        assert await hk.prune_once() == (3, 2)

        for h in gone:
            assert await s.hold(h.id) is None, h
            assert await s.usage(h.account_id, h.request_id) is None, h
        for h in kept:
            assert await s.hold(h.id) is not None, h
        for h in (fresh, reconciling, resumed_new, running):
            assert await s.usage(h.account_id, h.request_id) is not None, h
        after = await s.totals()
        assert after == before, (after, before)  # the revenue kept: 40 pruned, counted still
        assert after.balanced, after
        for a in ("a", "b"):
            acc = await s.account(a)
            assert acc.spent_micros == spent_before[a], (a, acc)
            assert acc.credited_micros == (
                acc.balance_micros + acc.open_holds_micros + acc.reconciling_micros + acc.spent_micros
            ), acc

        # nothing left old enough: the next pass looks (a read) and writes nothing
        writes = _writes_of(s)
        assert await hk.prune_once() == (0, 0)
        assert writes == [], f"an idle retention pass asked for write transactions: {writes}"

        # the operator settles the reconciling hold; once that is old too, it goes as well
        await s.settle(reconciling.id, 7, _usage(reconciling, old, 7), old)
        writes.clear()
        assert await hk.prune_once() == (1, 1)
        assert writes == ["prune"], writes  # one batch, one write transaction
        assert (await s.totals()).balanced
        acc = await s.account("a")
        assert acc.spent_micros == spent_before["a"] + 7


async def test_retention_off_looks_at_nothing(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 1000, 0.0)
        h = _hold("a", 0.0)
        await s.place_hold(h)
        await s.settle(h.id, 5, _usage(h, 0.0, 5), 0.0)
        writes = _writes_of(s)
        assert await Housekeeping(s, interval_s=60).prune_once() == (0, 0)
        assert writes == [] and await s.hold(h.id) is not None
