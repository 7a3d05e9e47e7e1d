"""Who is calling: API keys (stored hashed) and the admin key.

Keys are 32 random bytes shown once at creation (``bk_…``); the store keeps their
SHA-256 (a fast hash is right for high-entropy secrets). Looked-up keys are cached
for ``cache_ttl_s`` so the hot path does not hit the database on every request.
The admin key is separate: it reaches only the admin API, never ``/v1``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass

from bourse.domain.errors import GatewayError
from bourse.ports.limits import KeyLimits
from bourse.ports.stores import ApiKey, KeyStore


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


@dataclass(slots=True, frozen=True)
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


class Authenticator:
    def __init__(
        self, keys: KeyStore, admin_key_hash: str, *, cache_ttl_s: float = 30.0, cache_max: int = 100_000
    ) -> None:
        self._keys = keys
        self._admin_hash = admin_key_hash
        self._ttl = cache_ttl_s
        self._max = cache_max
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    async def user(self, authorization: str | None) -> Principal:
        token = _bearer(authorization)
        if token is None:
            raise unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        digest = hash_key(token)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            principal = hit[1]
        else:
            if hmac.compare_digest(digest, self._admin_hash):
                raise GatewayError(
                    403,
                    "admin_key_not_allowed",
                    "The admin key is for the admin API only; use an API key for /v1.",
                )
            key = await self._keys.key_by_hash(digest)
            principal = None if key is None else Principal(key, KeyLimits(key.rpm, key.tpm, key.max_streams))
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[digest] = (now + self._ttl, principal)
        if principal is None:
            raise unauthorized("Invalid API key.")
        return principal

    def admin(self, authorization: str | None) -> None:
        token = _bearer(authorization)
        if token is None:
            raise unauthorized("Missing admin key: send 'Authorization: Bearer <admin key>'.")
        if not hmac.compare_digest(hash_key(token), self._admin_hash):
            raise GatewayError(403, "admin_only", "This is the admin API; it needs the admin key.")

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

    async def create_key(
        self,
        account_id: str,
        products: tuple[str, ...] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        max_streams: int | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key for ``account_id``: (the secret, shown once; its record)."""
        secret = new_secret("bk_")
        key = ApiKey(
            id="key_" + os.urandom(8).hex(),
            account_id=account_id,
            products=products,
            rpm=rpm,
            tpm=tpm,
            max_streams=max_streams,
            created_at=time.time(),
        )
        await self._keys.create_key(key, hash_key(secret))
        return secret, key
