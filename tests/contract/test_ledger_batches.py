"""The ledger's group commit (storage.batching), run over every adapter.

Writes of one account that queue behind a running one go together, in one
transaction; each must still get exactly the outcome it would have got alone, and the
ledger must stay balanced. The batch functions are wrapped to prove the batches ran.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from bourse.ports.stores import (
    ApiKey,
    ChargeAboveHold,
    Hold,
    HoldNotOpen,
    InsufficientFunds,
    KeyBudgetExceeded,
    UnknownAccount,
    UsageRecord,
    audit_entry,
)
from bourse.storage.executor import IntegrityError, values_list
from tests.support.databases import StoreFactory, hand_off_every_write

NOW = 1_700_000_000.0


def _hold(account_id: str, amount: int, *, key_id: str | None = None, hold_id: str | None = None) -> Hold:
    return Hold(
        id=hold_id or "h_" + secrets.token_hex(6),
        account_id=account_id,
        request_id="req_" + secrets.token_hex(6),
        amount_micros=amount,
        state="open",
        owner="gw-me",
        product="prod",
        created_at=NOW,
        key_id=key_id,
        spend_period=None if key_id is None else 0,
    )


def _usage(hold: Hold, cost: int) -> UsageRecord:
    return UsageRecord(hold.request_id, hold.account_id, "prod", NOW, "ok", cost, {"cost": cost})


def _count(monkeypatch: pytest.MonkeyPatch, store: Any, name: str) -> list[int]:
    """Wrap the store's batch method ``name``; the sizes of the batches it ran. SQLite's
    inline writes are off (a write run on the loop's thread ends before the next one is
    submitted, so none would queue behind it: these tests need the first one to take
    time, on the commit thread)."""
    hand_off_every_write(store)
    sizes: list[int] = []
    real: Callable[[list[Any]], Awaitable[Any]] = getattr(store, name)

    async def counted(items: list[Any]) -> Any:
        sizes.append(len(items))
        return await real(items)

    monkeypatch.setattr(store, name, counted)
    return sizes


async def _balanced(s: Any) -> None:
    t = await s.totals()
    assert t.balanced, t


@pytest.mark.anyio
async def test_a_batch_answers_each_write_as_if_it_ran_alone(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with store_factory() as s:
        batches = _count(monkeypatch, s, "_write_many")
        await s.create_account("a", 100_000, NOW)
        await s.create_key(
            ApiKey(id="kc", account_id="a", created_at=NOW, spend_cap_micros=1_000, spend_cap_period="total"),
            "hc",
        )
        first = _hold("a", 100)
        plain = [_hold("a", 1_000) for _ in range(4)]
        capped_ok, capped_over = _hold("a", 900, key_id="kc"), _hold("a", 200, key_id="kc")
        twin = _hold("a", 5, hold_id=first.id)  # the id of a hold placed just before
        batch = [*plain, capped_ok, capped_over, twin]
        results = await asyncio.gather(
            s.place_hold(first), *(s.place_hold(h) for h in batch), return_exceptions=True
        )
        assert batches == [len(batch)]
        assert results[: 1 + len(plain) + 1] == [None] * (len(plain) + 2)
        assert isinstance(results[-2], KeyBudgetExceeded) and results[-2].spent_micros == 900
        assert isinstance(results[-1], IntegrityError)
        a = await s.account("a")
        assert a is not None
        assert (a.balance_micros, a.open_holds_micros) == (100_000 - 5_000, 5_000)
        key = await s.key("kc")
        assert key is not None and key.spend_micros == 900
        await _balanced(s)

        unknown = await asyncio.gather(
            *(s.place_hold(_hold("zz", 1)) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, UnknownAccount) for r in unknown)

        # closes: settles with usage, a release, one hold closed twice, one already closed
        await s.release(plain[3].id, None, NOW + 1)
        closes_in = [
            s.settle(first.id, 50, _usage(first, 50), NOW + 1),
            s.settle(plain[0].id, 400, _usage(plain[0], 400), NOW + 1),
            s.settle(capped_ok.id, 300, _usage(capped_ok, 300), NOW + 1),
            s.release(plain[1].id, _usage(plain[1], 0), NOW + 1),
            s.settle(plain[2].id, 5_000, None, NOW + 1),
            s.settle(plain[3].id, 10, None, NOW + 1),
        ]
        out = await asyncio.gather(*closes_in, return_exceptions=True)
        # alone: the first, the capped one, the released one (not open); "zz" batched 2
        assert batches == [len(batch), 2, 3]
        charged = [o.charged_micros if isinstance(o, Hold) else o for o in out]
        assert charged[:4] == [50, 400, 300, 0]
        # a charge above its hold is refused in the batch, the others written; a close of
        # a released hold is told so
        assert isinstance(out[4], ChargeAboveHold) and out[4].amount_micros == 1_000, out[4]
        assert isinstance(out[5], HoldNotOpen) and out[5].state == "released", out[5]
        above = await s.hold(plain[2].id)
        assert above is not None and above.state == "open"
        assert (await s.settle(plain[2].id, 1_000, None, NOW + 1)).charged_micros == 1_000
        for h, cost in ((first, 50), (plain[0], 400), (capped_ok, 300), (plain[1], 0)):
            u = await s.usage("a", h.request_id)
            assert u is not None and u.cost_micros == cost
        key = await s.key("kc")
        assert key is not None and key.spend_micros == 300  # 600 unused came back to the cap
        a = await s.account("a")
        assert a is not None
        assert (a.balance_micros, a.open_holds_micros, a.spent_micros) == (100_000 - 1_750, 0, 1_750)
        await _balanced(s)

        # an uncapped batch with an id that exists
        twins = [_hold("a", 1), _hold("a", 1, hold_id=plain[0].id), _hold("a", 1)]
        out = await asyncio.gather(*(s.place_hold(h) for h in twins), return_exceptions=True)
        assert batches[-1] == 2
        assert out[0] is None and isinstance(out[1], IntegrityError) and out[2] is None
        a = await s.account("a")
        assert a is not None and (a.balance_micros, a.open_holds_micros) == (100_000 - 1_752, 2)
        await _balanced(s)


@pytest.mark.anyio
async def test_one_hold_closed_twice_while_its_account_is_busy_closes_once(
    store_factory: StoreFactory,
) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        holds = [_hold("a", 1_000) for _ in range(3)]
        for h in holds:
            await s.place_hold(h)
        out = await asyncio.gather(
            *(s.settle(h.id, 100, None, NOW) for h in holds),
            s.settle(holds[1].id, 700, None, NOW),
            return_exceptions=True,
        )
        assert [o.charged_micros for o in (out[0], out[2]) if isinstance(o, Hold)] == [100, 100]
        won = [o for o in (out[1], out[3]) if isinstance(o, Hold)]  # exactly one close of the twin
        assert len(won) == 1 and any(isinstance(o, HoldNotOpen) for o in (out[1], out[3]))
        a = await s.account("a")
        assert a is not None and a.balance_micros == 10_000 - 200 - won[0].charged_micros
        await _balanced(s)


@pytest.mark.anyio
async def test_a_batch_the_balance_cannot_cover_places_what_fits_in_order(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with store_factory() as s:
        batches = _count(monkeypatch, s, "_write_many")
        await s.create_account("a", 2_500, NOW)
        holds = [_hold("a", 1_000) for _ in range(4)]
        out = await asyncio.gather(*(s.place_hold(h) for h in holds), return_exceptions=True)
        assert batches == [3]
        assert out[:2] == [None, None]
        assert all(isinstance(r, InsufficientFunds) and r.balance_micros == 500 for r in out[2:])
        a = await s.account("a")
        assert a is not None and (a.balance_micros, a.open_holds_micros) == (500, 2_000)
        await _balanced(s)


@pytest.mark.anyio
async def test_holds_and_closes_of_one_account_share_a_batch(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with store_factory() as s:
        batches = _count(monkeypatch, s, "_write_many")
        await s.create_account("a", 3_000, NOW)
        old = [_hold("a", 1_000) for _ in range(3)]  # the whole balance
        for h in old:
            await s.place_hold(h)
        new = [_hold("a", 900) for _ in range(3)]
        # a close first (alone), then two closes and three holds in one batch: the
        # holds (2,700) fit in what the batch's closes give back (1,900) and the 900
        # the first close gave back, netted on the account's row once
        out = await asyncio.gather(
            s.settle(old[0].id, 100, _usage(old[0], 100), NOW),
            s.settle(old[1].id, 100, _usage(old[1], 100), NOW),
            s.release(old[2].id, None, NOW),
            *(s.place_hold(h) for h in new),
            return_exceptions=True,
        )
        assert batches == [5]
        assert [o.charged_micros if isinstance(o, Hold) else o for o in out[:3]] == [100, 100, 0]
        assert out[3:] == [None, None, None]
        a = await s.account("a")
        assert a is not None and (a.balance_micros, a.open_holds_micros, a.spent_micros) == (100, 2_700, 200)
        u = await s.usage("a", old[1].request_id)
        assert u is not None and u.cost_micros == 100
        await _balanced(s)


def test_values_lists_number_their_parameters() -> None:
    assert values_list(2, 2) == "($1, $2), ($3, $4)"
    assert values_list(1, 2, ("", "BIGINT")) == "($1, CAST($2 AS BIGINT))"


@pytest.mark.anyio
async def test_every_way_a_hold_leaves_open_forgets_its_partition(
    store_factory: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store remembers the account of each open hold placed here (the partition of
    its close); a hold that leaves open by any way (settle, release, reconciling, an
    operator's settle or release) must be forgotten, or the map fills with dead ids (the
    soak's RSS crept by one entry per reconciling hold) and, once full, closes stop
    sharing batches."""
    async with store_factory() as s:
        monkeypatch.setattr(s, "HOLD_ACCOUNTS_MAX", 5)
        batches = _count(monkeypatch, s, "_write_many")
        await s.create_account("a", 100_000, NOW)
        holds = [_hold("a", 1_000) for _ in range(5)]
        for h in holds:
            await s.place_hold(h)
        await s.settle(holds[0].id, 100, _usage(holds[0], 100), NOW)
        await s.release(holds[1].id, None, NOW)
        await s.to_reconciling(holds[2].id, _usage(holds[2], 0), "the engine gave no usage", NOW)
        await s.settle(holds[3].id, 200, None, NOW, audit=audit_entry("operator", "hold.settle", holds[3].id))
        await s.release(holds[4].id, None, NOW, audit=audit_entry("operator", "hold.release", holds[4].id))
        assert s._hold_accounts == {}
        assert batches == []  # one write at a time so far
        # the map has room again: these closes queue behind the first and share a batch
        more = [_hold("a", 1_000) for _ in range(4)]
        for h in more:
            await s.place_hold(h)
        await asyncio.gather(*(s.release(h.id, None, NOW) for h in more))
        assert batches == [3]
        await _balanced(s)
