"""Dashboard sessions: sign-in by key (the admin key: an owner; an operator key: that
operator's id, name and role; an API key: a user), the signed token, expiry,
sign-out, a deleted key, a revoked operator, an admin key past its rotation's grace,
forgery, the secret read from the database, and the CSRF token."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence

import orjson
import pytest

from bourse.domain.errors import GatewayError
from bourse.ports.admin_keys import AdminKey
from bourse.ports.operators import Operator
from bourse.ports.stores import ApiKey
from bourse.services.auth import Authenticator, hash_key
from bourse.services.sessions import Sessions

pytestmark = pytest.mark.anyio

ADMIN = "bk_admin_unit"
USER_KEY = "bk_user_unit"
OP_KEY = "bo_viewer_unit"
SECRET = b"s" * 32


class Keys:
    """An in-memory key store."""

    def __init__(self) -> None:
        self.by_hash: dict[str, ApiKey] = {hash_key(USER_KEY): ApiKey("key_u1", "acme")}

    async def create_key(self, key: ApiKey, key_hash: str) -> None:
        self.by_hash[key_hash] = key

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        return self.by_hash.get(key_hash)


class Operators:
    """An in-memory operator store: one viewer."""

    def __init__(self) -> None:
        self.by_hash = {hash_key(OP_KEY): Operator("op_1", "ada", "viewer", 1.0)}

    async def operator_by_hash(self, key_hash: str) -> Operator | None:
        return self.by_hash.get(key_hash)


class AdminKeys:
    """The database's admin keys and session secret, in memory."""

    def __init__(self) -> None:
        self.keys = [AdminKey(hash_key(ADMIN), 1.0)]
        self.secret = SECRET
        self.reads = 0

    async def admin_keys(self) -> Sequence[AdminKey]:
        return self.keys

    async def session_secret(self, now: float) -> bytes:
        self.reads += 1
        return self.secret


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _auth(
    keys: Keys, clock: Clock, admin: str = ADMIN, ops: Operators | None = None, db: AdminKeys | None = None
) -> Authenticator:
    return Authenticator(
        keys, hash_key(admin), cache_ttl_s=0.0, clock=clock, operators=ops or Operators(),  # type: ignore[arg-type]
        admin_keys=db,
    )  # fmt: skip


def _sessions(
    keys: Keys | None = None,
    clock: Clock | None = None,
    admin: str = ADMIN,
    *,
    ops: Operators | None = None,
    db: AdminKeys | None = None,
    secret: bytes = SECRET,
) -> Sessions:
    keys, clock = keys or Keys(), clock or Clock()
    return Sessions(keys, _auth(keys, clock, admin, ops, db), secret=secret, ttl_s=60.0, clock=clock)


def _payload(token: str) -> dict[str, object]:
    payload = token.split(".")[1]
    doc: dict[str, object] = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return doc


async def test_admin_key_makes_an_owner_session() -> None:
    s = _sessions()
    session, token = await s.sign_in(f"  {ADMIN}\n")
    assert (session.role, session.operator_name, session.operator_id) == ("owner", None, None)
    assert session.operator and session.account_id is None and session.key_hash == hash_key(ADMIN)
    assert session.allows("owner") and ADMIN not in token
    back = await s.resume(token)
    assert back == session


async def test_operator_key_makes_a_session_with_its_id_name_and_role() -> None:
    s = _sessions()
    session, token = await s.sign_in(OP_KEY)
    assert (session.role, session.operator_id, session.operator_name) == ("viewer", "op_1", "ada")
    assert session.operator and session.account_id is None
    assert session.allows("viewer") and not session.allows("billing")
    assert OP_KEY not in token
    doc = _payload(token)
    assert (doc["role"], doc["oid"], doc["on"]) == ("viewer", "op_1", "ada")
    assert await s.resume(token) == session


async def test_a_revoked_operator_is_refused_and_its_sessions_end() -> None:
    ops = Operators()
    s = _sessions(ops=ops)
    _, token = await s.sign_in(OP_KEY)
    ops.by_hash[hash_key(OP_KEY)] = dataclasses.replace(ops.by_hash[hash_key(OP_KEY)], revoked_at=1_001.0)
    assert await s.resume(token) is None
    with pytest.raises(GatewayError) as info:
        await s.sign_in(OP_KEY)
    assert info.value.status == 401 and "revoked" in info.value.message


async def test_an_operators_role_is_read_again_on_each_request() -> None:
    ops = Operators()
    s = _sessions(ops=ops)
    _, token = await s.sign_in(OP_KEY)
    ops.by_hash[hash_key(OP_KEY)] = dataclasses.replace(ops.by_hash[hash_key(OP_KEY)], role="billing")
    back = await s.resume(token)
    assert back is not None and back.role == "billing" and back.allows("billing")
    # another operator's key behind the same id is not this session's
    ops.by_hash[hash_key(OP_KEY)] = Operator("op_2", "bea", "owner", 1.0)
    assert await s.resume(token) is None


async def test_admin_key_sessions_outlive_a_rotation_until_its_grace_ends() -> None:
    clock, db = Clock(), AdminKeys()
    s = _sessions(clock=clock, db=db)
    _, old_session = await s.sign_in(ADMIN)
    _, op_session = await s.sign_in(OP_KEY)
    # rotated: the old key works for 30 s more, a new one is current
    db.keys = [
        AdminKey(hash_key(ADMIN), 1.0, valid_until=clock.now + 30),
        AdminKey(hash_key("bk_admin_new"), 2.0),
    ]
    assert await s.resume(old_session) is not None
    new, new_session = await s.sign_in("bk_admin_new")
    assert new.role == "owner"
    clock.now += 30
    assert await s.resume(old_session) is None
    with pytest.raises(GatewayError) as info:
        await s.sign_in(ADMIN)
    assert info.value.status == 401 and "rotated" in info.value.message
    # the secret did not change with the admin key: other sessions go on
    assert await s.resume(new_session) is not None
    assert await s.resume(op_session) is not None


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
    doc["role"] = "owner"
    forged = base64.urlsafe_b64encode(orjson.dumps(doc)).rstrip(b"=").decode()
    bad = [
        None, "", "v1", "v1..", f"{version}.{forged}.{mac}", f"v3.{payload}.{mac}",
        f"{version}.{payload}.{mac[:-2]}", f"{version}.{payload}!.{mac}", "v1." + "a" * 5000,
    ]  # fmt: skip
    for token in bad:
        assert await s.resume(token) is None, token
    # a token signed with another secret (another database), for the same admin key, is not valid here
    _, foreign = await _sessions(secret=b"o" * 32).sign_in(ADMIN)
    assert await s.resume(foreign) is None
    # nor a version 1 token (signed from the admin key, before the secret moved to the database)
    assert await s.resume("v1" + user_token[2:]) is None


async def test_the_secret_is_the_databases_and_replicas_share_it() -> None:
    db, keys, clock = AdminKeys(), Keys(), Clock()
    one = Sessions(keys, _auth(keys, clock, db=db), db, ttl_s=60.0, clock=clock)
    two = Sessions(keys, _auth(keys, clock, db=db), db, ttl_s=60.0, clock=clock)
    with pytest.raises(RuntimeError, match="start"):
        await one.sign_in(ADMIN)
    await one.start()
    await two.start()
    assert db.reads == 2
    session, token = await one.sign_in(OP_KEY)
    assert await two.resume(token) == session
    assert two.csrf_token(session) == one.csrf_token(session)
    db.secret = b"x" * 32  # another database
    other = Sessions(keys, _auth(keys, clock, db=db), db, ttl_s=60.0, clock=clock)
    await other.start()
    assert await other.resume(token) is None


async def test_csrf_token_belongs_to_its_session() -> None:
    s = _sessions()
    one, _ = await s.sign_in(ADMIN)
    two, _ = await s.sign_in(ADMIN)
    s.check_csrf(one, s.csrf_token(one))
    for token in (None, "", s.csrf_token(two), s.csrf_token(one)[:-1]):
        with pytest.raises(GatewayError) as info:
            s.check_csrf(one, token)
        assert info.value.status == 403 and info.value.code == "csrf_failed"
