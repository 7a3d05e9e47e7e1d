"""What a request's money costs on disk on SQLite (issue 40): the WAL bytes of one
hold placed and settled with its usage record, one request at a time.

A commit logs every page it touched, whole. With 4 KiB pages and indexes that moved
each hold's entry at its placing and again at its close, a request logged ~21 pages,
~85 KB (bench/disk.py: 89 KB written by the gateway a request at c=1). New files use
512-byte pages and the hold indexes are entered once (migration 0017): ~13 KB.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from bourse.ports.stores import Hold, UsageRecord
from bourse.services.ids import new_hold_id, new_request_id
from bourse.storage.sqlite import PAGE_SIZE, SqliteStore

pytestmark = pytest.mark.anyio

WARM = 300
N = 300
BOUND_BYTES = 20_000
"""WAL a request at c=1, at most (measured ~13 KB; 85 KB before)."""
RECORD = {
    "id": "chatcmpl-x",
    "object": "bourse.usage",
    "model": "sim",
    "endpoint": "/v1/chat/completions",
    "outcome": "completed",
    "usage": {"prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19, "cost_micros": 19},
    "receipt": {"latency_ms": 1.353, "ttft_ms": 1.29, "outcome": "completed", "cost_micros": 19},
    "note": "x" * 250,
}
"""About the size of a gateway's record (~550 bytes of JSON)."""


def _quiet(store: SqliteStore) -> None:
    """No checkpoint during the test: the WAL's growth is what the commits logged."""
    store.CHECKPOINT_EVERY = store.SIZE_EVERY = 10**9
    store.WAL_STEP_BYTES = 1 << 40
    store.IDLE_CHECKPOINT_S = 3600.0


async def _requests(store: SqliteStore, n: int) -> None:
    now = time.time()
    for _ in range(n):
        hold_id, request_id = new_hold_id(), new_request_id("chat")
        await store.place_hold(Hold(hold_id, "acct", request_id, 55, "open", owner="gw_1", created_at=now))
        usage = UsageRecord(request_id, "acct", "sim", now, "completed", 19, {**RECORD, "id": request_id})
        await store.settle(hold_id, 19, usage, now)


async def test_a_new_file_has_small_pages(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "bourse.db")
    await store.open()
    await store.close()
    conn = sqlite3.connect(tmp_path / "bourse.db")
    try:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == PAGE_SIZE == 512
    finally:
        conn.close()


async def test_an_existing_file_keeps_its_page_size(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    store = SqliteStore(path)
    await store.open()
    await store.create_account("acct", 10**9, time.time())
    await store.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 4096
    finally:
        conn.close()


async def test_a_request_logs_a_quarter_of_the_bytes_it_did(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"
    store = SqliteStore(path)
    _quiet(store)
    await store.open()
    try:
        await store.create_account("acct", 10**12, time.time())
        await _requests(store, WARM)  # the trees past their first pages
        wal = path.with_name(path.name + "-wal")
        before = wal.stat().st_size
        await _requests(store, N)
        per_request = (wal.stat().st_size - before) / N
        assert (await store.totals()).balanced
    finally:
        await store.close()
    assert per_request <= BOUND_BYTES, f"{per_request:.0f} bytes of WAL a request"
