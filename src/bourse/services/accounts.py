"""Operator use cases behind the admin API: accounts, credit, keys, holds, the audit log.

Every action that changes something (an account created or credited, a key created,
revoked or rotated, a hold settled or released) writes an audit entry naming its
actor, in the same transaction as the change.

Also the first-start bootstrap: an admin key (from ``BOURSE_ADMIN_KEY`` or generated
and kept in the data folder) and, on the embedded first start or when asked
(:func:`demo_rule`), a demo account and key so that ``bourse serve`` is usable in one
step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import charge, micros_to_usd, price_units, usd_to_micros
from bourse.ports.stores import (
    AccountExists,
    ApiKey,
    AuditEntry,
    AuditStore,
    CapPeriod,
    Hold,
    HoldNotOpen,
    HoldState,
    KeyChanged,
    KeyRevoked,
    KeyStore,
    LedgerStore,
    SealingKeyMissing,
    UnknownAccount,
    UnknownKey,
    UsageRecord,
    UsageStore,
    WebhookSecretStore,
    WebhookSecretUnreadable,
    audit_entry,
    cap_period,
    new_webhook_secret,
)
from bourse.services.auth import Authenticator, hash_key, new_secret

log = logging.getLogger("bourse.admin")

DEMO_ACCOUNT = "demo"
DEMO_CREDIT_USD = 5.0
SYSTEM = "system"
"""The actor of what the gateway does by itself (the demo account at the first start)."""
MAX_GRACE_S = 7 * 86_400
"""The longest a rotated-out secret keeps working."""


class AdminStore(LedgerStore, KeyStore, UsageStore, WebhookSecretStore, Protocol):
    pass


def _sealing_key_missing(exc: SealingKeyMissing) -> GatewayError:
    """Another replica re-sealed with a key this one lacks: another replica can answer."""
    return GatewayError(
        503, "no_capacity", f"This gateway cannot seal secrets now: {exc}", headers={"retry-after": "5"}
    )


def hold_view(h: Hold) -> dict[str, Any]:
    return asdict(h)


def key_view(key: ApiKey, now: float) -> dict[str, Any]:
    """A key as the admin API shows it (never its secret nor its hash): its ``state``
    (``active``, ``revoked`` or ``expired``) and what its cap's current period has taken."""
    view = asdict(key)
    view.pop("grace_until")
    state = "active"
    if key.revoked_at is not None:
        state = "revoked"
    elif key.expires_at is not None and now >= key.expires_at:
        state = "expired"
    view["state"] = state
    period = key.spend_cap_period
    current = period is not None and key.spend_period == cap_period(period, now)
    view["spend_micros"] = key.spend_micros if current else 0
    view.pop("spend_period")
    return view


def audit_view(entry: AuditEntry) -> dict[str, Any]:
    return {**asdict(entry), "detail": dict(entry.detail)}


def _no_key(key_id: str) -> GatewayError:
    return GatewayError(404, "not_found", f"No API key '{key_id}'.")


class AdminService:
    def __init__(
        self, store: AdminStore, auth: Authenticator, *, products: Collection[str], audit: AuditStore
    ) -> None:
        self.store = store
        self.auth = auth
        self.products = frozenset(products)
        """The configured products: a key may be limited to these only."""
        self.audit = audit

    def now(self) -> float:
        """Now on the database's clock (the authenticator's): a key's expiry and grace are
        judged by every replica."""
        return self.auth.clock()

    async def create_account(self, account_id: str, credit_usd: float, actor: str = SYSTEM) -> dict[str, Any]:
        if not account_id or len(account_id) > 128:
            raise invalid_request("id: expected 1 to 128 characters", param="id")
        if credit_usd < 0:
            raise invalid_request("credit_usd: must not be negative", param="credit_usd")
        micros = usd_to_micros(credit_usd)
        now = self.now()
        entry = audit_entry(actor, "account.create", account_id, {"credit_micros": micros}, now)
        try:
            acc = await self.store.create_account(account_id, micros, now, audit=entry)
        except AccountExists:
            raise GatewayError(409, "account_exists", f"The account '{account_id}' exists already.") from None
        except SealingKeyMissing as exc:
            raise _sealing_key_missing(exc) from None
        return asdict(acc)

    async def new_webhook_secret(self, account_id: str, actor: str = SYSTEM) -> dict[str, Any]:
        """A new webhook secret for the account (shown once here; it signs every delivery
        from now on, including the held ones, which this releases). The audit entry
        names the change, never the secret."""
        secret = new_webhook_secret()
        now = self.now()
        entry = audit_entry(actor, "account.webhook_secret", account_id, {}, now)
        try:
            released = await self.store.set_webhook_secret(account_id, secret, now, audit=entry)
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        except SealingKeyMissing as exc:
            raise _sealing_key_missing(exc) from None
        log.info("account %s: a new webhook secret (%d held webhooks released)", account_id, released)
        return {"object": "bourse.webhook_secret", "account": account_id, "webhook_secret": secret,
                "released_jobs": released}  # fmt: skip

    async def reseal_webhook_secrets(self, actor: str = SYSTEM) -> dict[str, Any]:
        """Every webhook secret this gateway can open, sealed with its first key (the
        first of ``BOURSE_SECRET_KEY``), which the database names from now on: the step
        of a key rotation after every replica was given ``NEW,OLD``. Secrets it cannot
        open are listed; their accounts need a new secret."""
        now = self.now()
        report = await self.store.reseal_webhook_secrets(
            now, audit=audit_entry(actor, "webhook_secrets.reseal", "webhook_secrets", {}, now)
        )
        log.warning(
            "webhook secrets re-sealed with this gateway's first key: %d re-sealed, %d unchanged, %d unreadable, "
            "%d held webhooks released",
            report.resealed, report.unchanged, report.unreadable_count, report.released_jobs,
        )  # fmt: skip
        return {"object": "bourse.reseal", **asdict(report), "unreadable": list(report.unreadable)}

    async def credit(self, account_id: str, amount_usd: float, actor: str = SYSTEM) -> dict[str, Any]:
        micros = usd_to_micros(amount_usd)
        if micros <= 0:
            raise invalid_request("amount_usd: must be positive", param="amount_usd")
        now = self.now()
        entry = audit_entry(actor, "account.credit", account_id, {"amount_micros": micros}, now)
        try:
            acc = await self.store.credit(account_id, micros, now, "admin credit", audit=entry)
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        return asdict(acc)

    async def accounts(self, limit: int, after: str | None) -> list[dict[str, Any]]:
        return [asdict(a) for a in await self.store.accounts_page(limit=limit, after=after)]

    async def account(self, account_id: str) -> dict[str, Any]:
        acc = await self.store.account(account_id)
        if acc is None:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.")
        return asdict(acc)

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
        try:
            webhook_secret = await self.store.webhook_secret(account_id)
        except WebhookSecretUnreadable:  # the key is made; the secret needs a new one (or a re-seal)
            log.warning("account %s: its webhook secret cannot be opened with this gateway's key", account_id)
            webhook_secret = None
        return {"key": secret, **view, "webhook_secret": webhook_secret}

    def _check_products(self, products: list[str] | None) -> None:
        unknown = sorted(set(products or ()) - self.products)
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

    async def audit_log(
        self, action: str | None, target: str | None, limit: int, after: str | None
    ) -> list[dict[str, Any]]:
        entries = await self.audit.list(action=action, target=target, limit=limit, after=after)
        return [audit_view(e) for e in entries]

    async def holds(
        self, state: HoldState | None, account_id: str | None, limit: int
    ) -> list[dict[str, Any]]:
        return [hold_view(h) for h in await self.store.holds(state, account_id, limit)]

    async def settle_hold(
        self, hold_id: str, amount_micros: int | None, actor: str = SYSTEM
    ) -> dict[str, Any]:
        """Charge a hold (default: its usage estimate, else the whole hold) and write the
        charge into the request's usage record, in one transaction."""
        hold = await self.store.hold(hold_id)
        if hold is None:
            raise GatewayError(404, "not_found", f"No hold '{hold_id}'.")
        existing = await self.store.usage(hold.account_id, hold.request_id)
        if amount_micros is None:
            amount_micros = self._suggested_charge(hold, existing)
        if not 0 <= amount_micros <= hold.amount_micros:
            raise invalid_request(
                f"amount_micros: expected 0 to {hold.amount_micros} (the hold), got {amount_micros}",
                param="amount_micros",
            )
        now = self.now()
        usage = reconciled_usage(hold, existing, "settled", amount_micros, now)
        entry = audit_entry(actor, "hold.settle", hold_id, _hold_detail(hold, amount_micros), now)
        try:
            return hold_view(await self.store.settle(hold_id, amount_micros, usage, now, audit=entry))
        except HoldNotOpen as exc:
            raise _closed(exc) from None

    async def release_hold(self, hold_id: str, actor: str = SYSTEM) -> dict[str, Any]:
        """Give a hold back and note in the request's usage record that nothing was charged."""
        hold = await self.store.hold(hold_id)
        if hold is None:
            raise GatewayError(404, "not_found", f"No hold '{hold_id}'.")
        existing = await self.store.usage(hold.account_id, hold.request_id)
        now = self.now()
        usage = reconciled_usage(hold, existing, "released", 0, now)
        entry = audit_entry(actor, "hold.release", hold_id, _hold_detail(hold, 0), now)
        try:
            return hold_view(await self.store.release(hold_id, usage, now, audit=entry))
        except HoldNotOpen as exc:
            raise _closed(exc) from None

    @staticmethod
    def _suggested_charge(hold: Hold, rec: UsageRecord | None) -> int:
        """The usage record's estimate at its cleared price, else the whole hold."""
        if rec is None:
            return hold.amount_micros
        usage = rec.record.get("usage") or {}
        market = usage.get("x_market") or {}
        price = market.get("cleared_price") or market.get("bid")
        if not isinstance(price, int | float):
            return hold.amount_micros
        paid, _ = charge(
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            price_units(float(price)),
            hold.amount_micros,
        )
        return paid


def _closed(exc: HoldNotOpen) -> GatewayError:
    """An operator's close of a hold that another close has just ended: 409 with the
    state that close left (read in the refused transaction, not before it)."""
    if exc.state is None:
        return GatewayError(404, "not_found", f"No hold '{exc.hold_id}'.")
    return GatewayError(409, "hold_closed", f"The hold '{exc.hold_id}' is already {exc.state}.")


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


def _hold_detail(hold: Hold, charged_micros: int) -> Mapping[str, Any]:
    return {
        "account_id": hold.account_id,
        "request_id": hold.request_id,
        "amount_micros": hold.amount_micros,
        "charged_micros": charged_micros,
        "state_before": hold.state,
    }


def reconciled_usage(
    hold: Hold, existing: UsageRecord | None, action: str, charged_micros: int, now: float
) -> UsageRecord:
    """The usage record of a hold an operator closed: the request's own record (or, when
    its run left none, a new one) with the charge written in and the decision noted
    under ``reconciliation``. Every charge has its usage record."""
    doc: dict[str, Any] = (
        dict(existing.record)
        if existing is not None
        else {
            "id": hold.request_id,
            "object": "bourse.usage",
            "created": int(hold.created_at),
            "model": hold.product,
            "outcome": "reconciling",
            "receipt": {"outcome": "reconciling", "quote_micros": hold.amount_micros},
        }
    )
    doc["usage"] = {
        **(doc.get("usage") or {}),
        "cost": micros_to_usd(charged_micros),
        "cost_micros": charged_micros,
    }
    doc["receipt"] = {**(doc.get("receipt") or {}), "cost_micros": charged_micros}
    doc["reconciliation"] = {"action": action, "charged_micros": charged_micros, "at": now, "note": hold.note}
    return UsageRecord(
        request_id=hold.request_id,
        account_id=hold.account_id,
        product=hold.product,
        created_at=hold.created_at if existing is None else existing.created_at,
        outcome="reconciling" if existing is None else existing.outcome,
        cost_micros=charged_micros,
        record=doc,
    )


def admin_key_hash(data_dir: Path, env_key: str | None) -> tuple[str, str | None]:
    """The admin key's hash, and the key itself when it was generated just now.

    ``BOURSE_ADMIN_KEY`` wins; otherwise the key kept in ``data_dir/admin_key``; on
    the very first start one is generated and written there (mode 600).
    """
    if env_key:
        return hash_key(env_key), None
    path = data_dir / "admin_key"
    if path.exists():
        return hash_key(path.read_text().strip()), None
    key = new_secret("bk_admin_")
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return hash_key(key), key


class DemoRule(Enum):
    """Whether the start makes the ``demo`` account (funded, with an unrestricted key)."""

    OFF = "off"
    FRESH = "fresh"
    """The embedded first start: only into a ledger that has no account yet."""
    ASKED = "asked"
    """``--demo`` or ``[server] demo = true``: whenever the account is missing."""


def demo_rule(*, asked: bool, built_in_config: bool, single_node: bool) -> DemoRule:
    """The demo account is a convenience of trying bourse out (no config file, SQLite),
    never a production default: a ledger served from a config file or shared on
    PostgreSQL gets it only when asked."""
    if asked:
        return DemoRule.ASKED
    if built_in_config and single_node:
        return DemoRule.FRESH
    return DemoRule.OFF


async def bootstrap_demo(admin: AdminService, rule: DemoRule) -> str | None:
    """Create the demo account and a key for it as ``rule`` says, if the account is
    missing; returns the key (None: nothing made)."""
    if rule is DemoRule.OFF or await admin.store.account(DEMO_ACCOUNT) is not None:
        return None
    # a ledger with accounts is no first start: the operator made those without a demo
    if rule is DemoRule.FRESH and await admin.store.accounts_page(limit=1, after=None):
        return None
    try:
        await admin.create_account(DEMO_ACCOUNT, DEMO_CREDIT_USD)
    except GatewayError:  # another replica made it first
        return None
    created = await admin.create_key(DEMO_ACCOUNT, None, None, None, None)
    key: str = created["key"]
    return key
