"""The authenticator over a real (in-memory SQLite) key store: revocation reaches a
cached key within the cache TTL (at once with ``forget``), expiry and a rotation's
grace period are checked against the clock on every request, and ``last_used_at`` is
written at most once per interval per key, off the request's path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

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
