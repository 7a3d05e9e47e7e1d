"""The authenticator over a real (in-memory SQLite) key store: revocation reaches a
cached key within the cache TTL (at once with ``forget``), expiry and a rotation's
grace period are checked against the clock on every request, and ``last_used_at`` is
written at most once per interval per key, off the request's path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from bourse.domain.errors import GatewayError
from bourse.ports.stores import ApiKey
from bourse.services.auth import CACHE_TTL_MAX_S, Authenticator, hash_key
from bourse.storage.sqlite import SqliteStore

pytestmark = pytest.mark.anyio

NOW = 1_700_000_000.0


class CountingStore(SqliteStore):
    """SQLite in memory, counting the ``last_used_at`` writes (and failing them on demand)."""

    def __init__(self) -> None:
        super().__init__(":memory:")
        self.touches: list[dict[str, float]] = []
        self.fail_touches = False
        self.lookups = 0

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        self.lookups += 1
        key = await super().key_by_hash(key_hash)
        await asyncio.sleep(0.01)  # the answer's way back: the callers pile up meanwhile
        return key

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        self.touches.append(dict(used))
        if self.fail_touches:
            raise OSError("disk on fire")
        await super().touch_keys(used)


@dataclass
class Clock:
    now: float = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def store() -> AsyncIterator[CountingStore]:
    s = CountingStore()
    await s.open()
    await s.create_account("acct", 0, NOW)
    try:
        yield s
    finally:
        await s.close()


async def new_key(store: CountingStore, secret: str, **fields: float) -> ApiKey:
    key = ApiKey(id="key_" + secret, account_id="acct", created_at=NOW, **fields)  # type: ignore[arg-type]
    await store.create_key(key, hash_key(secret))
    return key


def bearer(secret: str) -> str:
    return f"Bearer {secret}"


async def refused(auth: Authenticator, secret: str) -> str:
    with pytest.raises(GatewayError) as exc:
        await auth.user(bearer(secret))
    assert (exc.value.status, exc.value.code) == (401, "invalid_api_key")
    return exc.value.message


async def wait_refused(auth: Authenticator, secret: str, within_s: float) -> float:
    """Call until the key is refused; how long that took (fails past ``within_s``)."""
    t0 = time.monotonic()
    while True:
        try:
            await auth.user(bearer(secret))
        except GatewayError as exc:
            assert exc.status == 401, exc
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within_s, "the revoked key was still accepted"
        await asyncio.sleep(0.005)


async def test_no_cache_may_outlive_a_second(store: CountingStore) -> None:
    with pytest.raises(ValueError, match="cache_ttl_s"):
        Authenticator(store, "admin", cache_ttl_s=CACHE_TTL_MAX_S + 0.5)


async def test_a_key_revoked_elsewhere_is_refused_within_the_cache_ttl(store: CountingStore) -> None:
    await new_key(store, "s1")
    auth = Authenticator(store, "admin", cache_ttl_s=0.3)
    assert (await auth.user(bearer("s1"))).key.id == "key_s1"  # cached now
    await store.revoke_key("key_s1", time.time())  # as another replica would: no forget() here
    took = await wait_refused(auth, "s1", within_s=CACHE_TTL_MAX_S)
    assert took <= 0.3 + 0.2
    assert await refused(auth, "s1") == "This API key was revoked."
    await auth.aclose()


async def test_concurrent_callers_of_an_uncached_key_share_one_lookup(store: CountingStore) -> None:
    """When the cache has no entry (a cold start, or each time the TTL runs out), the
    requests in flight for the key wait on one read of the store, not one read each."""
    await new_key(store, "s9")
    auth = Authenticator(store, "admin", cache_ttl_s=0.2)
    got = await asyncio.gather(*(auth.user(bearer("s9")) for _ in range(32)))
    assert {p.key.id for p in got} == {"key_s9"}
    assert store.lookups == 1
    await asyncio.sleep(0.25)  # the entry expired: the next wave reads once more
    await asyncio.gather(*(auth.user(bearer("s9")) for _ in range(32)))
    assert store.lookups == 2
    assert [await refused(auth, "nope") for _ in range(2)]  # an unknown key is cached as such
    await auth.aclose()


async def test_a_read_in_flight_when_the_key_is_forgotten_is_not_kept(store: CountingStore) -> None:
    await new_key(store, "s7")
    auth = Authenticator(store, "admin", cache_ttl_s=1.0)
    first = asyncio.ensure_future(auth.user(bearer("s7")))
    await asyncio.sleep(0.001)  # its read is in flight
    await store.revoke_key("key_s7", time.time())
    auth.forget("key_s7")  # the read may have seen the key before the revocation
    assert (await first).key.id == "key_s7"  # read before the revocation
    await refused(auth, "s7")  # read again, not the in-flight read's answer
    assert store.lookups == 2
    await auth.aclose()


async def test_a_shared_lookup_that_fails_fails_every_caller_and_is_not_kept(store: CountingStore) -> None:
    await new_key(store, "s8")
    auth = Authenticator(store, "admin", cache_ttl_s=1.0)
    real = store.key_by_hash

    async def broken(key_hash: str) -> ApiKey | None:
        await asyncio.sleep(0.01)
        raise OSError("database gone")

    store.key_by_hash = broken  # type: ignore[method-assign]
    got = await asyncio.gather(*(auth.user(bearer("s8")) for _ in range(4)), return_exceptions=True)
    assert all(isinstance(g, OSError) for g in got)
    store.key_by_hash = real  # type: ignore[method-assign]
    assert (await auth.user(bearer("s8"))).key.id == "key_s8"
    await auth.aclose()


async def test_forget_refuses_a_key_revoked_here_at_once(store: CountingStore) -> None:
    await new_key(store, "s2")
    auth = Authenticator(store, "admin", cache_ttl_s=1.0)
    await auth.user(bearer("s2"))
    await store.revoke_key("key_s2", time.time())
    auth.forget("key_s2")
    await refused(auth, "s2")
    await auth.aclose()


async def test_expiry_is_checked_on_every_request_even_when_cached(store: CountingStore) -> None:
    await new_key(store, "s3", expires_at=NOW + 60)
    clock = Clock()
    auth = Authenticator(store, "admin", cache_ttl_s=1.0, clock=clock)
    await auth.user(bearer("s3"))
    clock.now = NOW + 59.9
    await auth.user(bearer("s3"))
    clock.now = NOW + 60
    assert "expired at 2023-11-14T22:14:20Z" in await refused(auth, "s3")
    await auth.aclose()


async def test_a_rotated_out_secret_works_until_its_grace_ends(store: CountingStore) -> None:
    await new_key(store, "old")
    clock = Clock()
    auth = Authenticator(store, "admin", cache_ttl_s=0.0, clock=clock)
    await store.rotate_key("key_old", hash_key("new"), NOW + 30, NOW)
    assert (await auth.user(bearer("old"))).key.id == "key_old"
    assert (await auth.user(bearer("new"))).key.id == "key_old"
    clock.now = NOW + 30
    assert "was rotated" in await refused(auth, "old")
    assert (await auth.user(bearer("new"))).key.id == "key_old"
    await auth.aclose()


async def test_last_use_is_written_at_most_once_per_interval(store: CountingStore) -> None:
    await new_key(store, "s4")
    await new_key(store, "s5")
    auth = Authenticator(store, "admin", cache_ttl_s=1.0, touch_interval_s=0.3)
    t0 = time.monotonic()
    for _ in range(50):
        await auth.user(bearer("s4"))
        await auth.user(bearer("s5"))
    await auth.aclose()
    writes = [k for batch in store.touches for k in batch]
    assert sorted(writes) == ["key_s4", "key_s5"]  # one write each, whatever the number of requests
    first = await store.key("key_s4")
    assert first is not None and first.last_used_at is not None
    assert abs(first.last_used_at - time.time()) < 5

    while time.monotonic() - t0 < 0.3:  # the interval passes: the next use is written again
        await auth.user(bearer("s4"))
        await asyncio.sleep(0.01)
    await auth.user(bearer("s4"))
    await auth.aclose()
    assert [k for batch in store.touches for k in batch].count("key_s4") == 2


async def test_a_failing_last_use_write_never_fails_the_request(
    store: CountingStore, caplog: pytest.LogCaptureFixture
) -> None:
    await new_key(store, "s6")
    store.fail_touches = True
    auth = Authenticator(store, "admin", touch_interval_s=60)
    assert (await auth.user(bearer("s6"))).key.id == "key_s6"
    await auth.aclose()
    assert "last_used_at of 1 keys not written" in caplog.text
    assert "s6" not in caplog.text.replace("key_s6", "")  # never the secret
    store.fail_touches = False
    await auth.user(bearer("s6"))  # a failed write is tried again at the next use
    await auth.aclose()
    got = await store.key("key_s6")
    assert got is not None and got.last_used_at is not None


# -- the admin key, kept in the database and rotated with a grace period ------------------


def _admin_auth(store: CountingStore, clock: Clock, ttl: float = 0.0) -> Authenticator:
    return Authenticator(store, hash_key("configured"), cache_ttl_s=ttl, clock=clock, admin_keys=store)


async def admin_refused(auth: Authenticator, secret: str) -> str:
    with pytest.raises(GatewayError) as exc:
        await auth.admin(bearer(secret))
    assert (exc.value.status, exc.value.code) == (401, "invalid_api_key"), exc.value
    return exc.value.message


async def test_the_database_decides_which_key_is_the_admin_key(store: CountingStore) -> None:
    clock = Clock()
    auth = _admin_auth(store, clock)
    # nothing seeded: the configured key is no admin key (the database has none yet)
    with pytest.raises(GatewayError) as exc:
        await auth.admin(bearer("configured"))
    assert exc.value.code == "admin_only"
    seeded = await store.seed_admin_key(hash_key("configured"), NOW)
    assert seeded is not None and seeded.current
    assert (await auth.admin(bearer("configured"))).role == "owner"
    # a second seed (another replica, another configured key) changes nothing
    assert await store.seed_admin_key(hash_key("elsewhere"), NOW) is None
    with pytest.raises(GatewayError) as exc:
        await auth.admin(bearer("elsewhere"))
    assert exc.value.code == "admin_only"
    with pytest.raises(GatewayError) as exc:  # the admin key on /v1
        await auth.user(bearer("configured"))
    assert exc.value.code == "admin_key_not_allowed"


async def test_a_rotated_admin_key_works_until_its_grace_ends(store: CountingStore) -> None:
    clock = Clock()
    auth = _admin_auth(store, clock)
    await store.seed_admin_key(hash_key("configured"), NOW)
    old = await store.rotate_admin_key(hash_key("second"), NOW + 60, NOW)
    assert old is not None and old.key_hash == hash_key("configured") and old.valid_until == NOW + 60
    assert (await auth.admin(bearer("configured"))).role == "owner"
    assert (await auth.admin(bearer("second"))).role == "owner"
    clock.now = NOW + 59.9
    assert (await auth.admin(bearer("configured"))).role == "owner"
    clock.now = NOW + 60
    message = await admin_refused(auth, "configured")
    assert message == "The admin key was rotated; this key stopped working at 2023-11-14T22:14:20Z."
    assert (await auth.admin(bearer("second"))).role == "owner"
    # a start configured with the rotated-out key does not make it the admin key again
    again = await store.seed_admin_key(hash_key("configured"), NOW + 61)
    assert again is not None and again.valid_until == NOW + 60
    await admin_refused(auth, "configured")


async def test_no_older_key_outlives_a_new_rotations_grace(store: CountingStore) -> None:
    clock = Clock()
    auth = _admin_auth(store, clock)
    await store.seed_admin_key(hash_key("configured"), NOW)
    await store.rotate_admin_key(hash_key("second"), NOW + 3600, NOW)
    await store.rotate_admin_key(hash_key("third"), NOW + 5, NOW + 1)  # grace 4 s: caps the first's hour
    keys = {k.key_hash: k.valid_until for k in await store.admin_keys()}
    assert keys == {hash_key("configured"): NOW + 5, hash_key("second"): NOW + 5, hash_key("third"): None}
    clock.now = NOW + 5
    await admin_refused(auth, "configured")
    await admin_refused(auth, "second")
    assert (await auth.admin(bearer("third"))).role == "owner"
    # grace 0: only the new key works, at once
    await store.rotate_admin_key(hash_key("fourth"), clock.now, clock.now)
    await admin_refused(auth, "third")
    assert (await auth.admin(bearer("fourth"))).role == "owner"


async def test_a_rotation_elsewhere_holds_here_within_the_cache_ttl(store: CountingStore) -> None:
    clock = Clock()
    here = _admin_auth(store, clock, ttl=0.3)
    await store.seed_admin_key(hash_key("configured"), NOW)
    assert (await here.admin(bearer("configured"))).role == "owner"  # the keys are cached now
    await store.rotate_admin_key(hash_key("second"), NOW, NOW)  # another replica, grace 0
    t0 = time.monotonic()
    while True:
        try:
            await here.admin(bearer("configured"))
        except GatewayError as exc:
            assert exc.status == 401
            break
        assert time.monotonic() - t0 < CACHE_TTL_MAX_S, "the rotated-out admin key was still accepted"
        await asyncio.sleep(0.01)
    assert time.monotonic() - t0 <= 0.3 + 0.2
    assert (await here.admin(bearer("second"))).role == "owner"
    # on the replica that rotates, forget_admin_keys() makes it hold at once
    await store.rotate_admin_key(hash_key("third"), NOW, NOW)
    here.forget_admin_keys()
    await admin_refused(here, "second")


async def test_the_rotate_use_case_audits_and_forgets(store: CountingStore, tmp_path: Path) -> None:
    from bourse.services.accounts import AdminService
    from bourse.storage.audit import SqlAuditLog

    clock = Clock()
    auth = _admin_auth(store, clock, ttl=1.0)
    await store.seed_admin_key(hash_key("configured"), NOW)
    key_file = tmp_path / "admin_key"
    admin = AdminService(store, auth, products=[], audit=SqlAuditLog(store), admin_key_file=key_file)
    await auth.admin(bearer("configured"))  # cached
    out = await admin.rotate_admin_key(0.0, actor="operator:ada")
    new = out["key"]
    assert (
        new.startswith("bk_admin_") and out["old_key_valid_until"] == NOW and out["key_file"] == str(key_file)
    )
    assert key_file.read_text().strip() == new and (key_file.stat().st_mode & 0o777) == 0o600
    await admin_refused(auth, "configured")  # at once here, despite the cache
    assert (await auth.admin(bearer(new))).role == "owner"
    entries = await admin.audit_log("admin_key.rotate", None, 10, None)
    assert [(e["actor"], e["target"], e["detail"]["grace_s"]) for e in entries] == [
        ("operator:ada", "admin_key", 0.0)
    ]
    assert new not in str(entries) and hash_key(new) not in str(entries)
    for bad in (-1.0, 7 * 86_400 + 1):
        with pytest.raises(GatewayError) as exc:
            await admin.rotate_admin_key(bad)
        assert exc.value.status == 400
