"""An account's spend cap by period (issue 37, item 4), run over every adapter (SQLite
and PostgreSQL): every hold of the account, whichever key placed it, is counted on the
cap in the hold's own transaction; past it the hold is refused with
AccountBudgetExceeded and nothing is taken; what a closed hold did not charge comes back
to the period it was counted in, and only to it; a new period starts the count at zero
by itself; many holds at once never pass the cap, alone or group-committed; and the cap
is set at creation or later, with the key's cap counted beside it.

Period numbers are the caller's (:func:`bourse.domain.periods.cap_period`): the store
counts whatever number a hold carries, so a "new day" here is the next number.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from typing import Any

import pytest

from bourse.domain.periods import MONTHS, cap_period
from bourse.ports.budgets import AccountBudgetExceeded, KeyBudgetExceeded
from bourse.ports.stores import AccountClosed, ApiKey, Hold, InsufficientFunds, UnknownAccount, audit_entry
from bourse.storage.audit import SqlAuditLog
from bourse.storage.schema import migrations
from tests.contract.test_stores import NOW, acct, balanced, mk_hold
from tests.support.databases import StoreFactory

pytestmark = pytest.mark.anyio


def held(account: str, amount: int, period: int | None, *, key_id: str | None = None,
         key_period: int | None = None) -> Hold:  # fmt: skip
    """A hold counted on the account's cap in ``period`` (and on its key's in ``key_period``)."""
    return dataclasses.replace(
        mk_hold(account, amount), key_id=key_id, spend_period=key_period, account_period=period
    )


async def spend(s: Any, account_id: str) -> tuple[int, int]:
    a = await acct(s, account_id)
    return a.spend_micros, a.spend_period


async def test_an_account_cap_counts_every_keys_holds_and_gets_back_what_was_not_charged(
    store_factory: StoreFactory,
) -> None:
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW, spend_cap_micros=1_000, spend_cap_period="total")
        a = await acct(s, "a")
        assert (a.spend_cap_micros, a.spend_cap_period, a.spend_micros) == (1_000, "total", 0)
        for k in ("k1", "k2"):
            await s.create_key(ApiKey(id=k, account_id="a", created_at=NOW), "h" + k)
        h1, h2 = held("a", 400, 0, key_id="k1"), held("a", 400, 0, key_id="k2")
        await s.place_hold(h1)
        await s.place_hold(h2)
        with pytest.raises(AccountBudgetExceeded) as exc:
            await s.place_hold(held("a", 201, 0, key_id="k1"))
        assert (exc.value.cap_micros, exc.value.spent_micros, exc.value.period) == (1_000, 800, "total")
        assert (await acct(s, "a")).balance_micros == 100_000 - 800  # the refused hold took nothing
        assert await spend(s, "a") == (800, 0)
        await balanced(s)

        await s.settle(h1.id, 100, None, NOW + 1)  # 300 not charged: back on the cap
        assert await spend(s, "a") == (500, 0)
        h3 = held("a", 500, 0)  # a hold of no key counts too
        await s.place_hold(h3)  # exactly the cap
        assert await spend(s, "a") == (1_000, 0)
        await s.to_reconciling(h2.id, None, "lost", NOW + 2)  # still held: still counted
        assert await spend(s, "a") == (1_000, 0)
        with pytest.raises(AccountBudgetExceeded):
            await s.place_hold(held("a", 1, 0, key_id="k2"))
        await s.release(h2.id, None, NOW + 3)
        await s.release(h3.id, None, NOW + 3)
        assert await spend(s, "a") == (100, 0)  # what h1 charged
        stored = await s.hold(h3.id)
        assert stored is not None and stored.account_period == 0
        await balanced(s)

        # an account without a cap counts nothing, whatever the caller passed
        await s.create_account("free", 100_000, NOW)
        hn = held("free", 50_000, 0)
        await s.place_hold(hn)
        stored = await s.hold(hn.id)
        assert stored is not None and stored.account_period is None
        await s.settle(hn.id, 10, None, NOW + 4)
        assert await spend(s, "free") == (0, 0)
        await balanced(s)


async def test_a_daily_account_cap_starts_again_each_day_and_yesterdays_holds_stay_yesterdays(
    store_factory: StoreFactory,
) -> None:
    day = 19_000
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW, spend_cap_micros=1_000, spend_cap_period="day")
        yesterday, charged_late = held("a", 600, day), held("a", 300, day)
        await s.place_hold(yesterday)
        await s.place_hold(charged_late)
        with pytest.raises(AccountBudgetExceeded) as exc:
            await s.place_hold(held("a", 101, day))
        assert (exc.value.spent_micros, exc.value.period) == (900, "day")
        today = held("a", 1_000, day + 1)  # a new day: the whole cap again, with no job run
        await s.place_hold(today)
        assert await spend(s, "a") == (1_000, day + 1)
        # yesterday's holds closed today give nothing back to today's count
        await s.release(yesterday.id, None, NOW + 1)
        await s.settle(charged_late.id, 100, None, NOW + 1)
        assert await spend(s, "a") == (1_000, day + 1)
        with pytest.raises(AccountBudgetExceeded) as exc:
            await s.place_hold(held("a", 1, day + 1))
        assert exc.value.spent_micros == 1_000
        await s.settle(today.id, 600, None, NOW + 2)
        assert await spend(s, "a") == (600, day + 1)
        # a later day whose first hold is refused by the balance leaves the count as it was
        await s.update_account("a", {"spend_cap_micros": 10**9})
        with pytest.raises(InsufficientFunds):
            await s.place_hold(held("a", 200_000, day + 2))
        assert await spend(s, "a") == (600, day + 1)
        await balanced(s)


async def test_a_key_cap_and_its_accounts_count_together_and_a_refusal_undoes_both(
    store_factory: StoreFactory,
) -> None:
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW, spend_cap_micros=1_000, spend_cap_period="total")
        await s.create_key(ApiKey(id="kc", account_id="a", created_at=NOW, spend_cap_micros=500,
                                  spend_cap_period="total"), "hc")  # fmt: skip
        await s.create_key(ApiKey(id="kn", account_id="a", created_at=NOW), "hn")
        await s.place_hold(held("a", 400, 0, key_id="kc", key_period=0))
        with pytest.raises(KeyBudgetExceeded):  # the key's cap first: the account's untouched
            await s.place_hold(held("a", 200, 0, key_id="kc", key_period=0))
        assert await spend(s, "a") == (400, 0)
        await s.place_hold(held("a", 550, 0, key_id="kn"))
        with pytest.raises(AccountBudgetExceeded):  # the key's count (it fit) is given back
            await s.place_hold(held("a", 100, 0, key_id="kc", key_period=0))
        key = await s.key("kc")
        assert key is not None and key.spend_micros == 400
        assert await spend(s, "a") == (950, 0)
        await balanced(s)


async def test_holds_at_once_never_pass_an_account_cap_alone_or_group_committed(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    amount, fits, attempts = 100, 20, 60
    async with store_factory() as s:
        batches: list[int] = []
        write_many = s._write_many

        async def counted(items: list[Any]) -> Any:
            batches.append(len(items))
            return await write_many(items)

        monkeypatch.setattr(s, "_write_many", counted)
        cap = amount * fits + amount - 1
        await s.create_account("a", 1_000_000, NOW, spend_cap_micros=cap, spend_cap_period="month")
        keys = ["k0", "k1", "k2"]
        for i, k in enumerate(keys):  # one key capped far above: both caps counted in each batch
            cap_k = 10**9 if i == 0 else None
            key = ApiKey(id=k, account_id="a", created_at=NOW, spend_cap_micros=cap_k,
                         spend_cap_period="total" if i == 0 else None)  # fmt: skip
            await s.create_key(key, "h" + k)
        month = MONTHS + 24_323
        holds = [held("a", amount, month, key_id=keys[i % 3], key_period=0 if i % 3 == 0 else None)
                 for i in range(attempts)]  # fmt: skip
        results = await asyncio.gather(*(s.place_hold(h) for h in holds), return_exceptions=True)
        assert [r for r in results if r is not None and not isinstance(r, AccountBudgetExceeded)] == []
        ok = [h for h, r in zip(holds, results, strict=True) if r is None]
        assert len(ok) == fits
        assert await spend(s, "a") == (amount * fits, month)
        assert (await acct(s, "a")).open_holds_micros == amount * fits
        k0 = await s.key("k0")
        assert k0 is not None and k0.spend_micros == amount * sum(1 for h in ok if h.key_id == "k0")
        await asyncio.gather(*(s.settle(h.id, amount // 2, None, NOW + 1) for h in ok))
        assert await spend(s, "a") == (amount // 2 * fits, month)
        more = await asyncio.gather(*(s.place_hold(held("a", amount, month)) for _ in range(attempts)),
                                    return_exceptions=True)  # fmt: skip
        assert sum(r is None for r in more) == (cap - amount // 2 * fits) // amount
        assert all(r is None or isinstance(r, AccountBudgetExceeded) for r in more)
        assert (await acct(s, "a")).spend_micros <= cap
        assert max(batches) > 1, batches  # holds group-committed, each counted as if alone
        await balanced(s)


async def test_an_accounts_cap_is_set_changed_and_removed(store_factory: StoreFactory) -> None:
    december = 1_796_083_200.0  # 2026-12-01 UTC
    async with store_factory() as s:
        await s.create_account("a", 100_000, NOW)
        audit = SqlAuditLog(s)
        entry = audit_entry("operator:ann", "account.update", "a", {"spend_cap_micros": 1_000})
        a = await s.update_account("a", {"spend_cap_micros": 1_000}, audit=entry)
        assert (a.spend_cap_micros, a.spend_cap_period) == (1_000, "total")  # a first cap: total
        assert [e.actor for e in await audit.list(action="account.update")] == ["operator:ann"]
        month = cap_period("month", december)
        await s.update_account("a", {"spend_cap_period": "month"})
        old = held("a", 900, month)
        await s.place_hold(old)
        # a new kind of period starts at zero; the month's hold gives back to its month only
        a = await s.update_account("a", {"spend_cap_period": "day", "spend_cap_micros": 2_000})
        assert (a.spend_cap_micros, a.spend_cap_period, a.spend_micros) == (2_000, "day", 900)
        day = cap_period("day", december)
        await s.place_hold(held("a", 2_000, day))
        await s.release(old.id, None, NOW + 1)
        assert await spend(s, "a") == (2_000, day)
        # a lower cap keeps the count: the next hold is refused until the period turns
        await s.update_account("a", {"spend_cap_micros": 1_500})
        with pytest.raises(AccountBudgetExceeded) as exc:
            await s.place_hold(held("a", 1, day))
        assert (exc.value.cap_micros, exc.value.spent_micros) == (1_500, 2_000)
        a = await s.update_account("a", {"spend_cap_micros": None, "spend_cap_period": None})
        assert (a.spend_cap_micros, a.spend_cap_period) == (None, None)
        free = held("a", 5_000, day)  # no cap: not counted
        await s.place_hold(free)
        assert (await s.hold(free.id)) is not None and (await s.hold(free.id)).account_period is None
        with pytest.raises(UnknownAccount):
            await s.update_account("nobody", {"spend_cap_micros": 1})
        await s.close_account("a", "gone", NOW + 2)
        with pytest.raises(AccountClosed):
            await s.update_account("a", {"spend_cap_micros": 1})
        await balanced(s)


async def test_a_key_read_carries_its_accounts_cap_period(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10, NOW, spend_cap_micros=5, spend_cap_period="week")
        await s.create_key(ApiKey(id="k", account_id="a", created_at=NOW), "hk")
        by_hash, by_id = await s.key_by_hash("hk"), await s.key("k")
        assert by_hash is not None and by_hash.account_cap_period == "week"
        assert by_id is not None and by_id.account_cap_period == "week"
        await s.update_account("a", {"spend_cap_micros": None, "spend_cap_period": None})
        assert (await s.key_by_hash("hk")).account_cap_period is None


async def test_the_account_caps_migration_keeps_every_account_uncapped(store_factory: StoreFactory) -> None:
    """Migration 15 on a ledger at version 14 with an account, a key and an open hold:
    the account keeps its money and gets no cap (a count of 0), the hold counts on no
    account cap, and the database refuses a cap of 0 or a period it does not know."""
    statements = [st for v, sts in migrations() if v <= 14 for st in sts]
    rows = [
        "INSERT INTO accounts (id, balance_micros, credited_micros, pending_micros, created_at) "
        "VALUES ('a', 60, 100, 40, 1)",
        "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ('c', 'a', 100, '', 1)",
        "INSERT INTO holds (id, account_id, request_id, amount_micros, charged_micros, state, owner, product, "
        "created_at, updated_at) VALUES ('h', 'a', 'r', 40, 0, 'open', 'gw', 'p', 1, 1)",
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)",
        *(f"INSERT INTO schema_migrations (version, applied_at) VALUES ({v}, 1)" for v in range(1, 15)),
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
        assert await s.migrate() == max(v for v, _ in migrations())
        a = await acct(s, "a")
        assert (a.balance_micros, a.open_holds_micros, a.spend_cap_micros, a.spend_cap_period) == (
            60,
            40,
            None,
            None,
        )
        h = await s.hold("h")
        assert h is not None and h.account_period is None
        await s.release("h", None, NOW)
        assert await spend(s, "a") == (0, 0)
        for bad in ({"spend_cap_micros": 0}, {"spend_cap_micros": 5, "spend_cap_period": "year"}):
            with pytest.raises(Exception, match=r"(?i)check"):
                await s.update_account("a", bad)
        await balanced(s)
