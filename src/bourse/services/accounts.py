"""Operator use cases behind the admin API: accounts, credit, keys, holds.

Also the first-start bootstrap: an admin key (from ``BOURSE_ADMIN_KEY`` or generated
and kept in the data folder) and a demo account and key so that ``bourse serve`` is
usable in one step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import charge, micros_to_usd, price_units, usd_to_micros
from bourse.ports.stores import (
    AccountExists,
    Hold,
    HoldNotOpen,
    HoldState,
    KeyStore,
    LedgerStore,
    UnknownAccount,
    UsageRecord,
    UsageStore,
)
from bourse.services.auth import Authenticator, hash_key, new_secret

log = logging.getLogger("bourse.admin")

DEMO_ACCOUNT = "demo"
DEMO_CREDIT_USD = 5.0


class AdminStore(LedgerStore, KeyStore, UsageStore, Protocol):
    pass


def hold_view(h: Hold) -> dict[str, Any]:
    return asdict(h)


class AdminService:
    def __init__(self, store: AdminStore, auth: Authenticator) -> None:
        self.store = store
        self.auth = auth

    async def create_account(self, account_id: str, credit_usd: float) -> dict[str, Any]:
        if not account_id or len(account_id) > 128:
            raise invalid_request("id: expected 1 to 128 characters", param="id")
        if credit_usd < 0:
            raise invalid_request("credit_usd: must not be negative", param="credit_usd")
        try:
            acc = await self.store.create_account(account_id, usd_to_micros(credit_usd), time.time())
        except AccountExists:
            raise GatewayError(409, "account_exists", f"The account '{account_id}' exists already.") from None
        return asdict(acc)

    async def credit(self, account_id: str, amount_usd: float) -> dict[str, Any]:
        micros = usd_to_micros(amount_usd)
        if micros <= 0:
            raise invalid_request("amount_usd: must be positive", param="amount_usd")
        try:
            acc = await self.store.credit(account_id, micros, time.time(), "admin credit")
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        return asdict(acc)

    async def account(self, account_id: str) -> dict[str, Any]:
        acc = await self.store.account(account_id)
        if acc is None:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.")
        return asdict(acc)

    async def create_key(
        self,
        account_id: str,
        products: list[str] | None,
        rpm: int | None,
        tpm: int | None,
        max_streams: int | None,
    ) -> dict[str, Any]:
        try:
            secret, key = await self.auth.create_key(
                account_id, tuple(products) if products is not None else None, rpm, tpm, max_streams
            )
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        secret_hook = getattr(self.store, "webhook_secret", None)
        webhook_secret = await secret_hook(account_id) if secret_hook is not None else None
        return {"key": secret, **asdict(key), "webhook_secret": webhook_secret}

    async def holds(
        self, state: HoldState | None, account_id: str | None, limit: int
    ) -> list[dict[str, Any]]:
        return [hold_view(h) for h in await self.store.holds(state, account_id, limit)]

    async def settle_hold(self, hold_id: str, amount_micros: int | None) -> dict[str, Any]:
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
        now = time.time()
        usage = reconciled_usage(hold, existing, "settled", amount_micros, now)
        try:
            return hold_view(await self.store.settle(hold_id, amount_micros, usage, now))
        except HoldNotOpen:
            raise GatewayError(409, "hold_closed", f"The hold '{hold_id}' is already {hold.state}.") from None

    async def release_hold(self, hold_id: str) -> dict[str, Any]:
        """Give a hold back and note in the request's usage record that nothing was charged."""
        hold = await self.store.hold(hold_id)
        if hold is None:
            raise GatewayError(404, "not_found", f"No hold '{hold_id}'.")
        existing = await self.store.usage(hold.account_id, hold.request_id)
        now = time.time()
        usage = reconciled_usage(hold, existing, "released", 0, now)
        try:
            return hold_view(await self.store.release(hold_id, usage, now))
        except HoldNotOpen:
            raise GatewayError(409, "hold_closed", f"The hold '{hold_id}' is already {hold.state}.") from None

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
        return charge(
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
            price_units(float(price)),
            hold.amount_micros,
        )


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


async def bootstrap_demo(admin: AdminService) -> str | None:
    """Create the demo account and a key for it if the account is missing; returns the key."""
    if await admin.store.account(DEMO_ACCOUNT) is not None:
        return None
    try:
        await admin.create_account(DEMO_ACCOUNT, DEMO_CREDIT_USD)
    except GatewayError:
        return None
    created = await admin.create_key(DEMO_ACCOUNT, None, None, None, None)
    key: str = created["key"]
    return key
