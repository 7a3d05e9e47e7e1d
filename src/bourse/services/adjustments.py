"""An operator's money adjustments of an account (issue 37): a debit and a refund, each
with its reason, each a ledger entry and an audit entry written in one transaction.

- A **debit** takes money from the balance: a hold placed and settled for its whole
  amount at once, with a usage record whose outcome is ``debit`` (so the books'
  identity, credits = balances + holds + charges, holds as for any charge; the usage
  export lists it; no balance is ever written by itself). Refused with 402
  ``insufficient_funds`` past the balance: a debit never makes a balance negative.
- A **refund** gives money back: a credit whose memo is the reason, audited as
  ``account.refund`` (a plain credit is ``account.credit``).
"""

from __future__ import annotations

from typing import Any, Protocol

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import micros_to_usd, usd_to_micros
from bourse.ports.stores import (
    Account,
    AuditEntry,
    Hold,
    InsufficientFunds,
    UnknownAccount,
    UsageRecord,
    audit_entry,
)
from bourse.services.budgets import account_view
from bourse.services.ids import new_hold_id, sortable_hex

MAX_REASON = 500
"""The longest reason an adjustment keeps (characters)."""


class AdjustmentStore(Protocol):
    async def debit(self, hold: Hold, usage: UsageRecord, now: float, *, audit: AuditEntry) -> Hold: ...

    async def credit(
        self,
        account_id: str,
        amount_micros: int,
        now: float,
        memo: str = "",
        *,
        audit: AuditEntry | None = None,
    ) -> Account: ...

    async def account(self, account_id: str) -> Account | None: ...


class Adjustments:
    """The adjustment use cases of :class:`bourse.services.accounts.AdminService`."""

    store: AdjustmentStore

    def now(self) -> float:
        raise NotImplementedError

    async def debit(self, account_id: str, amount_usd: float, reason: str, actor: str) -> dict[str, Any]:
        """Take ``amount_usd`` from the account's balance, for ``reason``; the account
        after it, and the debit's ``request_id`` and amount."""
        micros, reason = _checked(amount_usd, reason)
        now = self.now()
        store = self.store
        request_id = "debit_" + sortable_hex()
        hold = Hold(
            id=new_hold_id(), account_id=account_id, request_id=request_id,
            amount_micros=micros, state="open", created_at=now, note=f"debit: {reason}",
        )  # fmt: skip
        usage = debit_usage(hold, reason, actor, now)
        detail = {"amount_micros": micros, "reason": reason, "request_id": request_id}
        try:
            await store.debit(
                hold, usage, now, audit=audit_entry(actor, "account.debit", account_id, detail, now)
            )
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        except InsufficientFunds as exc:
            raise GatewayError(
                402, "insufficient_funds",
                f"The balance ({exc.balance_micros} micro-USD) cannot cover a debit of {micros} micro-USD.",
            ) from None  # fmt: skip
        acc = await store.account(account_id)
        assert acc is not None
        return {**account_view(acc, now), "debit": {"request_id": request_id, "amount_micros": micros}}

    async def refund(self, account_id: str, amount_usd: float, reason: str, actor: str) -> dict[str, Any]:
        """Give ``amount_usd`` back to the account, for ``reason``: a credit, audited as a refund."""
        micros, reason = _checked(amount_usd, reason)
        now = self.now()
        store = self.store
        entry = audit_entry(
            actor, "account.refund", account_id, {"amount_micros": micros, "reason": reason}, now
        )
        try:
            acc = await store.credit(account_id, micros, now, f"refund: {reason}", audit=entry)
        except UnknownAccount:
            raise GatewayError(404, "not_found", f"No account '{account_id}'.") from None
        return account_view(acc, now)


def _checked(amount_usd: float, reason: str) -> tuple[int, str]:
    micros = usd_to_micros(amount_usd)
    if micros <= 0:
        raise invalid_request("amount_usd: must be at least 0.000001", param="amount_usd")
    reason = reason.strip()
    if not reason or len(reason) > MAX_REASON:
        raise invalid_request(f"reason: expected 1 to {MAX_REASON} characters", param="reason")
    return micros, reason


def debit_usage(hold: Hold, reason: str, actor: str, now: float) -> UsageRecord:
    """The usage record of a debit: no tokens, its cost the debit, its reason and actor."""
    micros = hold.amount_micros
    doc = {
        "id": hold.request_id,
        "object": "bourse.usage",
        "created": int(now),
        "model": "",
        "outcome": "debit",
        "usage": {"cost": micros_to_usd(micros), "cost_micros": micros},
        "receipt": {"outcome": "debit", "cost_micros": micros},
        "adjustment": {"kind": "debit", "reason": reason, "actor": actor},
    }
    return UsageRecord(hold.request_id, hold.account_id, "", now, "debit", micros, doc)
