"""The holds' indexes of migration 19 (issue 40), on SQLite and PostgreSQL: a hold
enters the indexes by request and by account at its close only (partial on the
closed states), so PostgreSQL's close, which is no HOT update, adds one entry to each
hold index but the primary key's, not a second one; and what read the non-partial
indexes still finds every hold: the admin's list of an account's holds (each state
from its own index, newest first across them) and retention's check of a request's
other holds.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from typing import Any

import pytest

from bourse.ports.stores import Hold, UsageRecord
from bourse.services.housekeeping import Housekeeping
from tests.support.databases import StoreFactory

pytestmark = pytest.mark.anyio

CLOSED_INDEXES = {"holds_closed_request": "request_id", "holds_closed_account": "account_id, created_at"}


def _hold(account: str, at: float, request_id: str | None = None) -> Hold:
    return Hold("h_" + secrets.token_hex(6), account, request_id or "req_" + secrets.token_hex(6), 100, "open",
                owner="gw", product="p", created_at=at)  # fmt: skip


def _indexes(store_factory: StoreFactory) -> dict[str, str]:
    """The indexes on ``holds`` (the primary key's aside): name -> its definition."""
    if store_factory.kind == "sqlite":
        with sqlite3.connect(store_factory.target) as db:
            found = db.execute(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'holds'"
            )
            return {str(n): str(sql) for n, sql in found if sql is not None}
    import psycopg

    with psycopg.connect(store_factory.target) as pg:
        rows = pg.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'holds'").fetchall()
    return {str(n): str(d) for n, d in rows if not str(n).endswith("_pkey")}


async def test_the_indexes_by_request_and_by_account_hold_the_closed_holds_only(
    store_factory: StoreFactory,
) -> None:
    async with store_factory() as s:
        await s.migrate()
    found = _indexes(store_factory)
    assert "holds_request" not in found and "holds_account_time" not in found, found
    for name, columns in CLOSED_INDEXES.items():
        text = " ".join(found[name].split())
        assert f"({columns})" in text, text
        assert "settled" in text and "released" in text and "open" not in text, text


async def test_an_accounts_holds_are_listed_newest_first_across_their_states(
    store_factory: StoreFactory,
) -> None:
    t = time.time() - 100
    async with store_factory() as s:
        await s.create_account("a", 100_000, t)
        await s.create_account("b", 100_000, t)
        made: list[Hold] = []
        for i, end in enumerate(["settled", "open", "reconciling", "released", "settled", "open"]):
            h = _hold("a", t + i)
            await s.place_hold(h)
            if end == "settled":
                await s.settle(h.id, 10, None, t + i)
            elif end == "released":
                await s.release(h.id, None, t + i)
            elif end == "reconciling":
                await s.to_reconciling(h.id, None, "unknown", t + i)
            made.append(h)
        other = _hold("b", t + 10)
        await s.place_hold(other)
        newest = [h.id for h in reversed(made)]
        assert [h.id for h in await s.holds(None, "a", 100)] == newest
        assert [h.id for h in await s.holds(None, "a", 4)] == newest[:4]
        assert [h.id for h in await s.holds("settled", "a", 100)] == [made[4].id, made[0].id]
        assert [h.id for h in await s.holds("released", "a", 100)] == [made[3].id]
        assert [h.id for h in await s.holds("open", "a", 100)] == [made[5].id, made[1].id]
        assert [h.id for h in await s.holds("reconciling", "a", 100)] == [made[2].id]
        assert [h.id for h in await s.holds("open", None, 100)] == [other.id, made[5].id, made[1].id]
        assert [h.id for h in await s.holds(None, "b", 100)] == [other.id]


async def test_retention_keeps_a_request_while_another_of_its_holds_is_open_or_reconciling(
    store_factory: StoreFactory,
) -> None:
    """A request's old closed hold stays while a later hold of the same request (a
    resumed job's) is open or reconciling: those are found by their own indexes now."""
    now = time.time()
    old = now - 7200
    async with store_factory() as s:
        await s.create_account("a", 100_000, old)
        closed = {}
        later = {}
        for end in ("open", "reconciling", "none"):
            first = _hold("a", old)
            await s.place_hold(first)
            await s.release(first.id, None, old)
            closed[end] = first
            if end != "none":
                second = _hold("a", old, request_id=first.request_id)
                await s.place_hold(second)
                if end == "reconciling":
                    await s.to_reconciling(second.id, None, "unknown", old)
                later[end] = second
        hk = Housekeeping(s, interval_s=60, retention_s=3600, retention_batch=10)
        assert await hk.prune_once() == (1, 0)
        assert await s.hold(closed["none"].id) is None
        for end in ("open", "reconciling"):
            assert await s.hold(closed[end].id) is not None, end
            assert await s.hold(later[end].id) is not None, end
        await s.settle(later["reconciling"].id, 5, UsageRecord(
            later["reconciling"].request_id, "a", "p", old, "completed", 5, {}), old)  # fmt: skip
        assert await hk.prune_once() == (2, 1)  # both holds of that request, and its record
        assert await s.hold(closed["open"].id) is not None
        assert (await s.totals()).balanced


HOLD_INDEX_INSERTS = """
SELECT c.relname, COUNT(*) FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_lsn()) r
JOIN pg_class c ON c.relfilenode = substring(r.block_ref from %s)::oid
WHERE r.resource_manager = 'Btree' AND r.record_type LIKE 'INSERT%%'
  AND c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'holds'::regclass)
GROUP BY c.relname
"""


@pytest.mark.postgres
async def test_a_request_adds_one_entry_to_each_hold_index_but_the_primary_keys_two(
    postgres_dsn: str,
) -> None:
    """PostgreSQL's WAL (pg_walinspect) over a hold's placing and its settle: the
    primary key has two entries (the close is no HOT update: ``state`` is named by the
    partial indexes), every other hold index one. Before migration 19, the indexes by
    request and by account had two each as well."""
    import psycopg

    from bourse.storage.postgres import PostgresStore

    store = PostgresStore(postgres_dsn)
    await store.open()
    try:
        await store.create_account("a", 100_000, time.time())
        with psycopg.connect(postgres_dsn, autocommit=True) as pg:
            pg.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            row: Any = pg.execute("SELECT pg_current_wal_lsn()::text, oid FROM pg_database "
                                  "WHERE datname = current_database()").fetchone()  # fmt: skip
            h = _hold("a", time.time())
            await store.place_hold(h)
            await store.settle(h.id, 10, UsageRecord(h.request_id, "a", "p", time.time(), "completed", 10, {}),
                               time.time())  # fmt: skip
            counts: dict[str, int] = dict(
                pg.execute(HOLD_INDEX_INSERTS, (row[0], f"rel [0-9]+/{int(row[1])}/([0-9]+)")).fetchall()
            )
    finally:
        await store.close()
    assert counts == {
        "holds_pkey": 2,
        "holds_open": 1,
        "holds_closed": 1,
        **dict.fromkeys(CLOSED_INDEXES, 1),
    }, counts
