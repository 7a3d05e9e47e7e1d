"""Storage ports: one small interface per concern (ledger, keys, usage, idempotency, audit).

Adapters live in ``bourse.storage`` (SQLite, PostgreSQL); the same contract tests
run over each. All amounts are integer micro-USD.

An API key may carry a spend cap: what its holds take (while open or reconciling)
and what they charge, per period (``total``, or the UTC ``day``, ``week`` or ``month``
of :mod:`bourse.domain.periods`), is counted on the key in the same transaction as
the hold, so concurrent requests can never take more than the cap; a closed hold gives back what it did not charge.
An account may carry one too, counted the same way in the same transaction.

Admin actions are written to an audit log in the same transaction as the change
they record (the ``audit`` argument of the methods that take one).

The ledger follows two-phase transfers: a hold moves money out of an account's
balance into an *open* hold; it is then *settled* (charged up to its amount, the
rest returned), *released* (all returned), or moved to *reconciling* when its run's
outcome is unknown (a crash, a missing usage block under the reconcile policy), for
an operator to settle or release. The invariant every adapter keeps::

    credits = balances + open and reconciling holds + revenue

revenue being the settled holds' charges plus those of the settled holds that
retention deleted (:class:`RetentionStore`, kept per account).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, Literal, Protocol

from bourse.domain.periods import CapPeriod
from bourse.domain.values import immutable
from bourse.ports.budgets import KeyBudgetExceeded as KeyBudgetExceeded  # where it was first

HoldState = Literal["open", "settled", "released", "reconciling"]
AccountStatus = Literal["active", "suspended", "closed"]


@immutable
class Account:
    id: str
    balance_micros: int
    open_holds_micros: int = 0
    reconciling_micros: int = 0
    spent_micros: int = 0
    credited_micros: int = 0
    created_at: float = 0.0
    status: AccountStatus = "active"
    """``suspended``: its keys are refused new requests; ``closed``: for good."""
    status_reason: str | None = None  # the operator's note, never shown to its callers
    spend_cap_micros: int | None = None
    spend_cap_period: CapPeriod | None = None
    spend_micros: int = 0  # what its holds took in spend_period (as a key's: ApiKey.spend_micros)
    spend_period: int = 0


@immutable
class Hold:
    id: str
    account_id: str
    request_id: str
    amount_micros: int
    state: HoldState
    charged_micros: int = 0
    owner: str = ""
    product: str = ""
    created_at: float = 0.0
    note: str | None = None
    key_id: str | None = None
    """The API key the hold was placed with (None: placed by the gateway itself)."""
    spend_period: int | None = None
    """The period of its key's spend cap this hold counts against (``spend_period``
    of :func:`~bourse.domain.periods.cap_period`); None when the key has no cap."""
    account_period: int | None = None
    """The period of its account's spend cap it counts against; None: the account has none."""


@immutable
class ApiKey:
    id: str
    account_id: str
    products: tuple[str, ...] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None
    created_at: float = 0.0
    name: str | None = None
    expires_at: float | None = None
    revoked_at: float | None = None
    last_used_at: float | None = None
    """Updated at most about once a minute (see :class:`bourse.services.auth.Authenticator`)."""
    spend_cap_micros: int | None = None
    spend_cap_period: CapPeriod | None = None
    spend_micros: int = 0
    """What the key's holds took in ``spend_period``: open and reconciling holds whole,
    closed ones what they charged."""
    spend_period: int = 0
    grace_until: float | None = None
    """Set when the key was found by a secret a rotation replaced: it works until then."""
    account_status: AccountStatus = "active"
    """Its account's status (read with the key by ``key_by_hash``; elsewhere ``active``)."""
    account_cap_period: CapPeriod | None = None
    """Its account's spend cap period (read with the key by ``key_by_hash`` and ``key``): None, no cap."""


@immutable
class AuditEntry:
    """One admin action: who (``actor``), what (``action``, e.g. ``key.revoke``), on
    what (``target``, an id) and its parameters (``detail``; never a secret)."""

    id: str
    at: float
    actor: str
    action: str
    target: str
    detail: Mapping[str, Any] = field(default_factory=dict)


def audit_entry(
    actor: str, action: str, target: str, detail: Mapping[str, Any] | None = None, at: float | None = None
) -> AuditEntry:
    """A new entry, with a fresh id, at ``at`` (default now)."""
    return AuditEntry(
        "aud_" + os.urandom(10).hex(), time.time() if at is None else at, actor, action, target, detail or {}
    )


@immutable
class UsageRecord:
    """A request's receipt as stored; ``record`` is the JSON the client sees."""

    request_id: str
    account_id: str
    product: str
    created_at: float
    outcome: str
    cost_micros: int
    record: Mapping[str, Any] = field(default_factory=dict)


@immutable
class Totals:
    credits_micros: int
    balances_micros: int
    holds_micros: int
    revenue_micros: int

    @property
    def balanced(self) -> bool:
        return self.credits_micros == self.balances_micros + self.holds_micros + self.revenue_micros


class InsufficientFunds(Exception):
    def __init__(self, balance_micros: int) -> None:
        super().__init__(f"balance {balance_micros} micro-USD")
        self.balance_micros = balance_micros


class UnknownAccount(Exception):
    pass


class AccountClosed(Exception):
    """A closed account's status cannot change."""


class UnknownKey(Exception):
    pass


class KeyRevoked(Exception):
    """The key is revoked: it cannot be rotated."""


class KeyChanged(Exception):
    """The key was revoked or rotated by another call while this one rotated it."""


class AccountExists(Exception):
    pass


class HoldNotOpen(Exception):
    """A close refused because the hold is not open: each answer distinct, as
    :attr:`state` says (``settled``, ``released``; ``reconciling`` for a move to
    reconciling, which takes an open hold; None: there is no such hold)."""

    def __init__(self, hold_id: str, state: HoldState | None) -> None:
        super().__init__(f"hold {hold_id} is {'unknown' if state is None else 'already ' + state}")
        self.hold_id = hold_id
        self.state = state


class ChargeAboveHold(Exception):
    """A settlement that would charge more than its hold: refused, never clamped (the
    domain caps a charge at its hold and records the excess; a charge above it is a
    defect). The hold stays as it was."""

    def __init__(self, hold_id: str, charge_micros: int, amount_micros: int) -> None:
        super().__init__(f"hold {hold_id}: a charge of {charge_micros} above its {amount_micros} micro-USD")
        self.hold_id = hold_id
        self.charge_micros = charge_micros
        self.amount_micros = amount_micros


class WebhookSecretUnreadable(Exception):
    """The account's webhook secret is sealed with a key this gateway does not have
    (sealed by a replica with another ``BOURSE_SECRET_KEY``, or with a key since lost)."""


class SealingKeyMissing(Exception):
    """The key the database seals webhook secrets with is not one of this gateway's (it
    was re-sealed from a replica with a newer ``BOURSE_SECRET_KEY``): nothing is sealed."""


class StoreUnavailable(Exception):
    """The database could not run a transaction (its connections keep breaking, the
    server is gone) after the adapter's own retries; the transaction did not commit
    (in the rare break during COMMIT, its outcome is unknown and a retry meets the
    ledger's own guards). The edge answers 503 with ``retry-after``, never 500."""


class LedgerStore(Protocol):
    async def create_account(
        self, account_id: str, credit_micros: int, now: float, *, audit: AuditEntry | None = None,
        spend_cap_micros: int | None = None, spend_cap_period: CapPeriod = "total",
    ) -> Account: ...  # fmt: skip
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
    async def set_account_status(
        self, account_id: str, status: AccountStatus, reason: str | None, *, audit: AuditEntry | None = None
    ) -> Account:
        """Suspend or resume an account (its reason with it). UnknownAccount, AccountClosed."""

    async def close_account(
        self, account_id: str, reason: str | None, now: float, *, audit: AuditEntry | None = None
    ) -> tuple[Account, int]:
        """Close an account for good and revoke its keys, in one transaction: the
        account and how many keys this revoked. UnknownAccount, AccountClosed."""

    async def accounts_page(self, *, limit: int, after: str | None) -> Sequence[Account]:
        """Accounts in id order; ``after`` is the last id of the previous page."""
        ...

    async def place_hold(self, hold: Hold) -> None:
        """Move ``hold.amount_micros`` from the balance into an open hold, atomically;
        InsufficientFunds (with the balance) when it cannot be covered. With a
        ``spend_period``, the amount is also counted on the key's spend cap in the same
        transaction: KeyBudgetExceeded when it would pass it; with an ``account_period``, on
        the account's: AccountBudgetExceeded (both in :mod:`bourse.ports.budgets`)."""
        ...

    async def settle(
        self,
        hold_id: str,
        charge_micros: int,
        usage: UsageRecord | None,
        now: float,
        *,
        audit: AuditEntry | None = None,
    ) -> Hold:
        """Charge ``charge`` and return the rest; with the usage record in the same
        transaction. HoldNotOpen (its state) if the hold is not open or reconciling;
        ChargeAboveHold if ``charge`` is more than the hold."""
        ...

    async def release(
        self, hold_id: str, usage: UsageRecord | None, now: float, *, audit: AuditEntry | None = None
    ) -> Hold: ...
    async def to_reconciling(
        self, hold_id: str, usage: UsageRecord | None, note: str, now: float
    ) -> Hold: ...
    async def holds(
        self, state: HoldState | None, account_id: str | None = None, limit: int = 100
    ) -> list[Hold]: ...
    async def hold(self, hold_id: str) -> Hold | None: ...
    async def reconcile_orphans(
        self,
        owner: str,
        *,
        all_others: bool,
        include_own: bool = False,
        hold_ids: Sequence[str] | None = None,
    ) -> int:
        """Move open holds owned by others to reconciling: all of them (single node),
        or those whose owner's lease has lapsed on the database's clock (replicas);
        ``include_own`` adds this instance's own from a previous life (at start-up,
        before anything runs). ``hold_ids``: only those of this instance's own open
        holds (that no run of it holds any more: the hold sweeper's)."""
        ...

    async def open_hold_ids(self, owner: str, limit: int) -> Sequence[str]:
        """The ids of ``owner``'s open holds, oldest first, at most ``limit``."""
        ...

    async def heartbeat(self, owner: str, lease_s: float) -> float:
        """Renew ``owner``'s lease until the database's clock + ``lease_s`` (a lease
        ``<= 0`` has lapsed already); the database's clock, in seconds since the epoch."""
        ...

    async def totals(self) -> Totals: ...


class KeyStore(Protocol):
    async def create_key(self, key: ApiKey, key_hash: str, *, audit: AuditEntry | None = None) -> None:
        """UnknownAccount; AccountClosed."""

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        """The key of a secret's hash: its current secret, or one a rotation replaced
        (then with ``grace_until``, even once that passed); revoked and expired keys too."""
        ...

    async def key(self, key_id: str) -> ApiKey | None: ...
    async def keys_page(self, account_id: str | None, *, limit: int, after: str | None) -> Sequence[ApiKey]:
        """Newest first; ``after`` is the last key id of the previous page."""
        ...

    async def revoke_key(self, key_id: str, now: float, *, audit: AuditEntry | None = None) -> ApiKey:
        """Revoke for good (again: keeps the first time); UnknownKey."""
        ...

    async def update_key(
        self, key_id: str, changes: Mapping[str, Any], *, audit: AuditEntry | None = None
    ) -> ApiKey:
        """Set some of a key's editable fields (None clears); its spend counter stays as it
        is (:func:`bourse.storage.accounts.update_key`). UnknownKey, KeyRevoked."""

    async def rotate_key(
        self,
        key_id: str,
        new_hash: str,
        old_valid_until: float,
        now: float,
        *,
        audit: AuditEntry | None = None,
    ) -> ApiKey:
        """Give the key a new secret; the old one keeps working until ``old_valid_until``
        (none when that is not after ``now``). UnknownKey, KeyRevoked, KeyChanged."""
        ...

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        """Set ``last_used_at`` of each key id to its time (never backwards)."""
        ...


class AuditStore(Protocol):
    """The audit log of admin actions (in the ledger database)."""

    async def record(
        self, actor: str, action: str, target: str, detail: Mapping[str, Any] | None = None
    ) -> AuditEntry:
        """Write an entry on its own (actions that change the ledger pass theirs to the
        store method, written in the same transaction)."""
        ...

    async def list(
        self,
        *,
        action: str | None = None,
        target: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> Sequence[AuditEntry]:
        """Newest first; ``after`` is the last entry id of the previous page."""
        ...


class UsageStore(Protocol):
    async def put_usage(self, usage: UsageRecord) -> None: ...
    async def usage(self, account_id: str, request_id: str) -> UsageRecord | None: ...
    async def usage_page(
        self,
        account_id: str,
        *,
        limit: int,
        before: float | None,
        since: float | None,
        until: float | None,
        after: str | None = None,
    ) -> Sequence[UsageRecord]:
        """Newest first; ``after`` is a keyset cursor (the last request id of the previous page)."""
        ...


@immutable
class StoredResponse:
    status: int
    headers: Mapping[str, str]
    body: bytes


@immutable
class IdemBegin:
    """``state``: "new" (go ahead), "in_flight", "conflict" (other body) or "done"."""

    state: Literal["new", "in_flight", "conflict", "done"]
    response: StoredResponse | None = None


class IdempotencyStore(Protocol):
    async def idem_begin(
        self, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
    ) -> IdemBegin: ...
    async def idem_complete(self, account_id: str, key: str, response: StoredResponse | None) -> None:
        """Store the answer; ``None`` forgets the key (a failure that may be retried)."""
        ...

    async def purge_idempotency(self, now: float, limit: int) -> int:
        """Delete at most ``limit`` keys that expired before ``now``; how many were deleted."""
        ...


class RetentionStore(Protocol):
    """Usage records and closed holds past their age (``[storage] retention_s``).

    A request's holds and its usage record go together, once all of them are older than
    the age on the database's clock, none of its holds is open or reconciling and no
    unfinished job runs it. What they added up to is kept per account (``pruned``), so
    ``credits = balances + open and reconciling holds + revenue`` still holds, revenue
    being the settled holds' charges plus the pruned ones (:meth:`LedgerStore.totals`,
    an account's ``spent_micros``)."""

    async def prunable(self, age_s: float, limit: int) -> Sequence[str]:
        """Up to ``limit`` request ids whose records may be pruned; a read (no write transaction)."""
        ...

    async def prune(self, request_ids: Sequence[str], age_s: float) -> tuple[int, int]:
        """Delete those requests' records still past ``age_s`` in one transaction, their
        sums added to ``pruned``; how many (holds, usage records) were deleted."""
        ...


JobStatus = Literal["queued", "running", "succeeded", "failed", "canceled", "expired"]
FINAL_JOB_STATES: frozenset[str] = frozenset({"succeeded", "failed", "canceled", "expired"})


@immutable
class Job:
    """A detached request: its body, its state, and once done its result or error."""

    id: str
    account_id: str
    key_id: str
    endpoint: str
    body: Mapping[str, Any]
    status: JobStatus
    request_id: str
    bid: float
    created_at: float
    expires_at: float
    hold_id: str | None = None
    webhook_url: str | None = None
    webhook_state: str = "none"
    """``none``, ``pending``, ``delivered``, ``failed`` (given up, or the target refused) or
    ``held`` (the account's secret cannot be opened: not sent until an admin re-seals it)."""
    webhook_error: str | None = None
    """Why the webhook is ``failed`` or ``held`` (never a secret)."""
    result: Mapping[str, Any] | None = None
    error: Mapping[str, Any] | None = None
    started_at: float | None = None
    finished_at: float | None = None
    owner: str | None = None
    """The gateway instance running it (replicas: another resumes it when this one's lease lapses)."""


class JobStore(Protocol):
    async def put_job(self, job: Job) -> None: ...
    async def job(self, job_id: str, account_id: str | None = None) -> Job | None: ...
    async def jobs_page(self, account_id: str, *, limit: int, after: str | None) -> Sequence[Job]: ...
    async def update_job(self, job_id: str, **fields: Any) -> None:
        """Set columns: status, hold_id, request_id, started_at, finished_at, result, error,
        webhook_state, webhook_error."""
        ...

    async def fail_job_refunded(
        self, job_id: str, hold_id: str, fields: Mapping[str, Any], note: str, now: float
    ) -> int:
        """A job whose result could not be kept after its run was charged: in one
        transaction, the job's failure (``fields``, as :meth:`update_job` takes them) and
        its charge given back: the settled hold released with nothing charged (``note``
        says why), its usage record an ``error`` at no cost, the amount back on the
        balance and off the key's spend cap. The micro-USD given back (0: the hold was
        not settled)."""
        ...

    async def claim_jobs(self, owner: str, *, all_others: bool, include_own: bool = False) -> Sequence[Job]:
        """Take over the queued and running jobs of other instances, oldest first, and
        return them (to resume): all of them (one node, at start-up) or only those whose
        owner's lease lapsed on the database's clock (replicas); ``include_own`` adds
        this instance's own from a previous life (at start-up). Atomic: two instances
        never claim one job."""
        ...

    async def hold_webhook(self, job_id: str, why: str) -> bool:
        """Mark a pending webhook ``held`` with ``why``; False (nothing changed) when it is
        no longer pending (another gateway delivered it meanwhile)."""
        ...

    async def jobs_to_notify(self) -> Sequence[Job]:
        """Finished jobs whose webhook is still pending."""
        ...

    async def expire_jobs(self, now: float) -> int:
        """Finished jobs past ``expires_at``: drop the result, status ``expired``."""
        ...


def new_webhook_secret() -> str:
    """A fresh webhook secret (48 hex characters: 192 random bits)."""
    return os.urandom(24).hex()


@immutable
class ResealReport:
    """What a re-seal of every webhook secret did."""

    resealed: int
    """Secrets now sealed with the new key (they were sealed with another one, or in clear)."""
    unchanged: int
    """Secrets already sealed with it."""
    unreadable: Sequence[str]
    """Accounts whose secret none of the gateway's keys opens (at most 100 named)."""
    unreadable_count: int
    released_jobs: int
    """Held webhooks of accounts whose secret opens now: pending again, delivered next."""


class WebhookSecretStore(Protocol):
    """Each account's webhook secret, sealed at rest with the key the database names."""

    async def webhook_secret(self, account_id: str) -> str | None:
        """The account's secret (None: no such account); WebhookSecretUnreadable when this
        gateway's keys cannot open it."""
        ...

    async def set_webhook_secret(
        self, account_id: str, secret: str, now: float, *, audit: AuditEntry | None = None
    ) -> int:
        """Replace the account's secret (sealed with the database's key) and release its
        held webhooks; how many. UnknownAccount, SealingKeyMissing."""
        ...

    async def reseal_webhook_secrets(self, now: float, *, audit: AuditEntry | None = None) -> ResealReport:
        """Seal every secret this gateway can open with its first key, which the database
        names from now on (one transaction); release the held webhooks that can go."""
        ...


@immutable
class ResponseRecord:
    """A stored response of the Responses API, owned by its account until ``expires_at``."""

    id: str
    account_id: str
    status: str
    body: Mapping[str, Any]
    """The response object as last known (final once ``status`` is)."""
    input_items: Sequence[Mapping[str, Any]]
    """The request's own input items."""
    context: Sequence[Mapping[str, Any]]
    """The conversation through this response: what ``previous_response_id`` prepends
    (the earlier context, the input and, once final, the output)."""
    created_at: float
    expires_at: float
    job_id: str | None = None
    """The detached job that runs a background response."""


class ResponseStore(Protocol):
    async def put_response(self, record: ResponseRecord) -> None:
        """Insert the record, or replace the one with its id."""
        ...

    async def response(self, response_id: str, account_id: str, now: float) -> ResponseRecord | None:
        """The account's record with this id, unless it expired by ``now``."""
        ...

    async def delete_response(self, response_id: str, account_id: str) -> bool:
        """Delete the account's record; False when there was none."""
        ...

    async def purge_responses(self, now: float, limit: int) -> int:
        """Delete at most ``limit`` records that expired before ``now``; how many were deleted."""
        ...
