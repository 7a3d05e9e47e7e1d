"""Stored responses over SQLite and PostgreSQL: kept per account, replaced by id,
hidden once expired, deleted by their owner only, purged in batches."""

from __future__ import annotations

import dataclasses
import secrets

import pytest

from bourse.ports.stores import ResponseRecord
from tests.support.databases import StoreFactory

NOW = 1_700_000_000.0


def mk_response(
    account: str = "a", *, expires_at: float = NOW + 3600, status: str = "completed"
) -> ResponseRecord:
    rid = "resp-" + secrets.token_hex(6)
    item = {
        "id": "msg_1",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "héllo"}],
    }
    return ResponseRecord(
        id=rid,
        account_id=account,
        status=status,
        body={"id": rid, "object": "response", "status": status, "output": [], "metadata": {"k": "v"}},
        input_items=[item],
        context=[item, {"id": "msg_2", "type": "message", "role": "assistant", "content": []}],
        created_at=NOW,
        expires_at=expires_at,
    )


@pytest.mark.anyio
async def test_a_response_is_kept_for_its_account_and_replaced_by_id(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        rec = mk_response()
        await s.put_response(rec)
        assert await s.response(rec.id, "a", NOW) == rec
        assert await s.response(rec.id, "b", NOW) is None  # another account's id reads as missing
        assert await s.response("resp-none", "a", NOW) is None

        done = dataclasses.replace(
            rec, status="failed", body={**rec.body, "status": "failed"}, job_id="job_1"
        )
        await s.put_response(done)
        got = await s.response(rec.id, "a", NOW)
        assert got is not None and got.status == "failed" and got.job_id == "job_1"
        assert got.body["status"] == "failed" and got.context == rec.context


@pytest.mark.anyio
async def test_an_expired_response_is_hidden_then_purged(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        old = [mk_response(expires_at=NOW - 1 - i) for i in range(5)]
        live = mk_response(expires_at=NOW + 10)
        for rec in [*old, live]:
            await s.put_response(rec)
        assert await s.response(old[0].id, "a", NOW) is None
        assert await s.response(live.id, "a", NOW) is not None
        assert await s.purge_responses(NOW, 3) == 3
        assert await s.purge_responses(NOW, 3) == 2
        assert await s.purge_responses(NOW, 3) == 0
        assert await s.response(live.id, "a", NOW) is not None


@pytest.mark.anyio
async def test_only_the_owner_deletes_a_response(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        rec = mk_response()
        await s.put_response(rec)
        assert await s.delete_response(rec.id, "b") is False
        assert await s.response(rec.id, "a", NOW) is not None
        assert await s.delete_response(rec.id, "a") is True
        assert await s.response(rec.id, "a", NOW) is None
        assert await s.delete_response(rec.id, "a") is False
