"""The SQLite adapter's own mechanics: WAL checkpoints off the commit path."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import anyio
import pytest

from bourse.storage.sql import Executor
from bourse.storage.sqlite import SqliteStore

pytestmark = pytest.mark.anyio


def _autocheckpoint(db: Executor) -> int:
    row = db.fetchrow("PRAGMA wal_autocheckpoint")
    assert row is not None
    return int(row["wal_autocheckpoint"])


async def test_checkpoints_run_on_their_own_thread_and_close_leaves_no_wal(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"
    store = SqliteStore(path)
    store.CHECKPOINT_EVERY = 3
    checkpointed = threading.Event()
    checkpoint = store._checkpoint

    def counted(reset: bool = False) -> None:
        checkpoint(reset)
        checkpointed.set()

    store._checkpoint = counted  # type: ignore[method-assign]
    await store.open()
    try:
        assert await store._read(_autocheckpoint) == 0  # commits never checkpoint
        for i in range(12):
            await store.create_account(f"acct{i}", 1000, time.time())
        assert await anyio.to_thread.run_sync(checkpointed.wait, 10)
    finally:
        await store.close()
    assert not await anyio.Path(str(path) + "-wal").exists()
    again = SqliteStore(path)
    await again.open()
    try:
        account = await again.account("acct11")
        assert account is not None and account.balance_micros == 1000
    finally:
        await again.close()


async def test_an_in_memory_store_has_no_checkpointer() -> None:
    store = SqliteStore(":memory:")
    await store.open()
    try:
        await store.create_account("a", 1, time.time())
        assert store._checkpointer is None
    finally:
        await store.close()
