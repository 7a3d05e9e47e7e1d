"""The admin key and the dashboard-session secret in the database (migration 16), on
SQLite and PostgreSQL: the first seed wins (replicas starting together included), a
rotation keeps the old key for its grace and is audited in its transaction, and the
session secret is made once, shared, sealed with the webhook-secret key, re-sealed
with it and replaced when no key of the gateway opens it."""

from __future__ import annotations

import asyncio

import pytest
from cryptography.fernet import Fernet

from bourse.ports.stores import audit_entry
from bourse.storage.private import SEALED, SecretBox
from tests.support.databases import StoreFactory

pytestmark = pytest.mark.anyio

NOW = 1_700_000_000.0


async def test_the_first_seed_wins_even_when_replicas_start_together(store_factory: StoreFactory) -> None:
    stores = [store_factory.new() for _ in range(4)]
    for s in stores:
        await s.open()
    try:
        seeded = await asyncio.gather(*(s.seed_admin_key(f"hash{i}", NOW + i) for i, s in enumerate(stores)))
        winners = [a for a in seeded if a is not None]
        assert len(winners) == 1 and winners[0].current, seeded
        keys = await stores[0].admin_keys()
        assert [(k.key_hash, k.valid_until) for k in keys] == [(winners[0].key_hash, None)]
    finally:
        for s in stores:
            await s.close()


async def test_a_rotation_keeps_the_old_key_for_its_grace_and_is_audited(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.seed_admin_key("first", NOW)
        entry = audit_entry("admin", "admin_key.rotate", "admin_key", {"grace_s": 60}, NOW + 1)
        old = await s.rotate_admin_key("second", NOW + 61, NOW + 1, audit=entry)
        assert old is not None and (old.key_hash, old.valid_until) == ("first", NOW + 61)
        keys = {k.key_hash: k.valid_until for k in await s.admin_keys()}
        assert keys == {"first": NOW + 61, "second": None}
        assert [
            e.action for e in await s.audit_page(action="admin_key.rotate", target=None, limit=10, after=None)
        ] == ["admin_key.rotate"]
        # the current key seeds nothing new; a rotated-out one is remembered as such
        assert (await s.seed_admin_key("second", NOW + 2)).current
        assert (await s.seed_admin_key("first", NOW + 2)).valid_until == NOW + 61


async def test_rotations_at_once_leave_one_current_key(store_factory: StoreFactory) -> None:
    from bourse.ports.admin_keys import AdminKeyChanged

    stores = [store_factory.new() for _ in range(4)]
    for s in stores:
        await s.open()
    try:
        await stores[0].seed_admin_key("first", NOW)

        async def rotate(i: int) -> bool:
            try:
                await stores[i].rotate_admin_key(f"new{i}", NOW + 60, NOW + 1)
            except AdminKeyChanged:
                return False
            return True

        won = await asyncio.gather(*(rotate(i) for i in range(4)))
        assert any(won)
        keys = await stores[0].admin_keys()
        assert len([k for k in keys if k.current]) == 1, keys
        assert {k.key_hash for k in keys} == {"first"} | {f"new{i}" for i, w in enumerate(won) if w}
    finally:
        for s in stores:
            await s.close()


async def test_the_session_secret_is_made_once_sealed_and_shared(store_factory: StoreFactory) -> None:
    key = Fernet.generate_key()
    one, two = store_factory.new(), store_factory.new()
    for s in (one, two):
        s.secret_box = SecretBox([key])
        await s.open()
        await s.adopt_sealing_key(NOW, take_over=False)
    try:
        secrets = await asyncio.gather(one.session_secret(NOW), two.session_secret(NOW))
        assert secrets[0] == secrets[1] and len(secrets[0]) >= 32
        stored = await one._read(lambda db: db.fetchrow("SELECT secret FROM dashboard_secret WHERE id = 1"))
        assert str(stored["secret"]).startswith(SEALED) and secrets[0].decode() not in str(stored["secret"])
        # a re-seal with a new first key keeps the secret, sealed with the new key
        newer = Fernet.generate_key()
        one.secret_box = SecretBox([newer, key])
        await one.reseal_webhook_secrets(NOW + 1)
        only_new = store_factory.new()
        only_new.secret_box = SecretBox([newer])
        await only_new.open()
        try:
            assert await only_new.session_secret(NOW + 2) == secrets[0]
        finally:
            await only_new.close()
        # a gateway that opens it with no key of its own (taken over) makes a new one
        other = store_factory.new()
        other.secret_box = SecretBox([Fernet.generate_key()])
        await other.open()
        try:
            await other.adopt_sealing_key(NOW + 3, take_over=True)  # --adopt-secret-key
            fresh = await other.session_secret(NOW + 3)
            assert fresh != secrets[0] and await other.session_secret(NOW + 4) == fresh
        finally:
            await other.close()
    finally:
        for s in (one, two):
            await s.close()
