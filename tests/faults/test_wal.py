"""The SQLite WAL stays bounded under sustained writes and shrinks when the store is idle.

Sixty thousand ledger operations (holds placed and settled with their usage records,
50 at a time, about three seconds) are written as fast as the store takes them while a
thread samples the size of ``bourse.db-wal``. Before the fix only PASSIVE checkpoints
ran: under constant writes they never catch up with the writer, SQLite never restarts
the log, and the WAL grew with every commit (73 MiB for 20,000 operations, 739 MiB for
the same operations one at a time, 4.55 GB over a 12-minute soak) and never shrank,
even idle. With the ledger's writes grouped by account, 20,000 operations now write
only ~17 MiB of log: the store here resets past 8 MiB (the shipped limit is 128 MiB), so
that without resets these operations would pass the bound about twice over.

The bound: a checkpoint pass resets the WAL once it is above
``SqliteStore.WAL_LIMIT_BYTES`` (8 MiB for this store); past twice the limit the commit thread waits
for the pass, so the file can exceed 16 MiB only by the batch committed just before
that check (a group commit of at most 256 transactions, a few MiB here). 24 MiB is
twice the limit plus one such batch with margin.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from pathlib import Path

import anyio
import pytest

from bourse.ports.stores import Hold, UsageRecord
from bourse.storage.sqlite import SqliteStore
from tests.support.ledgers import watched

pytestmark = pytest.mark.anyio

OPERATIONS = 60_000
"""Ledger operations: half hold placements, half settlements with a usage record."""
CONCURRENCY = 50
WAL_LIMIT_BYTES = 8 * 1024 * 1024
WAL_BOUND_BYTES = 3 * WAL_LIMIT_BYTES
IDLE_BOUND_BYTES = 64 * 1024
"""After an idle pass the WAL is truncated (empty); a few pages are tolerated."""


class WalSampler:
    """Samples the WAL file size every few milliseconds on a thread; keeps the peak."""

    def __init__(self, wal: Path) -> None:
        self.wal = wal
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wal-sampler", daemon=True)

    def size(self) -> int:
        try:
            return os.path.getsize(self.wal)
        except FileNotFoundError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.size())
            self._stop.wait(0.002)

    def __enter__(self) -> WalSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.size())


async def _ledger_load(store: SqliteStore, pairs: int) -> None:
    left = pairs

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            hold_id, request_id, now = "h_" + secrets.token_hex(8), "r_" + secrets.token_hex(8), time.time()
            await store.place_hold(
                Hold(hold_id, "acct", request_id, 1_000, "open", product="p", created_at=now)
            )
            usage = UsageRecord(request_id, "acct", "p", now, "ok", 600, {"usage": {"completion_tokens": 12}})
            await store.settle(hold_id, 600, usage, time.time())

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def test_the_wal_stays_bounded_under_sustained_writes_and_shrinks_when_idle(tmp_path: Path) -> None:
    with watched(tmp_path, None):  # the suite's ledger check runs on the store's books after
        await _bounded_then_emptied(tmp_path)


async def _bounded_then_emptied(tmp_path: Path) -> None:
    path = tmp_path / "bourse.db"
    store = SqliteStore(path)
    store.IDLE_CHECKPOINT_S = 0.2
    store.WAL_LIMIT_BYTES = WAL_LIMIT_BYTES
    await store.open()
    try:
        await store.create_account("acct", 10**12, time.time())
        with WalSampler(Path(str(path) + "-wal")) as wal:
            t0 = time.monotonic()
            await _ledger_load(store, OPERATIONS // 2)
            elapsed = time.monotonic() - t0
        assert wal.peak <= WAL_BOUND_BYTES, f"WAL peaked at {wal.peak / 2**20:.1f} MiB in {elapsed:.1f}s"
        account = await store.account("acct")
        assert account is not None and account.balance_micros == 10**12 - 600 * (OPERATIONS // 2)
        # idle: the next pass truncates the WAL
        for _ in range(200):  # up to 10 s
            if wal.size() <= IDLE_BOUND_BYTES:
                break
            await anyio.sleep(0.05)
        assert wal.size() <= IDLE_BOUND_BYTES, f"idle WAL is {wal.size() / 2**20:.1f} MiB"
    finally:
        await store.close()
