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


async def test_a_reset_under_writes_restarts_the_log_in_place_and_an_idle_one_empties_it(
    tmp_path: Path,
) -> None:
    """Under writes the log is reset with RESTART (the file keeps its blocks: freeing them
    held the commit thread ~4 ms a reset on a filesystem that discards); idle, with
    TRUNCATE (the file emptied)."""
    path = tmp_path / "bourse.db"
    store = SqliteStore(path)
    store.CHECKPOINT_EVERY = 8
    store.WAL_LIMIT_BYTES = 64 * 1024
    store.WAL_STEP_BYTES = 32 * 1024
    store.IDLE_CHECKPOINT_S = 60.0  # no idle pass while the test writes, however slowly
    modes: list[str] = []
    reset = store._reset_wal

    def seen(conn: object, *mode: str) -> None:
        modes.append(mode[0] if mode else "TRUNCATE")  # a reset without a mode truncates
        reset(conn, *mode)  # type: ignore[arg-type]

    store._reset_wal = seen  # type: ignore[method-assign,assignment]
    await store.open()
    wal = anyio.Path(str(path) + "-wal")
    try:
        for i in range(400):
            await store.create_account(f"acct{i}", 1000, time.time())
        assert "RESTART" in modes and "TRUNCATE" not in modes, modes
        assert (await wal.stat()).st_size > 0  # restarted in place, not emptied
        store.IDLE_CHECKPOINT_S = 0.3
        for i in range(store.CHECKPOINT_EVERY):  # a pass, after which the thread waits 0.3 s
            await store.create_account(f"last{i}", 1000, time.time())
        for _ in range(400):  # idle: the next pass empties the file (up to 20 s)
            if modes[-1] == "TRUNCATE" and (await wal.stat()).st_size == 0:
                break
            await anyio.sleep(0.05)
        assert modes[-1] == "TRUNCATE" and (await wal.stat()).st_size == 0
    finally:
        await store.close()
