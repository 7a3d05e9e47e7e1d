"""Which gateway instance owns what, over SQLite and PostgreSQL: claiming the
unfinished jobs of a previous life or of a replica whose lease lapsed, and
reconciling this instance's own holds from before a crash."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from bourse.ports.stores import Hold, Job
from tests.support.databases import StoreFactory

NOW = 1_700_000_000.0


def mk_job(owner: str | None, status: str = "queued", at: float = NOW) -> Job:
    return Job(
        id="job_" + secrets.token_hex(6),
        account_id="a",
        key_id="k",
        endpoint="/v1/chat/completions",
        body={"model": "m", "messages": []},
        status=status,  # type: ignore[arg-type]
        request_id="chatcmpl-" + secrets.token_hex(6),
        bid=1.0,
        created_at=at,
        expires_at=at + 3600,
        owner=owner,
    )


def mk_hold(owner: str) -> Hold:
    return Hold(
        id="h_" + secrets.token_hex(6), account_id="a", request_id="r_" + secrets.token_hex(6),
        amount_micros=100, state="open", owner=owner, product="p", created_at=NOW,
    )  # fmt: skip


@pytest.mark.anyio
async def test_claim_jobs_by_lapsed_lease_and_own_previous_life(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        await s.heartbeat("me", 30)
        await s.heartbeat("alive", 30)
        await s.heartbeat("dead", -1)  # lapsed a second ago, on the database's clock
        mine, alive, dead, orphan = (
            mk_job("me", at=NOW + 1),
            mk_job("alive", at=NOW + 2),
            mk_job("dead", at=NOW + 3),
            mk_job(None, at=NOW),
        )
        done = mk_job("dead", status="succeeded")
        for j in (mine, alive, dead, orphan, done):
            await s.put_job(j)

        # replicas, on a sweep: only the lapsed owner's and the ownerless, oldest first
        got = await s.claim_jobs("me", all_others=False)
        assert [j.id for j in got] == [orphan.id, dead.id]
        assert all(j.owner == "me" for j in got)
        assert (await s.job(dead.id)).owner == "me"
        assert (await s.job(alive.id)).owner == "alive"
        # claimed once: a second sweep finds nothing new
        assert await s.claim_jobs("me", all_others=False) == []
        # at start-up, this instance's own jobs from before the crash come too
        got = await s.claim_jobs("me", all_others=False, include_own=True)
        assert {j.id for j in got} == {mine.id, orphan.id, dead.id}
        # one node at start-up: everything unfinished
        got = await s.claim_jobs("me", all_others=True, include_own=True)
        assert {j.id for j in got} == {mine.id, alive.id, orphan.id, dead.id}
        assert done.id not in {j.id for j in got}


@pytest.mark.anyio
async def test_two_instances_never_claim_one_job(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.heartbeat("x", 30)
        await s.heartbeat("y", 30)
        jobs = [mk_job("dead", at=NOW + i) for i in range(30)]
        for j in jobs:
            await s.put_job(j)
        a, b = await asyncio.gather(s.claim_jobs("x", all_others=False), s.claim_jobs("y", all_others=False))
        ids_a, ids_b = {j.id for j in a}, {j.id for j in b}
        assert ids_a.isdisjoint(ids_b)
        assert ids_a | ids_b == {j.id for j in jobs}


@pytest.mark.anyio
async def test_own_holds_from_a_previous_life_are_reconciled_at_start(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        await s.heartbeat("me", 30)
        await s.heartbeat("alive", 30)
        mine, theirs = mk_hold("me"), mk_hold("alive")
        for h in (mine, theirs):
            await s.place_hold(h)
        assert await s.reconcile_orphans("me", all_others=False) == 0
        assert await s.reconcile_orphans("me", all_others=False, include_own=True) == 1
        assert (await s.hold(mine.id)).state == "reconciling"
        assert (await s.hold(theirs.id)).state == "open"
        t = await s.totals()
        assert t.credits_micros == t.balances_micros + t.holds_micros + t.revenue_micros


@pytest.mark.anyio
async def test_the_hold_sweeper_reconciles_only_the_named_holds_of_its_own(
    store_factory: StoreFactory,
) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        await s.heartbeat("me", 30)
        await s.heartbeat("alive", 30)
        unheld, held, theirs = mk_hold("me"), mk_hold("me"), mk_hold("alive")
        for h in (unheld, held, theirs):
            await s.place_hold(h)
        assert set(await s.open_hold_ids("me", 100)) == {unheld.id, held.id}
        assert len(await s.open_hold_ids("me", 1)) == 1
        # another owner's hold named by mistake is not touched, nor one closed meanwhile
        assert await s.reconcile_orphans("me", all_others=False, hold_ids=[unheld.id, theirs.id]) == 1
        assert await s.reconcile_orphans("me", all_others=False, hold_ids=[unheld.id]) == 0
        assert await s.reconcile_orphans("me", all_others=False, hold_ids=[]) == 0
        states = {h.id: (await s.hold(h.id)).state for h in (unheld, held, theirs)}
        assert states == {unheld.id: "reconciling", held.id: "open", theirs.id: "open"}
        assert await s.open_hold_ids("me", 100) == [held.id]
        t = await s.totals()
        assert t.credits_micros == t.balances_micros + t.holds_micros + t.revenue_micros
