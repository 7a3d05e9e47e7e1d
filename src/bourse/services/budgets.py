"""An account's spend cap by period (issue 37): at most so much held or charged by all
its keys together in ``total`` or per UTC ``day``, ``week`` or ``month``
(:mod:`bourse.domain.periods`), set when the account is created or later
(:meth:`AccountCaps.update_account`), and the account as the admin API shows it
(:func:`account_view`: what the current period has taken, and when it ends).

The ledger counts each hold on the cap in the hold's own transaction, beside its key's
(:mod:`bourse.storage.ledger`); a new period starts the count at zero by itself. A
change is audited (``account.update``) in the same transaction, and in force for new
requests at once on this replica (its cached keys of the account are dropped), within
the key cache's TTL on the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Protocol

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import usd_to_micros
from bourse.domain.periods import CAP_PERIODS, period_end, spent_now
from bourse.ports.stores import Account, AccountClosed, AuditEntry, UnknownAccount, audit_entry
from bourse.services.auth import Authenticator
from bourse.services.keys import account_closed

EDITABLE = frozenset(("spend_cap_usd", "spend_cap_period"))
"""The fields of an account an edit may set."""


class AccountCapStore(Protocol):
    async def account(self, account_id: str) -> Account | None: ...
    async def update_account(
        self, account_id: str, changes: Mapping[str, Any], *, audit: AuditEntry | None = None
    ) -> Account:
        """Set ``spend_cap_micros`` and/or ``spend_cap_period`` of an account not closed (a
        cap given to an account that had none counts ``total`` unless a period is given);
        its spend counter stays as it is. UnknownAccount, AccountClosed."""


def account_view(acc: Account, now: float) -> dict[str, Any]:
    """An account as the admin API shows it: its totals, status and spend cap, with
    ``spend_micros`` what the cap's current period has taken (0 once it is over) and
    ``spend_cap_resets_at`` when that period ends (None: no cap, or ``total``)."""
    view = asdict(acc)
    view.pop("spend_period")
    period = acc.spend_cap_period
    view["spend_micros"] = spent_now(period, acc.spend_period, acc.spend_micros, now)
    view["spend_cap_resets_at"] = None if period is None else period_end(period, now)
    return view


def cap_micros(usd: float | None) -> int | None:
    """A cap in USD as micro-USD (None: no cap); 400 under one micro-USD."""
    if usd is None:
        return None
    micros = usd_to_micros(usd)
    if micros <= 0:
        raise invalid_request("spend_cap_usd: must be at least 0.000001", param="spend_cap_usd")
    return micros


def _not_found(account_id: str) -> GatewayError:
    return GatewayError(404, "not_found", f"No account '{account_id}'.")


class AccountCaps:
    """The account-cap use case of :class:`bourse.services.accounts.AdminService`."""

    store: AccountCapStore
    auth: Authenticator

    def now(self) -> float:
        raise NotImplementedError

    async def update_account(self, account_id: str, changes: Mapping[str, Any], actor: str) -> dict[str, Any]:
        """Set an account's ``spend_cap_usd`` (None: no cap) and/or ``spend_cap_period``.
        A new period starts its count at zero (holds placed before give back to their
        own period only); a new amount keeps the count (one below it refuses new holds
        until the period turns). 400 for a bad field, 404 for no account, 409 for a
        closed one."""
        unknown = sorted(set(changes) - EDITABLE)
        if unknown:
            raise invalid_request(
                f"{unknown[0]}: not a field of an account that can be edited", param=unknown[0]
            )
        if not changes:
            raise invalid_request("nothing to change: give spend_cap_usd or spend_cap_period", param=None)
        fields: dict[str, Any] = {}
        if "spend_cap_period" in changes:
            if changes["spend_cap_period"] not in CAP_PERIODS:
                raise invalid_request(f"spend_cap_period: expected one of {', '.join(CAP_PERIODS)} "
                                      "(clear the cap with spend_cap_usd: null)", param="spend_cap_period")  # fmt: skip
            fields["spend_cap_period"] = changes["spend_cap_period"]
        store = self.store
        if "spend_cap_usd" in changes:
            fields["spend_cap_micros"] = cap_micros(changes["spend_cap_usd"])
            if fields["spend_cap_micros"] is None:
                fields["spend_cap_period"] = None
        else:
            acc = await store.account(account_id)
            if acc is None:
                raise _not_found(account_id)
            if acc.spend_cap_micros is None:
                raise invalid_request("spend_cap_period: the account has no spend cap; give spend_cap_usd too",
                                      param="spend_cap_period")  # fmt: skip
        now = self.now()
        entry = audit_entry(actor, "account.update", account_id, dict(fields), now)
        try:
            acc = await store.update_account(account_id, fields, audit=entry)
        except UnknownAccount:
            raise _not_found(account_id) from None
        except AccountClosed:
            raise account_closed(account_id) from None
        self.auth.forget_account(account_id)
        return account_view(acc, now)
