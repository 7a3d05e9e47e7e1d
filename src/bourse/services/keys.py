"""Operator use cases on API keys: create (the secret shown once), list, edit, revoke,
rotate with a grace period. Each change is audited in the same transaction, and
dropped from this replica's key cache at once (:meth:`Authenticator.forget`); the
other replicas see it within the cache's TTL (at most
:data:`bourse.services.auth.CACHE_TTL_MAX_S`, 1 s), as a revocation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict
from typing import Any, Protocol

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import usd_to_micros
from bourse.domain.periods import CAP_PERIODS, CapPeriod, spent_now
from bourse.ports.stores import (
    AccountClosed,
    ApiKey,
    KeyChanged,
    KeyRevoked,
    KeyStore,
    UnknownAccount,
    UnknownKey,
    WebhookSecretStore,
    WebhookSecretUnreadable,
    audit_entry,
)
from bourse.services.auth import Authenticator

log = logging.getLogger("bourse.admin")

SYSTEM = "system"
"""The actor of what the gateway does by itself (the demo account at the first start)."""

MAX_GRACE_S = 7 * 86_400
"""The longest a rotated-out secret keeps working."""


class KeyAdminStore(KeyStore, WebhookSecretStore, Protocol):
    pass


def key_view(key: ApiKey, now: float) -> dict[str, Any]:
    """A key as the admin API shows it (never its secret nor its hash): its ``state``
    (``active``, ``revoked`` or ``expired``) and what its cap's current period has taken."""
    view = asdict(key)
    view.pop("grace_until")
    view.pop("account_status")
    view.pop("account_cap_period")
    state = "active"
    if key.revoked_at is not None:
        state = "revoked"
    elif key.expires_at is not None and now >= key.expires_at:
        state = "expired"
    view["state"] = state
    view["spend_micros"] = spent_now(key.spend_cap_period, key.spend_period, key.spend_micros, now)
    view.pop("spend_period")
    return view


def account_closed(account_id: str) -> GatewayError:
    return GatewayError(409, "account_closed", f"The account '{account_id}' is closed.")


def _no_key(key_id: str) -> GatewayError:
    return GatewayError(404, "not_found", f"No API key '{key_id}'.")


class KeyAdmin:
    """The key use cases of :class:`bourse.services.accounts.AdminService`."""

    store: KeyAdminStore
    auth: Authenticator
    products: Collection[str]
    """The products on the exchange now: a key may be limited to these only."""

    def now(self) -> float:
        """Now on the database's clock (the authenticator's): a key's expiry and grace are
        judged by every replica."""
        return self.auth.clock()

    async def create_key(
        self,
        account_id: str,
        products: list[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        max_streams: int | None = None,
        *,
        name: str | None = None,
        expires_at: float | None = None,
        spend_cap_usd: float | None = None,
        spend_cap_period: CapPeriod = "total",
        actor: str = SYSTEM,
    ) -> dict[str, Any]:
        """A new key (its secret shown once, in ``key``). 400 for a product that is not
        configured, an expiry in the past or a cap below one micro-USD; 404 for no account."""
        now = self.now()
        self._check_products(products)
        if expires_at is not None and expires_at <= now:
            raise invalid_request("expires_at: must be in the future", param="expires_at")
        cap = None if spend_cap_usd is None else usd_to_micros(spend_cap_usd)
        if cap is not None and cap <= 0:
            raise invalid_request("spend_cap_usd: must be at least 0.000001", param="spend_cap_usd")
        secret, digest = self.auth.issue_secret()
        key = ApiKey(
            id="key_" + os.urandom(8).hex(),
            account_id=account_id,
            products=tuple(products) if products is not None else None,
            rpm=rpm,
            tpm=tpm,
            max_streams=max_streams,
            created_at=now,
            name=name,
            expires_at=expires_at,
            spend_cap_micros=cap,
            spend_cap_period=None if cap is None else spend_cap_period,
        )
        view = key_view(key, now)
        detail = {k: view[k] for k in _KEY_AUDIT_FIELDS if view[k] is not None}
        try:
            await self.store.create_key(
                key, digest, audit=audit_entry(actor, "key.create", key.id, detail, now)
            )
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        except AccountClosed:
            raise account_closed(account_id) from None
        try:
            webhook_secret = await self.store.webhook_secret(account_id)
        except WebhookSecretUnreadable:  # the key is made; the secret needs a new one (or a re-seal)
            log.warning("account %s: its webhook secret cannot be opened with this gateway's key", account_id)
            webhook_secret = None
        return {"key": secret, **view, "webhook_secret": webhook_secret}

    def _check_products(self, products: list[str] | None) -> None:
        unknown = sorted(set(products or ()) - set(self.products))
        if unknown:
            raise invalid_request(
                f"products: no product {', '.join(repr(p) for p in unknown)} "
                f"(configured: {', '.join(sorted(self.products)) or 'none'})",
                param="products",
            )

    async def keys(self, account_id: str | None, limit: int, after: str | None) -> list[dict[str, Any]]:
        now = self.now()
        return [key_view(k, now) for k in await self.store.keys_page(account_id, limit=limit, after=after)]

    async def revoke_key(self, key_id: str, actor: str = SYSTEM, reason: str | None = None) -> dict[str, Any]:
        """Revoke for good: refused at once on this replica, within the cache TTL on the others."""
        now = self.now()
        entry = audit_entry(actor, "key.revoke", key_id, {} if reason is None else {"reason": reason}, now)
        try:
            key = await self.store.revoke_key(key_id, now, audit=entry)
        except UnknownKey:
            raise _no_key(key_id) from None
        self.auth.forget(key_id)
        return key_view(key, now)

    async def update_key(
        self, key_id: str, changes: Mapping[str, Any], actor: str = SYSTEM
    ) -> dict[str, Any]:
        """Set some of a key's fields (None clears a limit), checked as :meth:`create_key`
        checks them: ``products``, ``rpm``, ``tpm``, ``max_streams``, ``name``,
        ``expires_at``, ``spend_cap_usd``, ``spend_cap_period``. In force for new requests
        at once on this replica, within the key cache's TTL on the others; running
        requests keep what they were admitted with. A new cap period starts its count at
        zero; a new cap amount keeps the count (a cap below it refuses new holds)."""
        now = self.now()
        unknown = sorted(set(changes) - _EDITABLE)
        if unknown:
            raise invalid_request(f"{unknown[0]}: not a field of a key that can be edited", param=unknown[0])
        if not changes:
            raise invalid_request("nothing to change: give at least one field", param=None)
        fields = {k: v for k, v in changes.items() if k not in ("spend_cap_usd", "products")}
        if "products" in changes:
            products = changes["products"]
            self._check_products(products)
            fields["products"] = None if products is None else tuple(products)
        expires_at = fields.get("expires_at")
        if expires_at is not None and expires_at <= now:
            raise invalid_request("expires_at: must be in the future", param="expires_at")
        await self._cap_fields(key_id, changes, fields)
        detail = {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}
        entry = audit_entry(actor, "key.update", key_id, detail, now)
        try:
            key = await self.store.update_key(key_id, fields, audit=entry)
        except UnknownKey:
            raise _no_key(key_id) from None
        except KeyRevoked:
            raise GatewayError(409, "key_revoked", f"The API key '{key_id}' is revoked.") from None
        self.auth.forget(key_id)
        return key_view(key, now)

    async def _cap_fields(self, key_id: str, changes: Mapping[str, Any], fields: dict[str, Any]) -> None:
        """The spend cap's columns of an edit, into ``fields``: a period alone needs a cap
        (a cap given to a key that had none counts ``total`` unless a period is given:
        the store sets that in the same statement)."""
        if "spend_cap_period" in changes and changes["spend_cap_period"] is None:
            raise invalid_request(f"spend_cap_period: expected one of {', '.join(CAP_PERIODS)} "
                                  "(clear the cap with spend_cap_usd: null)", param="spend_cap_period")  # fmt: skip
        if "spend_cap_usd" in changes:
            usd = changes["spend_cap_usd"]
            cap = None if usd is None else usd_to_micros(usd)
            if cap is not None and cap <= 0:
                raise invalid_request("spend_cap_usd: must be at least 0.000001", param="spend_cap_usd")
            fields["spend_cap_micros"] = cap
            if cap is None:
                fields["spend_cap_period"] = None
        elif "spend_cap_period" in fields and (await self._key(key_id)).spend_cap_micros is None:
            raise invalid_request(
                "spend_cap_period: the key has no spend cap; give spend_cap_usd too", param="spend_cap_period"
            )

    async def _key(self, key_id: str) -> ApiKey:
        key = await self.store.key(key_id)
        if key is None:
            raise _no_key(key_id)
        return key

    async def rotate_key(self, key_id: str, grace_s: float, actor: str = SYSTEM) -> dict[str, Any]:
        """A new secret (shown once, in ``key``); the old one works ``grace_s`` more seconds."""
        if not 0 <= grace_s <= MAX_GRACE_S:
            raise invalid_request(f"grace_s: expected 0 to {MAX_GRACE_S} seconds", param="grace_s")
        now = self.now()
        until = now + grace_s
        secret, digest = self.auth.issue_secret()
        entry = audit_entry(actor, "key.rotate", key_id, {"grace_s": grace_s, "old_valid_until": until}, now)
        try:
            key = await self.store.rotate_key(key_id, digest, until, now, audit=entry)
        except UnknownKey:
            raise _no_key(key_id) from None
        except KeyRevoked:
            raise GatewayError(409, "key_revoked", f"The API key '{key_id}' is revoked.") from None
        except KeyChanged:
            raise GatewayError(
                409, "key_changed", f"The API key '{key_id}' changed during this rotation; try again."
            ) from None
        self.auth.forget(key_id)
        return {"key": secret, **key_view(key, now), "old_key_valid_until": until if grace_s > 0 else None}


_EDITABLE = frozenset(
    ("products", "rpm", "tpm", "max_streams", "name", "expires_at", "spend_cap_usd", "spend_cap_period")
)

_KEY_AUDIT_FIELDS = (
    "account_id",
    "name",
    "products",
    "rpm",
    "tpm",
    "max_streams",
    "expires_at",
    "spend_cap_micros",
    "spend_cap_period",
)
