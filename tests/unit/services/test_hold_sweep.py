"""The hold sweeper (``bourse.services.hold_sweep``) against real stores: what it closes,
and what it leaves to the runs that hold their holds.

- A hold of this gateway that no run holds (its close lost) is reconciled; a hold
  whose run is still under way is left alone.
- A placement whose caller was cancelled stands in the database, and no run holds it:
  the sweep releases it (nothing ran), so the balance comes back whole.
- A close the database refused (another connection holds the SQLite file's write
  lock past the store's ``unavailable_timeout_s``: ``SQLITE_BUSY``) is kept and
  written by the next sweep, once the lock is gone.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import time
from pathlib import Path

import pytest

from bourse.ports.stores import Hold, StoreUnavailable
from bourse.services.billing import Billing, Quote
from bourse.storage.sqlite import SqliteStore
from tests.support.databases import StoreFactory, hand_off_every_write
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

NOW = 1_700_000_000.0
QUOTE = Quote(tokens=100, micros=250, bid=2.5)


def _stray(owner: str) -> Hold:
    return Hold(
        id="hold_" + secrets.token_hex(6), account_id="a", request_id="r_" + secrets.token_hex(6),
        amount_micros=100, state="open", owner=owner, product="p", created_at=NOW,
    )  # fmt: skip


async def test_a_hold_no_run_holds_is_reconciled_and_a_held_one_is_not(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        billing = Billing(s, owner="me")
        held = await billing.hold(QUOTE, account_id="a", request_id="r1", product="p")
        stray, theirs = _stray("me"), _stray("another")
        for h in (stray, theirs):
            await s.place_hold(h)
        assert await billing.sweeper.sweep() == 1
        assert (await s.hold(stray.id)).state == "reconciling"
        assert (await s.hold(held)).state == "open"
        assert (await s.hold(theirs.id)).state == "open"
        await billing.release(held)
        assert await billing.sweeper.sweep() == 0


@pytest.mark.parametrize("store_factory", ["sqlite"], indirect=True)
async def test_a_cancelled_placement_that_stands_is_released(store_factory: StoreFactory) -> None:
    # SQLite runs every transaction it was given (the commit thread's queue); PostgreSQL
    # drops a cancelled one that no worker has started, and one a worker has started
    # cannot be timed from here
    async with store_factory() as s:
        hand_off_every_write(s)  # else SQLite places it on the loop's thread, before the cancel
        await s.create_account("a", 10_000, NOW)
        billing = Billing(s, owner="me")
        task = asyncio.create_task(billing.hold(QUOTE, account_id="a", request_id="r1", product="p"))
        await asyncio.sleep(0)  # submitted to the store
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def placed() -> bool:
            return bool(await s.open_hold_ids("me", 10))

        await await_until(placed, 5.0, what="the cancelled placement")  # the transaction stood
        assert await billing.sweeper.sweep() == 1
        assert await s.open_hold_ids("me", 10) == []
        account = await s.account("a")
        assert account is not None and account.balance_micros == 10_000 and account.reconciling_micros == 0


async def test_a_close_the_database_refused_is_written_by_the_next_sweep(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"
    s = SqliteStore(path, unavailable_timeout_s=0.2)
    await s.open()
    try:
        await s.create_account("a", 10_000, time.time())
        billing = Billing(s, owner="me")
        hold_id = await billing.hold(QUOTE, account_id="a", request_id="r1", product="p")
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process writes the file: ours waits, then SQLITE_BUSY
        try:
            with pytest.raises(StoreUnavailable):
                await billing.release(hold_id)
            with pytest.raises(StoreUnavailable):
                await billing.sweeper.sweep()  # still refused: kept
            assert set(billing.sweeper.refused) == {hold_id}
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert await billing.sweeper.sweep() == 1
        assert billing.sweeper.refused == {}
        hold = await s.hold(hold_id)
        assert hold is not None and hold.state == "released"
        account = await s.account("a")
        assert account is not None and account.balance_micros == 10_000
    finally:
        await s.close()
