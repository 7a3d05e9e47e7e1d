"""Who is calling: API keys (stored hashed), the admin key and operator keys.

Keys are 32 random bytes shown once at creation (``bk_…``); the store keeps their
SHA-256 (a fast hash is right for high-entropy secrets). Secrets are never logged:
a key is named by its id (``key_…``).

- Looked-up keys are cached for ``cache_ttl_s`` (at most :data:`CACHE_TTL_MAX_S`) so
  the hot path does not read the database on every request; a key revoked or
  rotated on any replica is therefore refused everywhere within that time (at once
  on the replica that did it: :meth:`Authenticator.forget`). So is a key edited, or
  one whose account was suspended, resumed or closed (the lookup reads the
  account's status with the key). Expiry and the end of a
  rotation's grace period are checked on every request against the clock.
- ``last_used_at`` is written off the response path: at most once per
  ``touch_interval_s`` per key, by a background task that writes every key used
  since its last pass in one transaction.

The admin key is separate: it reaches only the admin API (and the dashboard), never
``/v1``; it is the first ``owner``. Its hashes live in the database
(:mod:`bourse.ports.admin_keys`): the current one and those rotated out, each of those
working until the end of its grace period and then refused with a message saying when
it stopped. They are read again at most every ``cache_ttl_s``, so a rotation made on
any replica holds everywhere within that time (at once on the replica that made it:
:meth:`Authenticator.forget_admin_keys`). Operator keys (``bo_…``, stored hashed) reach
the admin API with their operator's role (:mod:`bourse.ports.operators`); their lookups
are cached like keys', so a revoked operator is refused everywhere within
``cache_ttl_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.ports.admin_keys import AdminKeyReader
from bourse.ports.limits import KeyLimits
from bourse.ports.operators import Operator, OperatorStore, Role, role_at_least
from bourse.ports.stores import ApiKey, KeyStore

log = logging.getLogger("bourse.auth")

OPERATOR_PREFIX = "bo_"
CACHE_TTL_MAX_S = 1.0
"""No cache may keep a revoked key alive longer than this."""
TOUCH_INTERVAL_S = 60.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@immutable
class AdminCaller:
    """Who calls the admin API: the admin key (``operator`` None, an owner) or an operator."""

    role: Role
    operator: Operator | None = None

    @property
    def who(self) -> str:
        return "the admin key" if self.operator is None else f"operator '{self.operator.name}'"

    def allow(self, need: Role) -> None:
        """403 ``insufficient_role`` unless this caller's role is ``need`` or above."""
        check_role(self.role, need, self.who, "admin route")


def check_role(role: Role, need: Role, who: str, what: str) -> None:
    """403 ``insufficient_role`` unless ``role`` is ``need`` or above (``who`` has ``role``;
    ``what`` is asked for: an admin route, a dashboard action)."""
    if not role_at_least(role, need):
        raise GatewayError(
            403, "insufficient_role", f"This {what} needs the role '{need}' or above; {who} has '{role}'."
        )


@immutable
class Principal:
    key: ApiKey
    limits: KeyLimits

    @property
    def account_id(self) -> str:
        return self.key.account_id


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, "invalid_api_key", message, headers={"www-authenticate": "Bearer"})


def refusal(key: ApiKey, now: float) -> str | None:
    """Why ``key`` cannot be used at ``now`` (revoked, expired, a rotated-out secret
    past its grace period), or None."""
    if key.revoked_at is not None:
        return "This API key was revoked."
    if key.expires_at is not None and now >= key.expires_at:
        return f"This API key expired at {_when(key.expires_at)}."
    if key.grace_until is not None and now >= key.grace_until:
        return f"This API key was rotated; its old secret stopped working at {_when(key.grace_until)}."
    return None


class Authenticator:
    def __init__(
        self,
        keys: KeyStore,
        admin_key_hash: str,
        *,
        cache_ttl_s: float = 0.5,
        cache_max: int = 100_000,
        touch_interval_s: float = TOUCH_INTERVAL_S,
        clock: Callable[[], float] = time.time,
        operators: OperatorStore | None = None,
        admin_keys: AdminKeyReader | None = None,
    ) -> None:
        """``admin_key_hash``: the admin key's hash when there is no ``admin_keys`` store
        (which, when given, says which keys are the admin key instead)."""
        if not 0 <= cache_ttl_s <= CACHE_TTL_MAX_S:
            raise ValueError(f"cache_ttl_s: expected 0 to {CACHE_TTL_MAX_S} s")
        self._keys = keys
        self._admin_store = admin_keys
        self._admin: Mapping[str, float | None] = {admin_key_hash: None}
        """admin key hash -> when it stops working (None: the current key)"""
        self._admin_due = 0.0
        """monotonic time from which ``_admin`` is read again from ``_admin_store``"""
        self._admin_lock = asyncio.Lock()
        self._ttl = cache_ttl_s
        self._max = cache_max
        self.clock = clock
        """The time a key's expiry and grace are judged on (the database's: replicas share keys)."""
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._reading: dict[str, asyncio.Task[Principal | None]] = {}
        """digest -> the store read in flight for it, which every caller meanwhile awaits"""
        self._touch_every = touch_interval_s
        self._touch_due: dict[str, float] = {}
        """key id -> monotonic time before which its use is not written again"""
        self._used: dict[str, float] = {}
        """key id -> wall time of a use not written yet"""
        self._toucher: asyncio.Task[None] | None = None
        self._operators = operators
        self._operator_cache: dict[str, tuple[float, Operator | None]] = {}

    async def user(self, authorization: str | None) -> Principal:
        token = _bearer(authorization)
        if token is None:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        digest = hash_key(token)
        mono = time.monotonic()
        hit = self._cache.get(digest)
        principal = hit[1] if hit is not None and hit[0] > mono else await self._lookup(digest, mono)
        if principal is None:
            raise unauthorized("Invalid API key.")
        key = principal.key
        if key.account_status == "closed":
            raise GatewayError(403, "account_closed", "This API key's account is closed.")
        if key.revoked_at is not None or key.expires_at is not None or key.grace_until is not None:
            why = refusal(key, self.clock())
            if why is not None:
                raise unauthorized(why)
        if key.account_status == "suspended":
            raise GatewayError(
                403, "account_suspended", "This API key's account is suspended: new requests are refused."
            )
        if mono >= self._touch_due.get(key.id, 0.0):
            self._touched(key.id, mono)
        return principal

    async def _lookup(self, digest: str, mono: float) -> Principal | None:
        """The key of ``digest`` from the store, cached; callers that miss the cache
        while a read of the same digest is in flight share it (each time an entry
        expires, the requests in flight then would otherwise each read the store)."""
        task = self._reading.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._read(digest))
            self._reading[digest] = task
            task.add_done_callback(lambda t: self._read_done(digest, mono, t))
        return await asyncio.shield(task)  # a caller that leaves does not cancel the others' read

    def _read_done(self, digest: str, mono: float, task: asyncio.Task[Principal | None]) -> None:
        """Cache what ``task`` read, unless a ``forget`` came meanwhile (it may predate that)."""
        failed = task.cancelled() or task.exception() is not None  # raised to its callers, not kept
        if self._reading.get(digest) is not task:
            return
        del self._reading[digest]
        if failed:
            return
        if len(self._cache) >= self._max:
            self._cache.clear()
        self._cache[digest] = (mono + self._ttl, task.result())

    async def _read(self, digest: str) -> Principal | None:
        key = await self._keys.key_by_hash(digest)
        if key is None and await self._admin_key(digest) is not None:
            raise GatewayError(
                403,
                "admin_key_not_allowed",
                "The admin key is for the admin API only; use an API key for /v1.",
            )
        return None if key is None else Principal(key, KeyLimits(key.rpm, key.tpm, key.max_streams))

    def forget(self, key_id: str) -> None:
        """Drop the cached lookups of ``key_id`` (revoked or rotated here just now)."""
        stale = [d for d, (_, p) in self._cache.items() if p is not None and p.key.id == key_id]
        for digest in stale:
            self._cache.pop(digest, None)
        self._reading.clear()  # a read in flight may predate the change: the next caller reads again

    def forget_account(self, account_id: str) -> None:
        """Drop the cached lookups of every key of ``account_id`` (its status changed here)."""
        stale = [d for d, (_, p) in self._cache.items() if p is not None and p.key.account_id == account_id]
        for digest in stale:
            self._cache.pop(digest, None)
        self._reading.clear()

    # -- last use, written off the response path -------------------------------------------

    def _touched(self, key_id: str, mono: float) -> None:
        if len(self._touch_due) >= self._max:
            self._touch_due.clear()
        self._touch_due[key_id] = mono + self._touch_every
        self._used[key_id] = self.clock()
        if self._toucher is None or self._toucher.done():
            self._toucher = asyncio.create_task(self._write_uses(), name="bourse-key-last-used")

    async def _write_uses(self) -> None:
        while self._used:
            used, self._used = self._used, {}
            try:
                await self._keys.touch_keys(used)
            except Exception as exc:  # a later use writes it again
                log.warning("last_used_at of %d keys not written: %s", len(used), exc)
                for key_id in used:
                    self._touch_due.pop(key_id, None)

    async def aclose(self) -> None:
        """Write the uses not written yet."""
        if self._toucher is not None:
            await self._toucher

    async def admin(self, authorization: str | None) -> AdminCaller:
        """The admin key (an owner) or an operator key's operator; 401 for none, an unknown
        or a revoked operator key, an admin key rotated out whose grace period ended;
        403 ``admin_only`` for any other key."""
        token = _bearer(authorization)
        if token is None:
            raise unauthorized("Missing admin key: send 'Authorization: Bearer <admin key>'.")
        caller = await self.staff(hash_key(token), operator_key=token.startswith(OPERATOR_PREFIX))
        if caller is None:
            raise GatewayError(
                403, "admin_only", "This is the admin API; it needs the admin key or an operator key."
            )
        return caller

    # -- the admin key -----------------------------------------------------------------------

    async def admin_keys(self) -> Mapping[str, float | None]:
        """Each admin key's hash -> when it stops working (None: the current key), as the
        database said at most ``cache_ttl_s`` ago."""
        if self._admin_store is None or time.monotonic() < self._admin_due:
            return self._admin
        async with self._admin_lock:  # one read for every request that found it stale
            mono = time.monotonic()
            if mono >= self._admin_due:
                rows = await self._admin_store.admin_keys()
                self._admin = {k.key_hash: k.valid_until for k in rows}
                self._admin_due = mono + self._ttl
        return self._admin

    def forget_admin_keys(self) -> None:
        """Read the admin keys again on the next request (rotated here just now)."""
        self._admin_due = 0.0

    async def _admin_key(self, digest: str) -> AdminCaller | None:
        """The owner, for an admin key that works; 401 for one whose grace period ended."""
        keys = await self.admin_keys()
        if digest not in keys:
            return None
        until = keys[digest]
        if until is not None and self.clock() >= until:
            raise unauthorized(f"The admin key was rotated; this key stopped working at {_when(until)}.")
        return AdminCaller("owner")

    async def staff(self, digest: str, *, operator_key: bool) -> AdminCaller | None:
        """Who a key's hash is on the admin side: the admin key (an owner) or, for an
        operator key (``operator_key``: its prefix), its operator; None for neither.
        401 for an admin key rotated out past its grace, an unknown or revoked operator key."""
        caller = await self._admin_key(digest)
        if caller is not None:
            return caller
        if operator_key and self._operators is not None:
            mono = time.monotonic()
            hit = self._operator_cache.get(digest)
            if hit is not None and hit[0] > mono:
                op = hit[1]
            else:
                op = await self._operators.operator_by_hash(digest)
                if len(self._operator_cache) >= self._max:
                    self._operator_cache.clear()
                self._operator_cache[digest] = (mono + self._ttl, op)
            if op is None:
                raise unauthorized("Invalid operator key.")
            if op.revoked_at is not None:
                raise unauthorized("This operator key was revoked.")
            return AdminCaller(op.role, op)
        return None

    def forget_operator(self, operator_id: str) -> None:
        """Drop the cached lookups of ``operator_id`` (revoked here just now)."""
        stale = [d for d, (_, op) in self._operator_cache.items() if op is not None and op.id == operator_id]
        for digest in stale:
            self._operator_cache.pop(digest, None)

    @staticmethod
    def check_product(principal: Principal, product: str) -> None:
        allowed = principal.key.products
        if allowed is not None and product not in allowed:
            raise GatewayError(
                403,
                "model_not_allowed",
                f"This API key may not use '{product}' (allowed: {', '.join(allowed)}).",
                param="model",
            )

    @staticmethod
    def issue_secret() -> tuple[str, str]:
        """A new API key secret (shown once) and its hash (stored)."""
        secret = new_secret("bk_")
        return secret, hash_key(secret)
