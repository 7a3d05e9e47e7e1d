"""Operator use cases behind the admin API: accounts (created, credited, suspended,
resumed, closed, their spend cap: :mod:`bourse.services.budgets`), credit, keys
(:mod:`bourse.services.keys`), operators (:mod:`bourse.services.operators`), the admin
key (:mod:`bourse.services.admin_key`), holds, the audit log.

Every action that changes something (an account created or credited, a key created,
revoked or rotated, a hold settled or released) writes an audit entry naming its
actor, in the same transaction as the change.

Also the first-start bootstrap: an admin key (from ``BOURSE_ADMIN_KEY`` or generated
and kept in the data folder; the database's own once it has one) and, on the embedded first start or when asked
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
from bourse.domain.periods import CapPeriod
from bourse.ports.admin_keys import AdminKeyStore
from bourse.ports.operators import OperatorStore
from bourse.ports.stores import (
    AccountClosed,
    AccountExists,
    AccountStatus,
    AuditEntry,
    AuditStore,
    Hold,
    HoldNotOpen,
    HoldState,
    KeyStore,
    LedgerStore,
    SealingKeyMissing,
    UnknownAccount,
    UsageRecord,
    UsageStore,
    WebhookSecretStore,
    audit_entry,
    new_webhook_secret,
)
from bourse.services.adjustments import Adjustments, AdjustmentStore
from bourse.services.admin_key import AdminKeyAdmin
from bourse.services.auth import Authenticator, hash_key, new_secret
from bourse.services.budgets import AccountCaps, AccountCapStore, account_view, cap_micros
from bourse.services.keys import SYSTEM, KeyAdmin, account_closed
from bourse.services.operators import OperatorAdmin

log = logging.getLogger("bourse.admin")

DEMO_ACCOUNT = "demo"
DEMO_CREDIT_USD = 5.0


class AdminStore(
    LedgerStore,
    KeyStore,
    UsageStore,
    WebhookSecretStore,
    AdjustmentStore,
    OperatorStore,
    AccountCapStore,
    AdminKeyStore,
    Protocol,
):
    pass


def _sealing_key_missing(exc: SealingKeyMissing) -> GatewayError:
    """Another replica re-sealed with a key this one lacks: another replica can answer."""
    return GatewayError(
        503, "no_capacity", f"This gateway cannot seal secrets now: {exc}", headers={"retry-after": "5"}
    )


def hold_view(h: Hold) -> dict[str, Any]:
    return asdict(h)


def audit_view(entry: AuditEntry) -> dict[str, Any]:
    return {**asdict(entry), "detail": dict(entry.detail)}


class AdminService(KeyAdmin, AccountCaps, Adjustments, OperatorAdmin, AdminKeyAdmin):
    store: AdminStore

    def __init__(
        self,
        store: AdminStore,
        auth: Authenticator,
        *,
        products: Collection[str],
        audit: AuditStore,
        admin_key_file: Path | None = None,
    ) -> None:
        self.store = store
        self.auth = auth
        self.admin_key_file = admin_key_file
        """The data folder's ``admin_key`` when the configured admin key came from it
        (a rotation writes the new key there)."""
        self.products = products
        """The products on the exchange now (a live view): a key may be limited to these only."""
        self.audit = audit

    async def create_account(
        self,
        account_id: str,
        credit_usd: float,
        actor: str = SYSTEM,
        *,
        spend_cap_usd: float | None = None,
        spend_cap_period: CapPeriod = "total",
    ) -> dict[str, Any]:
        """A new account with its opening credit and, if given, a spend cap of
        ``spend_cap_usd`` per ``spend_cap_period`` (:mod:`bourse.services.budgets`)."""
        if not account_id or len(account_id) > 128:
            raise invalid_request("id: expected 1 to 128 characters", param="id")
        if credit_usd < 0:
            raise invalid_request("credit_usd: must not be negative", param="credit_usd")
        micros = usd_to_micros(credit_usd)
        cap = cap_micros(spend_cap_usd)
        now = self.now()
        detail: dict[str, Any] = {"credit_micros": micros}
        if cap is not None:
            detail |= {"spend_cap_micros": cap, "spend_cap_period": spend_cap_period}
        entry = audit_entry(actor, "account.create", account_id, detail, now)
        try:
            acc = await self.store.create_account(
                account_id, micros, now, audit=entry, spend_cap_micros=cap, spend_cap_period=spend_cap_period
            )
        except AccountExists:
            raise GatewayError(409, "account_exists", f"The account '{account_id}' exists already.") from None
        except SealingKeyMissing as exc:
            raise _sealing_key_missing(exc) from None
        return account_view(acc, now)

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
        return account_view(acc, now)

    async def suspend_account(
        self, account_id: str, reason: str | None, actor: str = SYSTEM
    ) -> dict[str, Any]:
        """Refuse the account's keys new requests (403 ``account_suspended``): at once on
        this replica, within the key cache's TTL on the others; running ones finish."""
        return await self._set_status(account_id, "suspended", reason, actor)

    async def resume_account(
        self, account_id: str, reason: str | None = None, actor: str = SYSTEM
    ) -> dict[str, Any]:
        """Let a suspended account's keys work again (a closed account stays closed: 409);
        ``reason`` goes to the audit log only."""
        return await self._set_status(account_id, "active", reason, actor)

    async def close_account(self, account_id: str, reason: str | None, actor: str = SYSTEM) -> dict[str, Any]:
        """Close for good: its keys revoked (refused at once here, within the key cache's
        TTL elsewhere: 403 ``account_closed``), running requests finish; the answer
        reports the balance (and the holds still open) and how many keys were revoked."""
        now = self.now()
        entry = audit_entry(
            actor, "account.close", account_id, {} if reason is None else {"reason": reason}, now
        )
        try:
            acc, revoked = await self.store.close_account(account_id, reason, now, audit=entry)
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        except AccountClosed:
            raise account_closed(account_id) from None
        self.auth.forget_account(account_id)
        log.info(
            "account %s closed: %d keys revoked, balance %d micro-USD",
            account_id,
            revoked,
            acc.balance_micros,
        )
        return {**account_view(acc, now), "revoked_keys": revoked}

    async def _set_status(
        self, account_id: str, status: AccountStatus, reason: str | None, actor: str
    ) -> dict[str, Any]:
        now = self.now()
        action = "account.suspend" if status == "suspended" else "account.resume"
        entry = audit_entry(actor, action, account_id, {} if reason is None else {"reason": reason}, now)
        try:
            kept = reason if status != "active" else None
            acc = await self.store.set_account_status(account_id, status, kept, audit=entry)
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        except AccountClosed:
            raise account_closed(account_id) from None
        self.auth.forget_account(account_id)
        return account_view(acc, now)

    async def accounts(self, limit: int, after: str | None) -> list[dict[str, Any]]:
        now = self.now()
        return [account_view(a, now) for a in await self.store.accounts_page(limit=limit, after=after)]

    async def account(self, account_id: str) -> dict[str, Any]:
        acc = await self.store.account(account_id)
        if acc is None:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.")
        return account_view(acc, self.now())

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
