"""Dashboard sessions: sign in with a key, then a signed cookie; CSRF tokens.

A person signs in to the dashboard once with a key, through a form:

- the admin key makes an ``owner`` session (every account, every action);
- an operator key (``bo_…``) a session with that operator's id, name and role
  (``owner``, ``admin``, ``billing`` or ``viewer``): every account, and the actions
  its role allows (the same least roles as the admin API:
  :mod:`bourse.http.admin_roles`);
- an API key a ``user`` session (that key's account only).

The key is never kept: the session is a token the server signs (HMAC-SHA256), sent
back as an HttpOnly, SameSite=Strict cookie::

    v2.<payload, base64url JSON>.<signature, base64url>

The payload holds the session id, the role, the operator's id and name, the account
and key id, and the SHA-256 of the key (what the stores index). Every request checks
that the key behind the session still works: a deleted, revoked, expired or
rotated-out API key ends its user sessions; a revoked operator's sessions end (within
the authenticator's cache TTL, 1 s; at once on the replica that revoked it), and so do
the sessions of an admin key whose rotation's grace period ended. An operator's role
is read again on each request too.

The signing secret is random, kept in the database (made by the first gateway that
needs it, sealed with ``BOURSE_SECRET_KEY``) and read at start: replicas of one
database accept each other's sessions, and rotating the admin key ends no session by
itself. Sessions last :data:`SESSION_TTL_S`. Signing out forgets the session id on
this process (until the token would have expired anyway); another replica accepts a
copied token until then.

Actions that change something also need the session's CSRF token (an HMAC of the
session id, read by the page's own script and sent in a header), on top of the
SameSite=Strict cookie and the origin check done by the routes.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import os
import time
from collections.abc import Callable
from typing import Literal, Protocol, cast

import orjson

from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.ports.admin_keys import SessionSecretStore
from bourse.ports.operators import ROLES, Role, role_at_least
from bourse.ports.stores import ApiKey
from bourse.services.auth import OPERATOR_PREFIX, AdminCaller, hash_key, refusal, unauthorized

SessionRole = Role | Literal["user"]

SESSION_TTL_S = 12 * 3600.0
MAX_KEY_CHARS = 512
MAX_TOKEN_CHARS = 2048
MAX_SIGNED_OUT = 100_000
"""Signed-out session ids remembered at most (the oldest are forgotten first)."""
_VERSION = "v2"


class KeyLookup(Protocol):
    """What sessions read of the key store."""

    async def key_by_hash(self, key_hash: str) -> ApiKey | None: ...


class StaffLookup(Protocol):
    """Who a key is on the admin side (:meth:`bourse.services.auth.Authenticator.staff`)."""

    async def staff(self, digest: str, *, operator_key: bool) -> AdminCaller | None: ...


@immutable
class Session:
    sid: str
    role: SessionRole
    account_id: str | None
    """The account a user session sees (``None`` for the admin key or an operator)."""
    key_id: str | None
    key_hash: str
    """SHA-256 of the key the session was signed in with."""
    issued_at: float
    expires_at: float
    operator_id: str | None = None
    operator_name: str | None = None
    """The operator signed in (``None``: the admin key, or a user)."""

    @property
    def operator(self) -> bool:
        """Signed in with the admin key or an operator key (not an API key)."""
        return self.role != "user"

    @property
    def who(self) -> str:
        if self.operator_name is not None:
            return f"operator '{self.operator_name}'"
        return "the admin key" if self.operator else f"account '{self.account_id}'"

    def allows(self, need: Role) -> bool:
        """Whether this session's role is ``need`` or above (a user: never)."""
        return self.role != "user" and role_at_least(self.role, need)

    @property
    def staff_role(self) -> Role:
        """The role of an admin-key or operator session (ValueError for a user)."""
        if self.role == "user":
            raise ValueError("a user session has no operator role")
        return self.role


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    """Signs, checks and ends dashboard sessions."""

    def __init__(
        self,
        keys: KeyLookup,
        staff: StaffLookup,
        secrets: SessionSecretStore | None = None,
        *,
        secret: bytes | None = None,
        ttl_s: float = SESSION_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``secrets``: where the signing secret is read at :meth:`start`; or ``secret`` itself."""
        self._keys = keys
        self._staff = staff
        self._secrets = secrets
        self._secret_value = secret
        self._ttl = ttl_s
        self._clock = clock
        self._signed_out: dict[str, float] = {}

    async def start(self) -> None:
        """Read (or make) the database's signing secret."""
        if self._secrets is not None:
            self._secret_value = await self._secrets.session_secret(self._clock())

    @property
    def _secret(self) -> bytes:
        if self._secret_value is None:
            raise RuntimeError("dashboard sessions used before Sessions.start()")
        return self._secret_value

    # -- sign in and out --------------------------------------------------------------

    async def sign_in(self, key: str) -> tuple[Session, str]:
        """A new session for ``key`` and its cookie value; 401 when the key is unknown
        (or revoked, expired, rotated out)."""
        key = key.strip()
        if not key or len(key) > MAX_KEY_CHARS:
            raise unauthorized("Enter the admin key, an operator key or an API key.")
        digest = hash_key(key)
        now = self._clock()
        sid = _b64(os.urandom(16))
        caller = await self._staff.staff(digest, operator_key=key.startswith(OPERATOR_PREFIX))
        if caller is not None:
            op = caller.operator
            session = Session(
                sid, caller.role, None, None, digest, now, now + self._ttl,
                None if op is None else op.id, None if op is None else op.name,
            )  # fmt: skip
        else:
            found = await self._keys.key_by_hash(digest)
            if found is None:
                raise unauthorized("This key is neither the admin key, an operator key nor an API key.")
            refused = refusal(found, now)
            if refused is not None:
                raise unauthorized(refused)
            session = Session(sid, "user", found.account_id, found.id, digest, now, now + self._ttl)
        return session, self._sign(session)

    def sign_out(self, session: Session) -> None:
        if len(self._signed_out) >= MAX_SIGNED_OUT:
            now = self._clock()
            self._signed_out = {s: t for s, t in self._signed_out.items() if t > now}
            while len(self._signed_out) >= MAX_SIGNED_OUT:
                self._signed_out.pop(next(iter(self._signed_out)))
        self._signed_out[session.sid] = session.expires_at

    # -- each request -----------------------------------------------------------------

    async def resume(self, token: str | None) -> Session | None:
        """The session of a cookie value, or ``None`` (missing, forged, expired, signed
        out, or its key no longer works); an operator's with its role as it is now."""
        session = self._verify(token)
        if session is None or session.sid in self._signed_out:
            return None
        if session.role == "user":
            key = await self._keys.key_by_hash(session.key_hash)
            if key is None or key.id != session.key_id or key.account_id != session.account_id:
                return None
            if refusal(key, self._clock()) is not None:  # revoked, expired, rotated out
                return None
            return session
        try:
            caller = await self._staff.staff(session.key_hash, operator_key=session.operator_id is not None)
        except GatewayError:  # a revoked operator, an admin key past its grace
            return None
        if caller is None or (None if caller.operator is None else caller.operator.id) != session.operator_id:
            return None
        if caller.role != session.role:  # the operator's role as it is now
            session = dataclasses.replace(session, role=caller.role)
        return session

    def csrf_token(self, session: Session) -> str:
        return _b64(hmac.new(self._secret, b"csrf." + session.sid.encode(), hashlib.sha256).digest())

    def check_csrf(self, session: Session, token: str | None) -> None:
        """403 unless ``token`` is this session's CSRF token."""
        if not token or not hmac.compare_digest(token.encode(), self.csrf_token(session).encode()):
            raise GatewayError(
                403, "csrf_failed", "This action needs the page's CSRF token; reload the dashboard."
            )

    # -- tokens -----------------------------------------------------------------------

    def _sign(self, s: Session) -> str:
        payload = {
            "sid": s.sid, "role": s.role, "acct": s.account_id, "kid": s.key_id, "sub": s.key_hash,
            "oid": s.operator_id, "on": s.operator_name, "iat": s.issued_at, "exp": s.expires_at,
        }  # fmt: skip
        body = f"{_VERSION}.{_b64(orjson.dumps(payload))}"
        return f"{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())

    def _verify(self, token: str | None) -> Session | None:
        if not token or len(token) > MAX_TOKEN_CHARS:
            return None
        version, _, rest = token.partition(".")
        payload, _, mac = rest.partition(".")
        if version != _VERSION or not payload or not mac:
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(f"{version}.{payload}").encode()):
            return None
        try:
            doc = orjson.loads(_unb64(payload))
            role = doc["role"]
            if role != "user" and role not in ROLES:
                return None
            session = Session(
                str(doc["sid"]), cast(SessionRole, role), doc["acct"], doc["kid"], str(doc["sub"]),
                float(doc["iat"]), float(doc["exp"]), doc["oid"], doc["on"],
            )  # fmt: skip
        except (binascii.Error, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        return None if session.expires_at <= self._clock() else session
