"""Dashboard sessions: sign in with a key, then a signed cookie; CSRF tokens.

A person signs in to the dashboard once with a key, through a form: the admin key
makes an *operator* session (every account), an API key a *user* session (that key's
account only). The key is never kept: the session is a token the server signs
(HMAC-SHA256), sent back as an HttpOnly, SameSite=Strict cookie::

    v1.<payload, base64url JSON>.<signature, base64url>

The payload holds the session id, the role, the account and key id, and for a user
the SHA-256 of the key (what the key store indexes), so every request checks that
the key still exists: a deleted or revoked key ends its sessions. The signing secret
is derived from the admin key, so replicas sharing the admin key accept each other's
sessions, and changing the admin key ends every session. Sessions last
:data:`SESSION_TTL_S`. Signing out forgets the session id on this process (until the
token would have expired anyway); another replica accepts a copied token until then.

Actions that change something also need the session's CSRF token (an HMAC of the
session id, read by the page's own script and sent in a header), on top of the
SameSite=Strict cookie and the origin check done by the routes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Callable
from typing import Literal, Protocol

import orjson

from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.ports.stores import ApiKey
from bourse.services.auth import hash_key, refusal, unauthorized

Role = Literal["operator", "user"]

SESSION_TTL_S = 12 * 3600.0
MAX_KEY_CHARS = 512
MAX_TOKEN_CHARS = 2048
MAX_SIGNED_OUT = 100_000
"""Signed-out session ids remembered at most (the oldest are forgotten first)."""
_VERSION = "v1"


class KeyLookup(Protocol):
    """What sessions read of the key store."""

    async def key_by_hash(self, key_hash: str) -> ApiKey | None: ...


@immutable
class Session:
    sid: str
    role: Role
    account_id: str | None
    """The account a user session sees (``None`` for an operator)."""
    key_id: str | None
    key_hash: str
    """SHA-256 of a user's key (empty for an operator)."""
    issued_at: float
    expires_at: float

    @property
    def operator(self) -> bool:
        return self.role == "operator"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def session_secret(admin_key_hash: str) -> bytes:
    """The signing secret of dashboard sessions, derived from the admin key's hash."""
    return hmac.new(admin_key_hash.encode(), b"bourse.dashboard.session.v1", hashlib.sha256).digest()


class Sessions:
    """Signs, checks and ends dashboard sessions."""

    def __init__(
        self,
        keys: KeyLookup,
        admin_key_hash: str,
        *,
        ttl_s: float = SESSION_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._keys = keys
        self._admin_hash = admin_key_hash
        self._secret = session_secret(admin_key_hash)
        self._ttl = ttl_s
        self._clock = clock
        self._signed_out: dict[str, float] = {}

    # -- sign in and out --------------------------------------------------------------

    async def sign_in(self, key: str) -> tuple[Session, str]:
        """A new session for ``key`` and its cookie value; 401 when the key is unknown."""
        key = key.strip()
        if not key or len(key) > MAX_KEY_CHARS:
            raise unauthorized("Enter the admin key or an API key.")
        digest = hash_key(key)
        now = self._clock()
        sid = _b64(os.urandom(16))
        if hmac.compare_digest(digest, self._admin_hash):
            session = Session(sid, "operator", None, None, "", now, now + self._ttl)
        else:
            found = await self._keys.key_by_hash(digest)
            if found is None:
                raise unauthorized("This key is neither the admin key nor an API key.")
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
        """The session of a cookie value, or ``None`` (missing, forged, expired,
        signed out, or its key no longer exists)."""
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
            "iat": s.issued_at, "exp": s.expires_at,
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
            session = Session(
                str(doc["sid"]), doc["role"], doc["acct"], doc["kid"], str(doc["sub"]),
                float(doc["iat"]), float(doc["exp"]),
            )  # fmt: skip
        except (binascii.Error, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        if session.role not in ("operator", "user") or session.expires_at <= self._clock():
            return None
        return session
