"""The storage contract, run over every adapter (``sqlite`` and ``postgres``).

Every ledger test ends each step by checking the invariant
``credits = balances + open/reconciling holds + revenue`` (``totals().balanced``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bourse.domain.periods import MONTHS, WEEKS, CapPeriod, cap_period
from bourse.ports.stores import (
    AccountExists,
    ApiKey,
    ChargeAboveHold,
    Hold,
    HoldNotOpen,
    InsufficientFunds,
    KeyBudgetExceeded,
    KeyRevoked,
    StoredResponse,
    UnknownAccount,
    UnknownKey,
    UsageRecord,
    audit_entry,
)
from bourse.storage.audit import SqlAuditLog
from bourse.storage.executor import IntegrityError
from bourse.storage.schema import migrations
from tests.support.databases import StoreFactory, with_database

NOW = 1_700_000_000.0
LATEST = max(v for v, _ in migrations())


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(6)


def mk_hold(
    account_id: str, amount: int, *, owner: str = "gw-me", product: str = "prod", hold_id: str | None = None
) -> Hold:
    return Hold(
        id=hold_id or _id("h_"),
        account_id=account_id,
        request_id=_id("req_"),
        amount_micros=amount,
        state="open",
        owner=owner,
        product=product,
        created_at=NOW,
    )


def mk_usage(
    account_id: str,
    request_id: str,
    *,
    cost: int = 0,
    at: float = NOW,
    outcome: str = "ok",
    record: dict[str, Any] | None = None,
) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        account_id=account_id,
        product="prod",
        created_at=at,
        outcome=outcome,
        cost_micros=cost,
        record=record if record is not None else {"id": request_id, "cost": cost},
    )


async def balanced(store: Any) -> None:
    """The ledger balances, and every account's totals (kept on its row by the ledger's
    transactions) add up to the sums over the holds and credits they stand for."""
    t = await store.totals()
    assert t.balanced, t
    accounts = await store.accounts_page(limit=1000, after=None)
    for a in accounts:
        assert (
            a.credited_micros
            == a.balance_micros + a.open_holds_micros + a.reconciling_micros + a.spent_micros
        ), a
    kept = (
        sum(a.credited_micros for a in accounts),
        sum(a.balance_micros for a in accounts),
        sum(a.open_holds_micros + a.reconciling_micros for a in accounts),
        sum(a.spent_micros for a in accounts),
    )
    assert kept == (t.credits_micros, t.balances_micros, t.holds_micros, t.revenue_micros), (kept, t)


async def acct(store: Any, account_id: str) -> Any:
    a = await store.account(account_id)
    assert a is not None, account_id
    return a


# -- migrations ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_migrations_are_idempotent(store_factory: StoreFactory) -> None:
    async with store_factory() as s1:
        assert await s1.migrate() == LATEST
        await s1.create_account("a", 5, NOW)
    async with store_factory() as s2:  # open() migrates again on the same database
        assert await s2.migrate() == LATEST
        assert (await acct(s2, "a")).balance_micros == 5
        assert await s2.migrate() == LATEST
        await balanced(s2)


@pytest.mark.anyio
async def test_the_account_totals_migration_fills_them_from_the_ledger(tmp_path: Path) -> None:
    """Migration 10 gives a ledger that had no account totals on its rows (version 9)
    its pending, posted and credited amounts from its holds, pruned charges and credits."""
    from bourse.storage.sqlite import SqliteStore

    path = tmp_path / "v9.db"
    store = SqliteStore(path)
    await store.open()
    try:
        await store.create_account("a", 10_000, NOW)
        await store.create_account("b", 500, NOW)
        await store.credit("a", 2_000, NOW, "top-up")
        settled, released, pending, odd = (mk_hold("a", n) for n in (1_000, 700, 300, 200))
        for h in (settled, released, pending, odd):
            await store.place_hold(h)
        await store.settle(settled.id, 600, None, NOW + 1)
        await store.release(released.id, None, NOW + 1)
        await store.to_reconciling(odd.id, None, "unknown", NOW + 1)
        before = [await acct(store, x) for x in ("a", "b")]
    finally:
        await store.close()
    with sqlite3.connect(path) as db:  # back to version 9: the columns of 10 and later gone
        for column in ("pending_micros", "posted_micros", "credited_micros", "status", "status_reason"):
            db.execute(f"ALTER TABLE accounts DROP COLUMN {column}")
        db.execute("DROP TABLE operators")  # version 13's
        db.execute("DROP TABLE market_versions")  # version 14's
        for column in (
            "spend_cap_micros",
            "spend_cap_period",
            "spend_micros",
            "spend_period",
        ):  # version 15's
            db.execute(f"ALTER TABLE accounts DROP COLUMN {column}")
        db.execute("ALTER TABLE holds DROP COLUMN account_period")
        db.execute("DROP TABLE pruned_account_spend")
        db.execute("DROP TABLE admin_keys")  # version 16's
        db.execute("DROP TABLE dashboard_secret")
        db.execute("DROP INDEX holds_closed_request")  # version 19's
        db.execute("DROP INDEX holds_closed_account")
        db.execute("CREATE INDEX holds_request ON holds(request_id)")
        for index in ("holds_open", "holds_reconciling", "holds_closed"):  # version 17's
            db.execute(f"DROP INDEX {index}")
        db.execute("CREATE INDEX holds_owner ON holds(owner, state)")
        db.execute("CREATE INDEX holds_account ON holds(account_id, state)")
        db.execute("CREATE INDEX holds_state_age ON holds(state, updated_at)")
        db.execute("DROP TABLE webhook_secrets")  # version 18's
        db.execute("ALTER TABLE accounts ADD COLUMN webhook_secret TEXT")
        db.execute("DELETE FROM schema_migrations WHERE version >= 10")
    store = SqliteStore(path)
    await store.open()
    try:
        after = [await acct(store, x) for x in ("a", "b")]
        assert after == before
        a = after[0]
        assert (a.credited_micros, a.balance_micros, a.open_holds_micros, a.reconciling_micros, a.spent_micros) == (
            12_000, 12_000 - 600 - 300 - 200, 300, 200, 600,
        )  # fmt: skip
        await balanced(store)
    finally:
        await store.close()


# -- accounts and credits --------------------------------------------------------------------


@pytest.mark.anyio
async def test_create_account_and_credit(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        a = await s.create_account("alice", 1_000, NOW)
        assert (a.id, a.balance_micros, a.credited_micros, a.open_holds_micros) == ("alice", 1_000, 1_000, 0)
        assert a.created_at == NOW
        await balanced(s)

        with pytest.raises(AccountExists):
            await s.create_account("alice", 50, NOW)
        assert (await acct(s, "alice")).balance_micros == 1_000
        await balanced(s)

        z = await s.create_account("zero", 0, NOW)
        assert (z.balance_micros, z.credited_micros) == (0, 0)
        await balanced(s)

        a = await s.credit("alice", 500, NOW + 1, memo="top-up")
        assert (a.balance_micros, a.credited_micros) == (1_500, 1_500)
        await balanced(s)

        with pytest.raises(UnknownAccount):
            await s.credit("nobody", 10, NOW)
        assert await s.account("nobody") is None
        for bad in (0, -1):
            with pytest.raises(ValueError):
                await s.credit("alice", bad, NOW)
        with pytest.raises(ValueError):
            await s.create_account("neg", -1, NOW)
        assert await s.account("neg") is None
        assert (await acct(s, "alice")).balance_micros == 1_500
        await balanced(s)


# -- holds ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_place_hold(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 1_000, NOW)
        h = mk_hold("a", 300)
        await s.place_hold(h)
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros) == (700, 300)
        got = await s.hold(h.id)
        assert got is not None
        assert (got.state, got.amount_micros, got.charged_micros, got.account_id) == ("open", 300, 0, "a")
        assert (got.request_id, got.owner, got.product) == (h.request_id, h.owner, h.product)
        await balanced(s)

        with pytest.raises(InsufficientFunds) as exc:
            await s.place_hold(mk_hold("a", 701))
        assert exc.value.balance_micros == 700
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros) == (700, 300)
        await balanced(s)

        with pytest.raises(UnknownAccount):
            await s.place_hold(mk_hold("ghost", 1))
        with pytest.raises(ValueError):
            await s.place_hold(mk_hold("a", -1))
        await balanced(s)

        await s.place_hold(mk_hold("a", 700))  # exactly the balance
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros) == (0, 1_000)
        assert len(await s.holds("open", account_id="a")) == 2
        await balanced(s)


@pytest.mark.anyio
async def test_settle_charges_at_most_the_hold_and_writes_usage(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 1_000, NOW)
        h = mk_hold("a", 400)
        await s.place_hold(h)
        u = mk_usage("a", h.request_id, cost=150, record={"usage": {"total_tokens": 7}, "id": h.request_id})
        out = await s.settle(h.id, 150, u, NOW + 1)
        assert (out.id, out.state, out.charged_micros, out.amount_micros) == (h.id, "settled", 150, 400)
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros, a.spent_micros) == (850, 0, 150)
        assert await s.usage("a", h.request_id) == u  # written by the same call
        await balanced(s)

        agains: list[Callable[[], Awaitable[object]]] = [
            lambda: s.settle(h.id, 10, None, NOW + 2),
            lambda: s.release(h.id, None, NOW + 2),
            lambda: s.to_reconciling(h.id, None, "late", NOW + 2),
        ]
        for again in agains:  # each told what the hold already is
            with pytest.raises(HoldNotOpen) as refused:
                await again()
            assert (refused.value.hold_id, refused.value.state) == (h.id, "settled")
        a = await acct(s, "a")
        assert (a.balance_micros, a.spent_micros) == (850, 150)
        await balanced(s)

        big = mk_hold("a", 200)
        await s.place_hold(big)
        # a charge above the hold is refused, never clamped: the hold stays open as it was
        with pytest.raises(ChargeAboveHold) as above:
            await s.settle(big.id, 999_999, None, NOW + 3)
        assert (above.value.charge_micros, above.value.amount_micros) == (999_999, 200)
        assert (await s.hold(big.id)).state == "open"
        assert (await acct(s, "a")).open_holds_micros == 200
        out = await s.settle(big.id, 200, None, NOW + 3)  # the whole hold is within it
        assert out.charged_micros == 200
        a = await acct(s, "a")
        assert (a.balance_micros, a.spent_micros) == (650, 350)
        await balanced(s)

        zero = mk_hold("a", 100)
        await s.place_hold(zero)
        assert (await s.settle(zero.id, 0, None, NOW + 4)).charged_micros == 0
        neg = mk_hold("a", 100)
        await s.place_hold(neg)
        assert (await s.settle(neg.id, -50, None, NOW + 4)).charged_micros == 0  # never pays the account
        a = await acct(s, "a")
        assert (a.balance_micros, a.spent_micros, a.open_holds_micros) == (650, 350, 0)
        await balanced(s)

        with pytest.raises(HoldNotOpen) as missing:
            await s.settle("h_missing", 1, None, NOW)
        assert missing.value.state is None
        await balanced(s)


@pytest.mark.anyio
async def test_release_returns_everything(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 1_000, NOW)
        h = mk_hold("a", 300)
        await s.place_hold(h)
        u = mk_usage("a", h.request_id, outcome="upstream_error")
        out = await s.release(h.id, u, NOW + 1)
        assert (out.state, out.charged_micros) == ("released", 0)
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros, a.spent_micros) == (1_000, 0, 0)
        assert await s.usage("a", h.request_id) == u
        await balanced(s)
        with pytest.raises(HoldNotOpen) as again:
            await s.release(h.id, None, NOW + 2)
        assert again.value.state == "released"
        with pytest.raises(HoldNotOpen) as again:
            await s.settle(h.id, 100, None, NOW + 2)
        assert again.value.state == "released"
        with pytest.raises(HoldNotOpen) as again:
            await s.release("h_missing", None, NOW)
        assert again.value.state is None
        assert (await acct(s, "a")).balance_micros == 1_000
        await balanced(s)


@pytest.mark.anyio
async def test_to_reconciling_keeps_the_money_held_until_an_operator_decides(
    store_factory: StoreFactory,
) -> None:
    async with store_factory() as s:
        await s.create_account("a", 1_000, NOW)
        h1, h2 = mk_hold("a", 300), mk_hold("a", 200)
        await s.place_hold(h1)
        await s.place_hold(h2)

        out = await s.to_reconciling(h1.id, None, "gateway crashed", NOW + 1)
        assert (out.state, out.note, out.charged_micros) == ("reconciling", "gateway crashed", 0)
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros, a.reconciling_micros) == (500, 200, 300)
        assert [x.id for x in await s.holds("reconciling", account_id="a")] == [h1.id]
        await balanced(s)

        with pytest.raises(HoldNotOpen):  # already reconciling
            await s.to_reconciling(h1.id, None, "again", NOW + 2)
        assert (await s.hold(h1.id)).note == "gateway crashed"

        u = mk_usage("a", h2.request_id, outcome="no_usage")
        await s.to_reconciling(h2.id, u, "missing usage block", NOW + 1)
        assert await s.usage("a", h2.request_id) == u
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros, a.reconciling_micros) == (500, 0, 500)
        await balanced(s)

        # the operator settles one and releases the other
        settled = await s.settle(h1.id, 120, None, NOW + 10)
        assert (settled.state, settled.charged_micros) == ("settled", 120)
        a = await acct(s, "a")
        assert (a.balance_micros, a.reconciling_micros, a.spent_micros) == (680, 200, 120)
        await balanced(s)
        released = await s.release(h2.id, None, NOW + 10)
        assert released.state == "released"
        a = await acct(s, "a")
        assert (a.balance_micros, a.reconciling_micros, a.open_holds_micros, a.spent_micros) == (
            880,
            0,
            0,
            120,
        )
        await balanced(s)
        with pytest.raises(HoldNotOpen):
            await s.settle(h1.id, 1, None, NOW + 11)
        assert await s.holds("reconciling") == []
        await balanced(s)


@pytest.mark.anyio
async def test_reconcile_orphans_all_others(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        mine = [mk_hold("a", 100, owner="me") for _ in range(2)]
        others = [mk_hold("a", 100, owner="other1"), mk_hold("a", 100, owner="other2")]
        done = mk_hold("a", 100, owner="other1")
        for h in [*mine, *others, done]:
            await s.place_hold(h)
        await s.settle(done.id, 40, None, NOW)
        await balanced(s)

        assert await s.reconcile_orphans("me", all_others=True) == 2
        for h in mine:
            assert (await s.hold(h.id)).state == "open"
        for h in others:
            got = await s.hold(h.id)
            assert got is not None and got.state == "reconciling" and got.note
        assert (await s.hold(done.id)).state == "settled"
        a = await acct(s, "a")
        assert (a.open_holds_micros, a.reconciling_micros, a.balance_micros) == (200, 200, 10_000 - 400 - 40)
        await balanced(s)
        assert await s.reconcile_orphans("me", all_others=True) == 0
        await balanced(s)


@pytest.mark.anyio
async def test_reconcile_orphans_by_lapsed_lease(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        await s.heartbeat("me", 30)
        await s.heartbeat("alive", 30)
        await s.heartbeat("dead", 5)
        await s.heartbeat("dead", -1)  # a renewal that moved the lease back (last write wins): lapsed
        hm, ha, hd = (
            mk_hold("a", 100, owner="me"),
            mk_hold("a", 100, owner="alive"),
            mk_hold("a", 100, owner="dead"),
        )
        for h in (hm, ha, hd):
            await s.place_hold(h)

        assert await s.reconcile_orphans("me", all_others=False) == 1
        states = {h.owner: (await s.hold(h.id)).state for h in (hm, ha, hd)}
        assert states == {"me": "open", "alive": "open", "dead": "reconciling"}
        await balanced(s)

        # "alive" renews for a moment; it stops renewing and its lease lapses (on the
        # database's clock: the test's own time is never asked)
        await s.heartbeat("alive", 0.3)
        assert await s.reconcile_orphans("me", all_others=False) == 0
        await asyncio.sleep(0.4)
        assert await s.reconcile_orphans("me", all_others=False) == 1
        states = {h.owner: (await s.hold(h.id)).state for h in (hm, ha, hd)}
        assert states == {"me": "open", "alive": "reconciling", "dead": "reconciling"}
        a = await acct(s, "a")
        assert (a.open_holds_micros, a.reconciling_micros, a.balance_micros) == (100, 200, 9_700)
        await balanced(s)


# -- keys ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_keys_round_trip(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 0, NOW)
        full = ApiKey(
            id="k1",
            account_id="a",
            products=("chat-small", "chat-large"),
            rpm=60,
            tpm=10_000,
            max_streams=3,
            created_at=NOW,
        )
        bare = ApiKey(id="k2", account_id="a", created_at=NOW + 1)
        empty = ApiKey(id="k3", account_id="a", products=(), created_at=NOW + 2)
        await s.create_key(full, "hash-1")
        await s.create_key(bare, "hash-2")
        await s.create_key(empty, "hash-3")
        assert await s.key_by_hash("hash-1") == full
        assert await s.key_by_hash("hash-2") == bare
        assert await s.key_by_hash("hash-3") == empty
        assert await s.key_by_hash("hash-unknown") is None
        with pytest.raises(UnknownAccount):
            await s.create_key(ApiKey(id="k4", account_id="ghost"), "hash-4")
        assert await s.key_by_hash("hash-4") is None


@pytest.mark.anyio
async def test_key_lifecycle_fields_listing_revoke_and_touch(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 0, NOW)
        await s.create_account("b", 0, NOW)
        full = ApiKey(
            id="k-full", account_id="a", name="ci deploy", created_at=NOW, expires_at=NOW + 3600,
            spend_cap_micros=5_000, spend_cap_period="day",
        )  # fmt: skip
        await s.create_key(full, "h-full")
        for i in range(5):
            await s.create_key(ApiKey(id=f"k-a{i}", account_id="a", created_at=NOW + 1 + i), f"h-a{i}")
        await s.create_key(ApiKey(id="k-b", account_id="b", created_at=NOW + 10), "h-b")
        got = await s.key("k-full")
        assert got == full
        assert (got.spend_micros, got.revoked_at, got.last_used_at, got.grace_until) == (0, None, None, None)
        assert await s.key("k-none") is None

        # newest first, keyset pages, per account or all
        first = await s.keys_page("a", limit=4, after=None)
        assert [k.id for k in first] == ["k-a4", "k-a3", "k-a2", "k-a1"]
        rest = await s.keys_page("a", limit=4, after=first[-1].id)
        assert [k.id for k in rest] == ["k-a0", "k-full"]
        assert [k.id for k in await s.keys_page(None, limit=2, after=None)] == ["k-b", "k-a4"]
        assert await s.keys_page("a", limit=4, after="k-unknown") == []

        revoked = await s.revoke_key("k-a0", NOW + 20)
        assert revoked.revoked_at == NOW + 20
        again = await s.revoke_key("k-a0", NOW + 30)  # keeps the first time
        assert again.revoked_at == NOW + 20
        found = await s.key_by_hash("h-a0")
        assert found is not None and found.revoked_at == NOW + 20
        with pytest.raises(UnknownKey):
            await s.revoke_key("k-none", NOW)

        await s.touch_keys({"k-a1": NOW + 50, "k-a2": NOW + 40})
        await s.touch_keys({"k-a1": NOW + 45})  # never backwards
        assert [(await s.key(k)).last_used_at for k in ("k-a1", "k-a2")] == [NOW + 50, NOW + 40]


@pytest.mark.anyio
async def test_rotation_keeps_the_old_secret_for_its_grace_period(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 0, NOW)
        await s.create_key(ApiKey(id="k", account_id="a", created_at=NOW), "h0")
        out = await s.rotate_key("k", "h1", NOW + 60, NOW + 1)
        assert out.id == "k" and out.grace_until is None
        old = await s.key_by_hash("h0")
        assert old is not None and (old.id, old.grace_until) == ("k", NOW + 60)
        new = await s.key_by_hash("h1")
        assert new is not None and (new.id, new.grace_until) == ("k", None)

        # a second rotation: both earlier secrets keep their own grace; none for grace 0
        await s.rotate_key("k", "h2", NOW + 2, NOW + 2)
        assert await s.key_by_hash("h1") is None
        old = await s.key_by_hash("h0")
        assert old is not None and old.grace_until == NOW + 60
        new = await s.key_by_hash("h2")
        assert new is not None and new.grace_until is None

        await s.revoke_key("k", NOW + 3)
        with pytest.raises(KeyRevoked):
            await s.rotate_key("k", "h3", NOW + 100, NOW + 4)
        assert await s.key_by_hash("h3") is None
        still = await s.key_by_hash("h0")  # found, and revoked: the caller refuses it
        assert still is not None and still.revoked_at == NOW + 3
        with pytest.raises(UnknownKey):
            await s.rotate_key("k-none", "h4", NOW + 100, NOW)


def mk_key_hold(account: str, amount: int, key_id: str, period: int | None) -> Hold:
    return dataclasses.replace(mk_hold(account, amount), key_id=key_id, spend_period=period)


async def key_spend(s: Any, key_id: str) -> tuple[int, int]:
    k = await s.key(key_id)
    assert k is not None
    return k.spend_micros, k.spend_period


@pytest.mark.anyio
async def test_spend_cap_counts_holds_and_gets_back_what_was_not_charged(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW)
        capped = ApiKey(
            id="kc", account_id="a", created_at=NOW, spend_cap_micros=1_000, spend_cap_period="total"
        )
        await s.create_key(capped, "hc")
        h1, h2 = mk_key_hold("a", 400, "kc", 0), mk_key_hold("a", 400, "kc", 0)
        await s.place_hold(h1)
        await s.place_hold(h2)
        with pytest.raises(KeyBudgetExceeded) as exc:
            await s.place_hold(mk_key_hold("a", 201, "kc", 0))
        assert (exc.value.cap_micros, exc.value.spent_micros, exc.value.period) == (1_000, 800, "total")
        assert (await acct(s, "a")).balance_micros == 100_000 - 800  # the refused hold took nothing
        assert await key_spend(s, "kc") == (800, 0)
        await balanced(s)

        await s.settle(h1.id, 100, None, NOW + 1)  # 300 not charged: back on the cap
        assert await key_spend(s, "kc") == (500, 0)
        h3 = mk_key_hold("a", 500, "kc", 0)
        await s.place_hold(h3)  # exactly the cap
        assert await key_spend(s, "kc") == (1_000, 0)
        await s.to_reconciling(h2.id, None, "lost", NOW + 2)  # still held: still counted
        assert await key_spend(s, "kc") == (1_000, 0)
        await s.release(h2.id, None, NOW + 3)
        await s.release(h3.id, None, NOW + 3)
        assert await key_spend(s, "kc") == (100, 0)  # what h1 charged
        stored = await s.hold(h3.id)
        assert stored is not None and (stored.key_id, stored.spend_period) == ("kc", 0)
        await balanced(s)

        # a key without a cap counts nothing, whatever the caller passed
        await s.create_key(ApiKey(id="kn", account_id="a", created_at=NOW), "hn")
        hn = mk_key_hold("a", 50_000, "kn", 0)
        await s.place_hold(hn)
        stored = await s.hold(hn.id)
        assert stored is not None and (stored.key_id, stored.spend_period) == ("kn", None)
        assert await key_spend(s, "kn") == (0, 0)
        await s.settle(hn.id, 10, None, NOW + 4)
        assert await key_spend(s, "kn") == (0, 0)
        await balanced(s)


@pytest.mark.anyio
async def test_a_daily_cap_starts_again_each_day(store_factory: StoreFactory) -> None:
    day = 19_000
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW)
        key = ApiKey(id="kd", account_id="a", created_at=NOW, spend_cap_micros=1_000, spend_cap_period="day")
        await s.create_key(key, "hd")
        yesterday = mk_key_hold("a", 900, "kd", day)
        await s.place_hold(yesterday)
        with pytest.raises(KeyBudgetExceeded):
            await s.place_hold(mk_key_hold("a", 101, "kd", day))
        today = mk_key_hold("a", 1_000, "kd", day + 1)  # a new day: the whole cap again
        await s.place_hold(today)
        assert await key_spend(s, "kd") == (1_000, day + 1)
        await s.release(yesterday.id, None, NOW + 1)  # yesterday's hold gives nothing back to today
        assert await key_spend(s, "kd") == (1_000, day + 1)
        with pytest.raises(KeyBudgetExceeded) as exc:
            await s.place_hold(mk_key_hold("a", 1, "kd", day + 1))
        assert (exc.value.spent_micros, exc.value.period) == (1_000, "day")
        await s.settle(today.id, 600, None, NOW + 2)
        assert await key_spend(s, "kd") == (600, day + 1)
        await balanced(s)


@pytest.mark.anyio
async def test_a_weekly_and_a_monthly_cap_start_again_each_period(store_factory: StoreFactory) -> None:
    """The store counts any period number as the day's (the numbers are the caller's,
    :func:`bourse.domain.periods.cap_period`): a new one starts the count again."""
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW)
        periods: tuple[tuple[CapPeriod, int], ...] = (("week", WEEKS + 2_918), ("month", MONTHS + 24_323))
        for kind, period in periods:
            key = ApiKey(id=f"k{kind}", account_id="a", created_at=NOW, spend_cap_micros=1_000,
                         spend_cap_period=kind)  # fmt: skip
            await s.create_key(key, f"h{kind}")
            assert (await s.key(key.id)).spend_cap_period == kind
            await s.place_hold(mk_key_hold("a", 1_000, key.id, period))
            with pytest.raises(KeyBudgetExceeded) as exc:
                await s.place_hold(mk_key_hold("a", 1, key.id, period))
            assert (exc.value.spent_micros, exc.value.period) == (1_000, kind)
            await s.place_hold(mk_key_hold("a", 1_000, key.id, period + 1))
            assert await key_spend(s, key.id) == (1_000, period + 1)
        await balanced(s)


@pytest.mark.anyio
async def test_a_cap_period_of_another_kind_starts_the_count_again(store_factory: StoreFactory) -> None:
    """A key counted by month in December 2026, then by day: on the day numbered as that
    month was before the kinds had ranges of their own (day 24 323, 5 August 2036), the
    day's count starts at zero and the month's hold gives nothing back to it."""
    december, that_day = 1_796_083_200.0, 24_323 * 86_400.0  # 2026-12-01, 2036-08-05 UTC
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW)
        await s.create_key(ApiKey(id="k", account_id="a", created_at=NOW, spend_cap_micros=1_000,
                                  spend_cap_period="month"), "h")  # fmt: skip
        month = mk_key_hold("a", 900, "k", cap_period("month", december))
        await s.place_hold(month)
        await s.update_key("k", {"spend_cap_period": "day"})
        day = mk_key_hold("a", 1_000, "k", cap_period("day", that_day))  # the whole cap
        await s.place_hold(day)
        assert await key_spend(s, "k") == (1_000, cap_period("day", that_day))
        await s.release(month.id, None, NOW + 1)  # gives back to December 2026 only
        assert await key_spend(s, "k") == (1_000, cap_period("day", that_day))
        await balanced(s)


@pytest.mark.anyio
async def test_the_cap_periods_migration_keeps_every_key(store_factory: StoreFactory) -> None:
    """Migration 12 replaces ``spend_cap_period`` (its CHECK allowed total and day) on a
    ledger at version 11 with keys of each kind: each key keeps its cap, period and
    count, the grace rows that name the keys stay, and week and month are then stored
    while another word is still refused by the database."""
    statements = [st for v, sts in migrations() if v <= 11 for st in sts]
    rows = [
        "INSERT INTO accounts (id, balance_micros, created_at) VALUES ('a', 100, 1)",
        "INSERT INTO api_keys (id, key_hash, account_id, created_at, spend_cap_micros, spend_cap_period, "
        "spend_micros, spend_period) VALUES ('kt', 'ht', 'a', 1, 500, 'total', 40, 0), "
        "('kd', 'hd', 'a', 2, 700, 'day', 60, 20427), ('kn', 'hn', 'a', 3, NULL, NULL, 0, 0)",
        "INSERT INTO api_key_grace (key_hash, key_id, valid_until) VALUES ('old', 'kd', 9e9)",
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)",
        *(f"INSERT INTO schema_migrations (version, applied_at) VALUES ({v}, 1)" for v in range(1, 12)),
    ]
    if store_factory.kind == "sqlite":
        with sqlite3.connect(store_factory.target) as db:
            for st in statements + rows:
                db.execute(st)
    else:
        import psycopg

        with psycopg.connect(store_factory.target) as pg:
            for st in statements + rows:
                pg.execute(st)
    async with store_factory() as s:
        assert await s.migrate() == LATEST
        got = {k: await s.key(k) for k in ("kt", "kd", "kn")}
        assert {k: (v.spend_cap_micros, v.spend_cap_period, v.spend_micros, v.spend_period, v.created_at)
                for k, v in got.items() if v is not None} == {
            "kt": (500, "total", 40, 0, 1.0), "kd": (700, "day", 60, 20427, 2.0), "kn": (None, None, 0, 0, 3.0),
        }  # fmt: skip
        assert await s.key_by_hash("old") is not None  # the grace row still finds kd
        await s.update_key("kd", {"spend_cap_period": "week"})
        await s.update_key("kt", {"spend_cap_period": "month"})
        assert [(await s.key(k)).spend_cap_period for k in ("kd", "kt")] == ["week", "month"]
        with pytest.raises(IntegrityError, match=r"(?i)check"):
            await s.update_key("kn", {"spend_cap_period": "year"})


@pytest.mark.anyio
async def test_50_concurrent_holds_never_pass_a_key_cap(store_factory: StoreFactory) -> None:
    amount, fits, attempts = 100, 20, 50
    async with store_factory() as s:
        await s.create_account("a", 1_000_000, NOW)
        cap = amount * fits + amount - 1
        await s.create_key(
            ApiKey(id="k", account_id="a", created_at=NOW, spend_cap_micros=cap, spend_cap_period="total"),
            "h",
        )
        holds = [mk_key_hold("a", amount, "k", 0) for _ in range(attempts)]
        results = await asyncio.gather(*(s.place_hold(h) for h in holds), return_exceptions=True)
        unexpected = [r for r in results if r is not None and not isinstance(r, KeyBudgetExceeded)]
        assert unexpected == []
        ok = [h for h, r in zip(holds, results, strict=True) if r is None]
        assert len(ok) == fits
        assert await key_spend(s, "k") == (amount * fits, 0)
        assert (await acct(s, "a")).open_holds_micros == amount * fits
        await asyncio.gather(*(s.settle(h.id, amount // 2, None, NOW + 1) for h in ok))
        assert await key_spend(s, "k") == (amount // 2 * fits, 0)
        await balanced(s)


@pytest.mark.anyio
async def test_accounts_page(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        for name in ("c", "a", "d", "b"):
            await s.create_account(name, 10, NOW)
        await s.place_hold(mk_hold("b", 4))
        first = await s.accounts_page(limit=3, after=None)
        assert [a.id for a in first] == ["a", "b", "c"]
        assert (first[1].balance_micros, first[1].open_holds_micros, first[1].credited_micros) == (6, 4, 10)
        assert [a.id for a in await s.accounts_page(limit=3, after="c")] == ["d"]


@pytest.mark.anyio
async def test_admin_actions_are_audited_in_their_own_transaction(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        log = SqlAuditLog(s)
        await s.create_account("a", 1_000, NOW, audit=audit_entry("op", "account.create", "a", {"c": 1}, NOW))
        await s.credit(
            "a", 5, NOW + 1, audit=audit_entry("op", "account.credit", "a", {"amount": 5}, NOW + 1)
        )
        with pytest.raises(UnknownAccount):  # refused: its entry goes with it
            await s.credit(
                "ghost", 5, NOW + 2, audit=audit_entry("op", "account.credit", "ghost", {}, NOW + 2)
            )
        h = mk_hold("a", 100)
        await s.place_hold(h)
        await s.settle(h.id, 30, None, NOW + 3, audit=audit_entry("op", "hold.settle", h.id, {}, NOW + 3))
        with pytest.raises(HoldNotOpen):
            await s.release(h.id, None, NOW + 4, audit=audit_entry("op", "hold.release", h.id, {}, NOW + 4))
        await s.create_key(
            ApiKey(id="k", account_id="a", created_at=NOW),
            "h",
            audit=audit_entry("op", "key.create", "k", {}, NOW + 5),
        )
        await s.rotate_key("k", "h2", NOW, NOW + 6, audit=audit_entry("op", "key.rotate", "k", {}, NOW + 6))
        await s.revoke_key("k", NOW + 7, audit=audit_entry("op", "key.revoke", "k", {"why": "leak"}, NOW + 7))
        with pytest.raises(KeyRevoked):
            await s.rotate_key(
                "k", "h3", NOW, NOW + 8, audit=audit_entry("op", "key.rotate", "k", {}, NOW + 8)
            )
        mine = await log.record("dashboard", "hold.note", h.id, {"note": "seen"})

        entries = await log.list()
        assert [e.action for e in entries] == [
            "hold.note", "key.revoke", "key.rotate", "key.create", "hold.settle", "account.credit", "account.create",
        ]  # fmt: skip
        assert entries[0] == mine
        revoke = entries[1]
        assert (revoke.actor, revoke.target, dict(revoke.detail), revoke.at) == (
            "op",
            "k",
            {"why": "leak"},
            NOW + 7,
        )
        assert [e.action for e in await log.list(target="k")] == ["key.revoke", "key.rotate", "key.create"]
        assert [e.target for e in await log.list(action="account.credit")] == ["a"]
        page = await log.list(limit=3)
        assert [e.id for e in await log.list(limit=3, after=page[-1].id)] == [e.id for e in entries[3:6]]
        await balanced(s)


# -- usage --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_usage_paging(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        recs = [
            mk_usage("a", f"req_{i}", cost=i, at=NOW + i, record={"i": i, "nested": {"x": [i]}})
            for i in range(1, 6)
        ]
        for r in random.sample(recs, len(recs)):
            await s.put_usage(r)
        other = mk_usage("b", "req_b", at=NOW + 3)
        await s.put_usage(other)

        def ids(page: Any) -> list[str]:
            return [r.request_id for r in page]

        page = await s.usage_page("a", limit=10, before=None, since=None, until=None)
        assert list(page) == sorted(
            recs, key=lambda r: r.created_at, reverse=True
        )  # newest first, full records
        first = await s.usage_page("a", limit=2, before=None, since=None, until=None)
        assert ids(first) == ["req_5", "req_4"]
        second = await s.usage_page("a", limit=2, before=first[-1].created_at, since=None, until=None)
        assert ids(second) == ["req_3", "req_2"]
        third = await s.usage_page("a", limit=2, before=second[-1].created_at, since=None, until=None)
        assert ids(third) == ["req_1"]
        window = await s.usage_page("a", limit=10, before=None, since=NOW + 2, until=NOW + 4)
        assert ids(window) == ["req_4", "req_3", "req_2"]
        both = await s.usage_page("a", limit=10, before=NOW + 4, since=NOW + 2, until=None)
        assert ids(both) == ["req_3", "req_2"]

        # another account's record is invisible
        assert "req_b" not in ids(page)
        assert await s.usage("a", "req_b") is None
        assert await s.usage("b", "req_1") is None
        assert ids(await s.usage_page("b", limit=10, before=None, since=None, until=None)) == ["req_b"]
        assert await s.usage("b", "req_b") == other

        # put_usage of the same request replaces its outcome
        updated = mk_usage("a", "req_3", cost=33, at=NOW + 3, outcome="client_cancelled", record={"v": 2})
        await s.put_usage(updated)
        assert await s.usage("a", "req_3") == updated


# -- idempotency ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_idempotency(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        ttl = 60.0
        assert (await s.idem_begin("a", "k", "h1", NOW, ttl)).state == "new"
        assert (await s.idem_begin("a", "k", "h1", NOW + 1, ttl)).state == "in_flight"
        assert (await s.idem_begin("a", "k", "h2", NOW + 1, ttl)).state == "conflict"
        assert (await s.idem_begin("b", "k", "h2", NOW + 1, ttl)).state == "new"  # keys are per account

        resp = StoredResponse(
            201, {"content-type": "application/json", "x-request-id": "req_1"}, b'{"ok":true}\x00\xff'
        )
        await s.idem_complete("a", "k", resp)
        done = await s.idem_begin("a", "k", "h1", NOW + 2, ttl)
        assert done.state == "done"
        assert done.response is not None
        assert (done.response.status, dict(done.response.headers), done.response.body) == (
            resp.status,
            dict(resp.headers),
            resp.body,
        )
        assert (await s.idem_begin("a", "k", "h2", NOW + 2, ttl)).state == "conflict"

        # an empty body survives too
        assert (await s.idem_begin("a", "empty", "h", NOW, ttl)).state == "new"
        await s.idem_complete("a", "empty", StoredResponse(204, {}, b""))
        e = await s.idem_begin("a", "empty", "h", NOW + 1, ttl)
        assert e.state == "done" and e.response == StoredResponse(204, {}, b"")

        # None forgets the key: a retry starts fresh
        assert (await s.idem_begin("a", "k2", "h1", NOW, ttl)).state == "new"
        await s.idem_complete("a", "k2", None)
        assert (await s.idem_begin("a", "k2", "h1", NOW + 1, ttl)).state == "new"

        # expired keys start fresh, whether in flight or done
        assert (await s.idem_begin("a", "k3", "h1", NOW, 10)).state == "new"
        assert (await s.idem_begin("a", "k3", "h1", NOW + 5, 10)).state == "in_flight"
        assert (await s.idem_begin("a", "k3", "h9", NOW + 11, 10)).state == "new"
        assert (await s.idem_begin("a", "k3", "h9", NOW + 12, 10)).state == "in_flight"
        assert (await s.idem_begin("a", "k", "h2", NOW + ttl + 1, ttl)).state == "new"


async def idempotency_rows(store: Any) -> dict[tuple[str, str], str]:
    """Every stored idempotency key (``(account, key) -> state``), read straight from the table."""

    def read(db: Any) -> dict[tuple[str, str], str]:
        rows = db.fetch("SELECT account_id, key, state FROM idempotency")
        return {(r["account_id"], r["key"]): r["state"] for r in rows}

    out: dict[tuple[str, str], str] = await store._read(read)
    return out


@pytest.mark.anyio
async def test_purge_deletes_only_expired_idempotency_keys(store_factory: StoreFactory) -> None:
    """The table shrinks to the keys still within their TTL, ``limit`` at a time; those
    keep their state (in flight, or done with their answer)."""
    async with store_factory() as s:
        for i in range(5):  # expire at NOW + 10
            assert (await s.idem_begin("a", f"old{i}", "h", NOW, 10)).state == "new"
        assert (await s.idem_begin("b", "old-done", "h", NOW, 10)).state == "new"
        await s.idem_complete("b", "old-done", StoredResponse(200, {}, b"{}"))
        assert (await s.idem_begin("a", "live", "h", NOW, 100)).state == "new"  # expires at NOW + 100
        assert (await s.idem_begin("b", "live-done", "h", NOW, 100)).state == "new"
        await s.idem_complete("b", "live-done", StoredResponse(201, {"x": "1"}, b"kept"))
        assert len(await idempotency_rows(s)) == 8

        assert await s.purge_idempotency(NOW + 5, 1000) == 0  # nothing expired yet
        assert await s.purge_idempotency(NOW + 50, 4) == 4  # a batch at most
        assert len(await idempotency_rows(s)) == 4
        assert await s.purge_idempotency(NOW + 50, 4) == 2
        assert await s.purge_idempotency(NOW + 50, 4) == 0
        assert await idempotency_rows(s) == {("a", "live"): "in_flight", ("b", "live-done"): "done"}

        assert (await s.idem_begin("a", "live", "h", NOW + 60, 100)).state == "in_flight"
        done = await s.idem_begin("b", "live-done", "h", NOW + 60, 100)
        assert done.state == "done" and done.response == StoredResponse(201, {"x": "1"}, b"kept")


# -- concurrency ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_concurrent_holds_never_overdraw(store_factory: StoreFactory) -> None:
    amount, affordable, attempts = 1_000, 30, 100
    credit = amount * affordable + amount - 1  # affords exactly 30 holds
    async with store_factory() as s:
        await s.create_account("a", credit, NOW)
        holds = [mk_hold("a", amount, owner=f"gw-{i % 3}") for i in range(attempts)]
        results = await asyncio.gather(*(s.place_hold(h) for h in holds), return_exceptions=True)
        ok = [h for h, r in zip(holds, results, strict=True) if r is None]
        refused = [r for r in results if isinstance(r, InsufficientFunds)]
        unexpected = [r for r in results if r is not None and not isinstance(r, InsufficientFunds)]
        assert unexpected == []
        assert (len(ok), len(refused)) == (affordable, attempts - affordable)
        assert all(0 <= r.balance_micros < amount for r in refused)
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros) == (amount - 1, amount * affordable)
        await balanced(s)

        rng = random.Random(1234)
        charges = {h.id: rng.randint(0, amount) for h in ok}
        settled = await asyncio.gather(*(s.settle(h.id, charges[h.id], None, NOW + 1) for h in ok))
        for out in settled:
            assert out.state == "settled"
            assert out.charged_micros == charges[out.id]
        total = sum(out.charged_micros for out in settled)
        assert total <= credit
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros, a.spent_micros) == (credit - total, 0, total)
        assert await s.holds("open", account_id="a") == []
        await balanced(s)


@pytest.mark.anyio
async def test_concurrent_closes_of_one_hold_exactly_one_wins(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 1_000, NOW)
        h = mk_hold("a", 500)
        await s.place_hold(h)
        calls = [s.settle(h.id, 100 + i, None, NOW) for i in range(10)]
        calls += [s.release(h.id, None, NOW) for _ in range(5)]
        calls += [s.to_reconciling(h.id, None, "x", NOW) for _ in range(5)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        wins = [r for r in results if isinstance(r, Hold)]
        others = [r for r in results if not isinstance(r, Hold)]
        assert all(isinstance(r, HoldNotOpen) for r in others), others
        # one close wins; a move to reconciling may precede it (the hold is then still closable)
        final = await s.hold(h.id)
        assert final is not None
        closes = [w for w in wins if w.state in ("settled", "released")]
        assert len(closes) <= 1 and len(wins) - len(closes) <= 1
        a = await acct(s, "a")
        if final.state == "settled":
            assert a.balance_micros == 1_000 - final.charged_micros
        elif final.state == "released":
            assert a.balance_micros == 1_000
        else:
            assert final.state == "reconciling" and a.balance_micros == 500
        await balanced(s)


# -- property: random operation sequences ---------------------------------------------------------


@dataclass
class ModelHold:
    id: str
    account: str
    amount: int
    state: str = "open"
    charged: int = 0


@dataclass
class Model:
    balances: dict[str, int] = field(default_factory=dict)
    credited: dict[str, int] = field(default_factory=dict)
    holds: list[ModelHold] = field(default_factory=list)


N_ACCOUNTS = 3
_acct_idx = st.integers(0, N_ACCOUNTS - 1)
_hold_idx = st.integers(0, 1_000)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("create"), _acct_idx, st.integers(0, 3_000)),
        st.tuples(st.just("credit"), _acct_idx, st.integers(1, 3_000)),
        st.tuples(st.just("hold"), _acct_idx, st.integers(0, 2_500)),
        st.tuples(st.just("settle"), _hold_idx, st.integers(0, 3_000)),
        st.tuples(st.just("release"), _hold_idx, st.just(0)),
        st.tuples(st.just("reconcile"), _hold_idx, st.just(0)),
    ),
    min_size=1,
    max_size=30,
)


async def _check(s: Any, m: Model, names: list[str]) -> None:
    t = await s.totals()
    assert t.balanced, t
    for name in names:
        a = await s.account(name)
        if name not in m.balances:
            assert a is None
            continue
        assert a is not None
        assert a.balance_micros >= 0
        mine = [h for h in m.holds if h.account == name]
        expect = (
            m.balances[name],
            m.credited[name],
            sum(h.amount for h in mine if h.state == "open"),
            sum(h.amount for h in mine if h.state == "reconciling"),
            sum(h.charged for h in mine if h.state == "settled"),
        )
        got = (a.balance_micros, a.credited_micros, a.open_holds_micros, a.reconciling_micros, a.spent_micros)
        assert got == expect, (name, got, expect)


async def _account_op(s: Any, m: Model, name: str, op: str, value: int) -> None:
    """create / credit / hold on account ``name``, in the store and in the model."""
    known = name in m.balances
    if op == "create":
        if known:
            with pytest.raises(AccountExists):
                await s.create_account(name, value, NOW)
            return
        await s.create_account(name, value, NOW)
        m.balances[name] = m.credited[name] = value
    elif op == "credit":
        if not known:
            with pytest.raises(UnknownAccount):
                await s.credit(name, value, NOW)
            return
        await s.credit(name, value, NOW)
        m.balances[name] += value
        m.credited[name] += value
    else:
        h = mk_hold(name, value)
        if not known:
            with pytest.raises(UnknownAccount):
                await s.place_hold(h)
        elif value > m.balances[name]:
            with pytest.raises(InsufficientFunds) as exc:
                await s.place_hold(h)
            assert exc.value.balance_micros == m.balances[name]
        else:
            await s.place_hold(h)
            m.balances[name] -= value
            m.holds.append(ModelHold(h.id, name, value))


async def _hold_op(s: Any, m: Model, mh: ModelHold, op: str, value: int) -> None:
    """settle / release / reconcile hold ``mh``, in the store and in the model."""
    if op == "reconcile":
        if mh.state != "open":
            with pytest.raises(HoldNotOpen):
                await s.to_reconciling(mh.id, None, "unknown outcome", NOW)
            return
        out = await s.to_reconciling(mh.id, None, "unknown outcome", NOW)
        assert out.state == "reconciling"
        mh.state = "reconciling"
    elif mh.state not in ("open", "reconciling"):  # a second settle or release
        with pytest.raises(HoldNotOpen) as refused:
            if op == "settle":
                await s.settle(mh.id, value, None, NOW)
            else:
                await s.release(mh.id, None, NOW)
        assert refused.value.state == mh.state
    elif op == "settle" and value > mh.amount:  # refused, the hold as it was
        with pytest.raises(ChargeAboveHold):
            await s.settle(mh.id, value, None, NOW)
    elif op == "settle":
        out = await s.settle(mh.id, value, None, NOW)
        charged = value
        assert (out.state, out.charged_micros) == ("settled", charged)
        mh.state, mh.charged = "settled", charged
        m.balances[mh.account] += mh.amount - charged
    else:
        out = await s.release(mh.id, None, NOW)
        assert (out.state, out.charged_micros) == ("released", 0)
        mh.state = "released"
        m.balances[mh.account] += mh.amount


async def _run_ops(factory: StoreFactory, ops: list[tuple[str, int, int]]) -> None:
    prefix = _id("p")
    names = [f"{prefix}_{i}" for i in range(N_ACCOUNTS)]
    m = Model()
    async with factory() as s:
        for op, idx, value in ops:
            if op in ("create", "credit", "hold"):
                await _account_op(s, m, names[idx], op, value)
            elif m.holds:
                await _hold_op(s, m, m.holds[idx % len(m.holds)], op, value)
            await _check(s, m, names)

        # close every remaining hold (settle the even ones, release the others)
        for i, mh in enumerate(m.holds):
            if mh.state in ("open", "reconciling"):
                if i % 2 == 0:
                    out = await s.settle(mh.id, mh.amount // 2, None, NOW)
                    mh.state, mh.charged = "settled", out.charged_micros
                    m.balances[mh.account] += mh.amount - out.charged_micros
                else:
                    await s.release(mh.id, None, NOW)
                    mh.state = "released"
                    m.balances[mh.account] += mh.amount
        await _check(s, m, names)
        for name in names:
            assert await s.holds("open", account_id=name) == []
            assert await s.holds("reconciling", account_id=name) == []


def test_random_operation_sequences_keep_the_ledger_balanced(store_factory: StoreFactory) -> None:
    # One database per test (fresh databases per example are too slow on PostgreSQL);
    # each example uses its own account ids.
    examples = 40

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ops=OPS)
    def run(ops: list[tuple[str, int, int]]) -> None:
        asyncio.run(_run_ops(store_factory, ops))

    run()


@pytest.mark.anyio
async def test_concurrent_first_use_of_an_idempotency_key(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        results = await asyncio.gather(*(s.idem_begin("a", "k", "h1", NOW, 60) for _ in range(20)))
        states = sorted(r.state for r in results)
        assert states == ["in_flight"] * 19 + ["new"]


@pytest.mark.anyio
async def test_totals_stay_balanced_while_holds_move(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW)
        holds = [mk_hold("a", 700) for _ in range(40)]

        async def life(i: int, h: Hold) -> None:
            await s.place_hold(h)
            if i % 3 == 0:
                await s.settle(h.id, 300, None, NOW)
            elif i % 3 == 1:
                await s.release(h.id, None, NOW)
            else:
                await s.to_reconciling(h.id, None, "x", NOW)

        async def watch() -> list[bool]:
            seen = []
            for _ in range(30):
                seen.append((await s.totals()).balanced)
                await asyncio.sleep(0)
            return seen

        outcome: list[Any] = await asyncio.gather(*(life(i, h) for i, h in enumerate(holds)), watch())
        seen: list[bool] = outcome[-1]
        assert all(seen)
        await balanced(s)


@pytest.mark.anyio
async def test_holds_listing(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        await s.create_account("b", 10_000, NOW)
        ha = [mk_hold("a", 10) for _ in range(5)]
        for h in ha:
            await s.place_hold(h)
        hb = mk_hold("b", 10)
        await s.place_hold(hb)
        await s.settle(ha[0].id, 5, None, NOW)
        await s.release(ha[1].id, None, NOW)
        assert {h.id for h in await s.holds("open", account_id="a")} == {h.id for h in ha[2:]}
        assert {h.id for h in await s.holds(None, account_id="a")} == {h.id for h in ha}
        assert {h.id for h in await s.holds("open")} == {h.id for h in [*ha[2:], hb]}
        assert [h.id for h in await s.holds("settled")] == [ha[0].id]
        assert len(await s.holds(None, limit=2)) == 2
        assert await s.hold("h_missing") is None


@pytest.mark.anyio
async def test_concurrent_first_open_of_one_database(store_factory: StoreFactory) -> None:
    """Several gateways (replicas) starting at once on a new database all migrate it:
    no "table already exists", no "database is locked"."""
    stores = [store_factory.new() for _ in range(6)]
    try:
        results = await asyncio.gather(*(st_.open() for st_ in stores), return_exceptions=True)
        assert [repr(r) for r in results if r is not None] == []
        for st_ in stores:
            assert await st_.migrate() == LATEST
        await stores[0].create_account("a", 1, NOW)
        assert (await acct(stores[-1], "a")).balance_micros == 1
    finally:
        for st_ in stores:
            await st_.close()


@pytest.mark.anyio
async def test_sqlite_open_waits_for_a_briefly_busy_new_database(tmp_path: Path) -> None:
    """SQLite only: a new database file that another connection is writing (another
    process starting on the same file, still in rollback-journal mode) makes ``open()``
    wait (busy timeout), not fail with "database is locked"."""
    from bourse.storage.sqlite import SqliteStore

    path = tmp_path / "busy.db"
    locked, done = threading.Event(), threading.Event()

    def other_process() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("CREATE TABLE other_tool (x INTEGER)")
            locked.set()
            time.sleep(0.3)
            conn.execute("COMMIT")
        finally:
            conn.close()
            done.set()

    threading.Thread(target=other_process, name="other-process", daemon=True).start()
    assert locked.wait(5)
    store = SqliteStore(path)
    try:
        await store.open()
        assert await store.migrate() == LATEST
        await store.create_account("a", 1, NOW)
    finally:
        await store.close()
        done.wait(5)


def _live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.mark.anyio
async def test_failed_open_raises_and_leaves_no_thread_behind(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    """``open()`` on a database it cannot use raises; ``close()`` after it is safe and
    no worker thread is left running (a leaked non-daemon thread keeps the gateway
    process from exiting after a failed start)."""
    if store_factory.kind == "sqlite":
        bad = tmp_path / "not-a-database.db"
        bad.write_bytes(b"this is not an SQLite database file\n" * 200)
        store = StoreFactory("sqlite", str(bad)).new()
    else:
        store = StoreFactory(
            "postgres", with_database(store_factory.target, "bourse_t_missing_" + secrets.token_hex(4))
        ).new()
    before = _live_threads()
    with pytest.raises(Exception):  # noqa: B017 - the driver's own error
        await store.open()
    await store.close()
    await store.close()  # closing twice is harmless
    for _ in range(50):  # let finished workers wind down
        leaked = _live_threads() - before
        if not leaked:
            break
        await asyncio.sleep(0.02)
    assert leaked == set(), f"threads left running after a failed open(): {sorted(t.name for t in leaked)}"


@pytest.mark.anyio
async def test_postgres_transactions_survive_the_server_dropping_every_connection(postgres_dsn: str) -> None:
    """PostgreSQL only: when the server drops every connection of the store (a restart,
    a failover), the next transactions run on new connections; none fails, none is
    applied twice."""
    import psycopg

    from bourse.storage.postgres import PostgresStore

    store = PostgresStore(postgres_dsn, max_size=4)
    await store.open()
    try:
        await store.create_account("a", 1_000, NOW)
        await asyncio.gather(*(store.account("a") for _ in range(32)))  # several connections in use
        with psycopg.connect(postgres_dsn, autocommit=True) as admin:
            dropped = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchone()
        assert dropped is not None and dropped[0] >= 1
        holds = [mk_hold("a", 10) for _ in range(8)]
        await asyncio.gather(*(store.place_hold(h) for h in holds))
        assert (await acct(store, "a")).balance_micros == 1_000 - 80
        assert {h.id for h in await store.holds("open", account_id="a")} == {h.id for h in holds}
        await balanced(store)
    finally:
        await store.close()
