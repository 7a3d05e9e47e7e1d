"""Dashboard sessions: sign-in by key, the signed token, expiry, sign-out, a deleted
key, forgery, and the CSRF token."""

from __future__ import annotations

import base64

import orjson
import pytest

from bourse.domain.errors import GatewayError
from bourse.ports.stores import ApiKey
from bourse.services.auth import hash_key
from bourse.services.sessions import Sessions

pytestmark = pytest.mark.anyio

ADMIN = "bk_admin_unit"
USER_KEY = "bk_user_unit"


class Keys:
    """An in-memory key store."""

    def __init__(self) -> None:
        self.by_hash: dict[str, ApiKey] = {hash_key(USER_KEY): ApiKey("key_u1", "acme")}

    async def create_key(self, key: ApiKey, key_hash: str) -> None:
        self.by_hash[key_hash] = key

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        return self.by_hash.get(key_hash)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _sessions(keys: Keys | None = None, clock: Clock | None = None, admin: str = ADMIN) -> Sessions:
    return Sessions(keys or Keys(), hash_key(admin), ttl_s=60.0, clock=clock or Clock())


async def test_admin_key_makes_an_operator_session() -> None:
    s = _sessions()
    session, token = await s.sign_in(f"  {ADMIN}\n")
    assert session.operator and session.account_id is None and session.key_hash == ""
    assert ADMIN not in token
    back = await s.resume(token)
    assert back == session


async def test_api_key_makes_a_user_session_of_its_account() -> None:
    s = _sessions()
    session, token = await s.sign_in(USER_KEY)
    assert (session.role, session.account_id, session.key_id) == ("user", "acme", "key_u1")
    assert USER_KEY not in token
    assert await s.resume(token) == session


@pytest.mark.parametrize("key", ["", "   ", "bk_nobody", "x" * 600])
async def test_unknown_or_empty_key_is_refused(key: str) -> None:
    with pytest.raises(GatewayError) as info:
        await _sessions().sign_in(key)
    assert info.value.status == 401


async def test_expired_session_is_refused() -> None:
    clock = Clock()
    s = _sessions(clock=clock)
    _, token = await s.sign_in(USER_KEY)
    clock.now += 59
    assert await s.resume(token) is not None
    clock.now += 2
    assert await s.resume(token) is None


async def test_signed_out_session_is_refused() -> None:
    s = _sessions()
    session, token = await s.sign_in(ADMIN)
    other, other_token = await s.sign_in(ADMIN)
    s.sign_out(session)
    assert await s.resume(token) is None
    assert await s.resume(other_token) == other


async def test_a_deleted_key_ends_its_sessions() -> None:
    keys = Keys()
    s = _sessions(keys)
    _, token = await s.sign_in(USER_KEY)
    keys.by_hash.clear()
    assert await s.resume(token) is None


async def test_forged_or_damaged_tokens_are_refused() -> None:
    s = _sessions()
    _, user_token = await s.sign_in(USER_KEY)
    version, payload, mac = user_token.split(".")
    # the user's payload with the role changed, signed by someone without the secret
    doc = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    doc["role"] = "operator"
    forged = base64.urlsafe_b64encode(orjson.dumps(doc)).rstrip(b"=").decode()
    bad = [
        None, "", "v1", "v1..", f"{version}.{forged}.{mac}", f"v2.{payload}.{mac}",
        f"{version}.{payload}.{mac[:-2]}", f"{version}.{payload}!.{mac}", "v1." + "a" * 5000,
    ]  # fmt: skip
    for token in bad:
        assert await s.resume(token) is None, token
    # a token signed for another admin key (another deployment) is not valid here
    _, foreign = await _sessions(admin="bk_admin_elsewhere").sign_in("bk_admin_elsewhere")
    assert await s.resume(foreign) is None


async def test_csrf_token_belongs_to_its_session() -> None:
    s = _sessions()
    one, _ = await s.sign_in(ADMIN)
    two, _ = await s.sign_in(ADMIN)
    s.check_csrf(one, s.csrf_token(one))
    for token in (None, "", s.csrf_token(two), s.csrf_token(one)[:-1]):
        with pytest.raises(GatewayError) as info:
            s.check_csrf(one, token)
        assert info.value.status == 403 and info.value.code == "csrf_failed"
