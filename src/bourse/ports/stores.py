"""Storage ports: one small interface per concern (ledger, keys, usage, idempotency).

Adapters live in ``bourse.storage`` (SQLite, PostgreSQL); the same contract tests
run over each. All amounts are integer micro-USD.

The ledger follows two-phase transfers: a hold moves money out of an account's
balance into an *open* hold; it is then *settled* (charged up to its amount, the
rest returned), *released* (all returned), or moved to *reconciling* when its run's
outcome is unknown (a crash, a missing usage block under the reconcile policy), for
an operator to settle or release. The invariant every adapter keeps::

    credits = balances + open and reconciling holds + revenue
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

HoldState = Literal["open", "settled", "released", "reconciling"]


@dataclass(slots=True, frozen=True)
class Account:
    id: str
    balance_micros: int
    open_holds_micros: int = 0
    reconciling_micros: int = 0
    spent_micros: int = 0
    credited_micros: int = 0
    created_at: float = 0.0


@dataclass(slots=True, frozen=True)
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


@dataclass(slots=True, frozen=True)
class ApiKey:
    id: str
    account_id: str
    products: tuple[str, ...] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None
    created_at: float = 0.0


@dataclass(slots=True, frozen=True)
class UsageRecord:
    """A request's receipt as stored; ``record`` is the JSON the client sees."""

    request_id: str
    account_id: str
    product: str
    created_at: float
    outcome: str
    cost_micros: int
    record: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
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


class AccountExists(Exception):
    pass


class HoldNotOpen(Exception):
    """The hold is already settled or released (or does not exist)."""


class StoreUnavailable(Exception):
    """The database could not run a transaction (its connections keep breaking, the
    server is gone) after the adapter's own retries; the transaction did not commit
    (in the rare break during COMMIT, its outcome is unknown and a retry meets the
    ledger's own guards). The edge answers 503 with ``retry-after``, never 500."""


class LedgerStore(Protocol):
    async def create_account(self, account_id: str, credit_micros: int, now: float) -> Account: ...
    async def credit(self, account_id: str, amount_micros: int, now: float, memo: str = "") -> Account: ...
    async def account(self, account_id: str) -> Account | None: ...
    async def place_hold(self, hold: Hold) -> None:
        """Move ``hold.amount_micros`` from the balance into an open hold, atomically;
        InsufficientFunds (with the balance) when it cannot be covered."""
        ...

    async def settle(self, hold_id: str, charge_micros: int, usage: UsageRecord | None, now: float) -> Hold:
        """Charge ``min(charge, amount)`` and return the rest; with the usage record in
        the same transaction. HoldNotOpen if already settled or released."""
        ...

    async def release(self, hold_id: str, usage: UsageRecord | None, now: float) -> Hold: ...
    async def to_reconciling(
        self, hold_id: str, usage: UsageRecord | None, note: str, now: float
    ) -> Hold: ...
    async def holds(
        self, state: HoldState | None, account_id: str | None = None, limit: int = 100
    ) -> list[Hold]: ...
    async def hold(self, hold_id: str) -> Hold | None: ...
    async def reconcile_orphans(
        self, owner: str, now: float, *, all_others: bool, include_own: bool = False
    ) -> int:
        """Move open holds owned by others to reconciling: all of them (single node),
        or those whose owner's lease has lapsed (replicas); ``include_own`` adds this
        instance's own from a previous life (at start-up, before anything runs)."""
        ...

    async def heartbeat(self, owner: str, lease_until: float, now: float) -> None: ...
    async def totals(self) -> Totals: ...


class KeyStore(Protocol):
    async def create_key(self, key: ApiKey, key_hash: str) -> None: ...
    async def key_by_hash(self, key_hash: str) -> ApiKey | None: ...


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


@dataclass(slots=True, frozen=True)
class StoredResponse:
    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(slots=True, frozen=True)
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


JobStatus = Literal["queued", "running", "succeeded", "failed", "canceled", "expired"]
FINAL_JOB_STATES: frozenset[str] = frozenset({"succeeded", "failed", "canceled", "expired"})


@dataclass(slots=True, frozen=True)
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
        """Set columns: status, hold_id, request_id, started_at, finished_at, result, error, webhook_state."""
        ...

    async def unfinished_jobs(self) -> Sequence[Job]:
        """Queued and running jobs, oldest first."""
        ...

    async def claim_jobs(
        self, owner: str, now: float, *, all_others: bool, include_own: bool = False
    ) -> Sequence[Job]:
        """Take over the queued and running jobs of other instances, oldest first, and
        return them (to resume): all of them (one node, at start-up) or only those whose
        owner's lease lapsed (replicas); ``include_own`` adds this instance's own from a
        previous life (at start-up). Atomic: two instances never claim one job."""
        ...

    async def jobs_to_notify(self) -> Sequence[Job]:
        """Finished jobs whose webhook is still pending."""
        ...

    async def expire_jobs(self, now: float) -> int:
        """Finished jobs past ``expires_at``: drop the result, status ``expired``."""
        ...


class Store(LedgerStore, KeyStore, UsageStore, IdempotencyStore, JobStore, Protocol):
    """One database holding every concern (what the composition root opens)."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
