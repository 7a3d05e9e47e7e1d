"""The reporting port (``bourse.storage.reports.SqlReports``) over SQLite and PostgreSQL:
accounts, usage rows with every filter and the keyset cursor, spend by bucket and
key, jobs of one account or all."""

from __future__ import annotations

from typing import Any

import pytest

from bourse.ports.reports import UsageFilter
from bourse.ports.stores import Hold, Job, UsageRecord
from bourse.storage.reports import SqlReports
from tests.support.databases import StoreFactory

pytestmark = pytest.mark.anyio

T0 = 1_700_000_040.0
"""A whole minute (so the 60 s buckets below start at T0)."""


def _usage(
    rid: str, account: str, key: str, product: str, at: float, cost: int, outcome: str = "ok"
) -> UsageRecord:
    doc: dict[str, Any] = {"id": rid, "object": "bourse.usage", "key_id": key, "outcome": outcome}
    return UsageRecord(rid, account, product, at, outcome, cost, doc)


async def _seed(store: Any) -> None:
    for acc, credit in (("bravo", 2_000_000), ("alpha", 1_000_000)):
        await store.create_account(acc, credit, T0)
    await store.place_hold(Hold("h1", "alpha", "r-held", 300, "open", owner="gw", product="p", created_at=T0))
    rows = [
        _usage("r1", "alpha", "key_a1", "p", T0 + 1, 10),
        _usage("r2", "alpha", "key_a2", "p", T0 + 2, 20),
        _usage("r3", "alpha", "key_a1", "q", T0 + 61, 40, "error"),
        _usage("r4", "bravo", "key_b1", "p", T0 + 62, 80),
        _usage("r5", "bravo", "key_b1", "p", T0 + 62, 160),
    ]
    for r in rows:
        await store.put_usage(r)


async def test_accounts_usage_rows_and_filters(store_factory: StoreFactory) -> None:
    async with store_factory() as store:
        await _seed(store)
        reports = SqlReports(store)
        accounts = await reports.accounts(100)
        assert [a.id for a in accounts] == ["alpha", "bravo"]
        assert accounts[0].open_holds_micros == 300
        assert accounts[0].balance_micros == 1_000_000 - 300

        every = await reports.usage_rows(UsageFilter(), limit=100)
        assert [r.request_id for r in every] == ["r5", "r4", "r3", "r2", "r1"]
        cases: list[tuple[UsageFilter, list[str]]] = [
            (UsageFilter(account_id="alpha"), ["r3", "r2", "r1"]),
            (UsageFilter(key_id="key_a1"), ["r3", "r1"]),
            (UsageFilter(product="q"), ["r3"]),
            (UsageFilter(outcome="error"), ["r3"]),
            (UsageFilter(since=T0 + 2, until=T0 + 61), ["r3", "r2"]),
            (UsageFilter(account_id="bravo", key_id="key_a1"), []),
        ]
        for where, ids in cases:
            got = await reports.usage_rows(where, limit=100)
            assert [r.request_id for r in got] == ids, where

        # the keyset cursor walks every row once, ties on created_at included
        seen: list[str] = []
        after = None
        while True:
            page = await reports.usage_rows(UsageFilter(), limit=2, after=after)
            seen += [r.request_id for r in page]
            if len(page) < 2:
                break
            after = page[-1].request_id
        assert seen == ["r5", "r4", "r3", "r2", "r1"]
        assert await reports.usage_rows(UsageFilter(), limit=2, after="no-such-request") == []


async def test_spend_by_bucket_account_and_key(store_factory: StoreFactory) -> None:
    async with store_factory() as store:
        await _seed(store)
        reports = SqlReports(store)
        points = await reports.spend(UsageFilter(), 60)
        got = {(p.t, p.account_id, p.key_id): (p.cost_micros, p.requests) for p in points}
        assert got == {
            (T0, "alpha", "key_a1"): (10, 1),
            (T0, "alpha", "key_a2"): (20, 1),
            (T0 + 60, "alpha", "key_a1"): (40, 1),
            (T0 + 60, "bravo", "key_b1"): (240, 2),
        }
        assert [p.t for p in points] == sorted(p.t for p in points)
        mine = await reports.spend(UsageFilter(account_id="bravo"), 3600)
        assert [(p.account_id, p.key_id, p.cost_micros) for p in mine] == [("bravo", "key_b1", 240)]


async def test_jobs_of_one_account_or_all(store_factory: StoreFactory) -> None:
    async with store_factory() as store:
        await _seed(store)
        for i, (acc, status) in enumerate((("alpha", "queued"), ("bravo", "succeeded"), ("alpha", "failed"))):
            await store.put_job(
                Job(
                    id=f"job_{i}",
                    account_id=acc,
                    key_id="k",
                    endpoint="/v1/chat/completions",
                    body={},
                    status="queued",
                    request_id=f"rj{i}",
                    bid=0.1,
                    created_at=T0 + i,
                    expires_at=T0 + 999,
                )
            )
            await store.update_job(f"job_{i}", status=status)
        reports = SqlReports(store)
        assert [j.id for j in await reports.jobs(None, None, 10)] == ["job_2", "job_1", "job_0"]
        assert [j.id for j in await reports.jobs("alpha", None, 10)] == ["job_2", "job_0"]
        assert [j.id for j in await reports.jobs(None, "succeeded", 10)] == ["job_1"]
