"""The stores' logic, written once over a minimal synchronous SQL executor.

:class:`SqlStore` implements every storage port (ledger, keys, usage, idempotency,
jobs, stored responses, retention, the audit log's writes) as thin methods over the
transactions of each concern's module: :mod:`~bourse.storage.accounts` (accounts and
keys), :mod:`~bourse.storage.ledger` (holds and the ledger), :mod:`~bourse.storage.usage`,
:mod:`~bourse.storage.idempotency`, :mod:`~bourse.storage.jobs`,
:mod:`~bourse.storage.responses`, :mod:`~bourse.storage.retention` and
:mod:`~bourse.storage.audit`; the migrations are here. Their SQL is written once for
SQLite and PostgreSQL (numbered ``$n`` parameters, rewritten by each adapter; the
database's clock is the executor's ``clock``), with one exception: PostgreSQL places
and closes a batch of one account's holds in a single statement of data-modifying
CTEs, which SQLite has not (``_write_many`` in :mod:`~bourse.storage.postgres`, built
from the ledger's new hold row and the usage columns, like the statements here).

Each public method is one transaction, run as one function on the adapter's database
thread: a single hop off the event loop per ledger change, however many statements it
takes. Adapters supply :meth:`SqlStore._run` (a transaction) and :meth:`SqlStore._read`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from bourse.domain.periods import CapPeriod
from bourse.ports.operators import Operator
from bourse.ports.stores import (
    Account,
    AccountExists,
    AccountStatus,
    ApiKey,
    AuditEntry,
    Hold,
    HoldState,
    IdemBegin,
    Job,
    ResealReport,
    ResponseRecord,
    StoredResponse,
    StoreUnavailable,
    Totals,
    UsageRecord,
    WebhookSecretUnreadable,
)
from bourse.storage import accounts, idempotency, jobs, ledger, operators, responses, retention, sealing
from bourse.storage import audit as audit_rows
from bourse.storage import usage as usage_rows
from bourse.storage.admin_keys import AdminKeyTables
from bourse.storage.batching import Coalescer
from bourse.storage.executor import Executor, IntegrityError
from bourse.storage.market import MarketTables
from bourse.storage.schema import migrations
from bourse.storage.sealing import Sealer

T = TypeVar("T")


def migrate_in(db: Executor, lock_sql: str | None, now: float, setup: tuple[str, ...] = ()) -> int:
    """Apply every pending migration in one transaction (under ``lock_sql`` if given,
    so replicas starting together migrate once), after the ``setup`` statements."""
    for statement in setup:
        db.execute(statement)
    if lock_sql:
        db.fetch(lock_sql)
    db.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
    )
    row = db.fetchrow("SELECT MAX(version) AS v FROM schema_migrations")
    version = 0 if row is None or row["v"] is None else int(row["v"])
    for v, statements in migrations():
        if v <= version:
            continue
        for statement in statements:
            db.execute(statement)
        db.execute("INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2)", v, now)
        version = v
    return version


def _reseal_audited(db: Executor, box: Sealer, now: float, audit: AuditEntry | None) -> ResealReport:
    """A re-seal and its audit entry (its detail: the counts), in one transaction."""
    report = sealing.reseal(db, box, now)
    if audit is not None:
        counts = {"resealed": report.resealed, "unchanged": report.unchanged,
                  "unreadable": report.unreadable_count, "released_jobs": report.released_jobs}  # fmt: skip
        audit_rows.add_audit(db, dataclasses.replace(audit, detail={**audit.detail, **counts}))
    return report


class SqlStore(MarketTables, AdminKeyTables):
    """All storage ports over one database. Subclasses provide the database thread."""

    single_node: bool = True
    """True when one process owns the database (SQLite): at start-up every open hold
    of another owner is an orphan. False for shared databases (lease-based)."""

    # -- adapter hooks ----------------------------------------------------------------

    def _run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Run ``fn(executor, *args)`` in one transaction on the database thread: what the
        caller awaits (a plain method, not a coroutine: no frame of its own, which every
        suspension of a ledger write would resume)."""
        raise NotImplementedError

    def _read(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Run ``fn(executor, *args)`` for reads (no write transaction)."""
        return self._run(fn, *args)

    def _run_small(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Like :meth:`_run`, for a transaction of a few statements on a few rows (a
        hold, a close): an adapter may run it without a thread hand-off."""
        return self._run(fn, *args)

    secret_box: Sealer | None = None
    """Seals webhook secrets at rest (set by the composition root); None keeps them in clear."""

    async def adopt_sealing_key(self, now: float, *, take_over: bool) -> sealing.Adoption:
        """Check this gateway's keys against the one the database seals with (name it on a
        new database); SealingKeyMismatch unless they include it or ``take_over``."""
        box = self.secret_box
        assert box is not None, "adopt_sealing_key needs a secret box"
        return await self._run(sealing.adopt, box, now, take_over)

    async def open(self) -> None:
        """Connect and migrate."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # -- migrations -------------------------------------------------------------------

    migration_lock_sql: str | None = None

    async def migrate(self) -> int:
        """Apply pending migrations; returns the schema version."""
        return await self._run(migrate_in, self.migration_lock_sql, time.time())

    # -- ledger -----------------------------------------------------------------------

    async def create_account(
        self, account_id: str, credit_micros: int, now: float, *, audit: AuditEntry | None = None,
        spend_cap_micros: int | None = None, spend_cap_period: CapPeriod = "total",
    ) -> Account:  # fmt: skip
        if credit_micros < 0:
            raise ValueError("credit cannot be negative")
        cap = None if spend_cap_micros is None else (spend_cap_micros, spend_cap_period)
        try:
            return await self._run(
                audit_rows.with_audit, audit, accounts.create_account, account_id, credit_micros, now,
                sealing.sealer_in(self.secret_box), cap,
            )  # fmt: skip
        except IntegrityError:
            raise AccountExists(account_id) from None

    async def update_account(
        self, account_id: str, changes: Mapping[str, Any], *, audit: AuditEntry | None = None
    ) -> Account:
        return await self._run(audit_rows.with_audit, audit, accounts.update_account, account_id, changes)

    async def credit(
        self,
        account_id: str,
        amount_micros: int,
        now: float,
        memo: str = "",
        *,
        audit: AuditEntry | None = None,
    ) -> Account:
        if amount_micros <= 0:
            raise ValueError("a credit must be positive")
        return await self._run(
            audit_rows.with_audit, audit, accounts.credit, account_id, amount_micros, now, memo
        )

    async def account(self, account_id: str) -> Account | None:
        return await self._read(accounts.account, account_id)

    async def set_account_status(
        self, account_id: str, status: AccountStatus, reason: str | None, *, audit: AuditEntry | None = None
    ) -> Account:
        return await self._run(
            audit_rows.with_audit, audit, accounts.set_account_status, account_id, status, reason
        )

    async def close_account(
        self, account_id: str, reason: str | None, now: float, *, audit: AuditEntry | None = None
    ) -> tuple[Account, int]:
        return await self._run(audit_rows.with_audit, audit, accounts.close_account, account_id, reason, now)

    async def accounts_page(self, *, limit: int, after: str | None) -> Sequence[Account]:
        return await self._read(accounts.accounts_page, limit, after)

    async def webhook_secret(self, account_id: str) -> str | None:
        def get(db: Executor) -> str | None:
            row = db.fetchrow("SELECT secret FROM webhook_secrets WHERE account_id = $1", account_id)
            return None if row is None else str(row["secret"])

        stored = await self._read(get)
        if stored is None or self.secret_box is None:
            return stored
        try:
            return self.secret_box.opened(stored)[0]
        except ValueError:  # sealed with a key this gateway does not have
            raise WebhookSecretUnreadable(account_id) from None

    async def set_webhook_secret(
        self, account_id: str, secret: str, now: float, *, audit: AuditEntry | None = None
    ) -> int:
        return await self._run(
            audit_rows.with_audit,
            audit,
            sealing.set_secret,
            sealing.sealer_in(self.secret_box),
            account_id,
            secret,
        )

    async def reseal_webhook_secrets(self, now: float, *, audit: AuditEntry | None = None) -> ResealReport:
        box = self.secret_box
        assert box is not None, "a re-seal needs a secret box"
        return await self._run(_reseal_audited, box, now, audit)

    # Holds and closes of one account are group-committed (storage.batching): one
    # writer per account, its account's row taken once per batch, not once per request.
    _writes: Coalescer[ledger.LedgerWrite, Hold | None] | None = None
    _hold_accounts: dict[str, str] | None = None
    """Open uncapped holds placed here, by id: their account (the partition of their close).
    Every way out of open takes its hold out (``_close``, ``_forget``)."""
    HOLD_ACCOUNTS_MAX = 100_000
    """Open holds remembered; beyond it a close runs alone (the map is only a hint)."""

    def _ledger_writer(self) -> tuple[Coalescer[ledger.LedgerWrite, Hold | None], dict[str, str]]:
        if self._writes is None or self._hold_accounts is None:
            self._writes = Coalescer(self._write_one, self._write_many, fail_together=(StoreUnavailable,))
            self._hold_accounts = {}
        return self._writes, self._hold_accounts

    def _write_one(self, item: ledger.LedgerWrite) -> Awaitable[Hold | None]:
        if isinstance(item, Hold):
            return self._run_small(ledger.place_hold, item)  # None: placed
        return self._run_small(ledger.close_hold, *item)

    async def _write_many(self, items: list[ledger.LedgerWrite]) -> list[Hold | Exception | None]:
        # a hold is in at most one batch, and after its placement: its close takes it
        # out of _hold_accounts, which has it once it is placed
        try:
            return await self._run(ledger.ledger_batch, items)
        except ledger.BatchShort:
            return await self._write_each(items)

    async def _write_each(self, items: list[ledger.LedgerWrite]) -> list[Hold | Exception | None]:
        """Near the end of the balance: one by one, in order."""
        out: list[Hold | Exception | None] = []
        for item in items:
            try:
                out.append(await self._write_one(item))
            except Exception as exc:
                out.append(exc)
        return out

    async def place_hold(self, hold: Hold) -> None:
        if hold.amount_micros < 0:
            raise ValueError("a hold cannot be negative")
        writes, hold_accounts = self._ledger_writer()
        await writes.submit(hold.account_id, hold)
        if not ledger.counted(hold) and len(hold_accounts) < self.HOLD_ACCOUNTS_MAX:
            hold_accounts[hold.id] = hold.account_id  # (a capped hold closes alone)

    def _forget(self, hold_id: str) -> None:
        """``hold_id`` leaves open without the account's writer (reconciling, or an
        operator's close with its audit entry): drop its account from the map."""
        if self._hold_accounts is not None:
            self._hold_accounts.pop(hold_id, None)

    async def _close(self, item: ledger.Closing) -> Hold:
        writes, hold_accounts = self._ledger_writer()
        account_id = hold_accounts.pop(item[0], None)
        if account_id is None:  # placed elsewhere (or forgotten): alone
            return await self._run_small(ledger.close_hold, *item)
        closed = await writes.submit(account_id, item)
        assert closed is not None  # a close answers its hold
        return closed

    async def settle(
        self,
        hold_id: str,
        charge_micros: int,
        usage: UsageRecord | None,
        now: float,
        *,
        audit: AuditEntry | None = None,
    ) -> Hold:
        if audit is None:
            return await self._close((hold_id, "settled", charge_micros, usage, None, now))
        self._forget(hold_id)
        return await self._run(
            audit_rows.with_audit,
            audit,
            ledger.close_hold,
            hold_id,
            "settled",
            charge_micros,
            usage,
            None,
            now,
        )

    async def debit(self, hold: Hold, usage: UsageRecord, now: float, *, audit: AuditEntry) -> Hold:
        """An operator's debit (:func:`ledger.debit`), with its audit entry, in one transaction."""
        if hold.amount_micros <= 0 or ledger.counted(hold):
            raise ValueError("a debit is a positive amount, on no spend cap")
        return await self._run(audit_rows.with_audit, audit, ledger.debit, hold, usage, now)

    async def release(
        self, hold_id: str, usage: UsageRecord | None, now: float, *, audit: AuditEntry | None = None
    ) -> Hold:
        if audit is None:
            return await self._close((hold_id, "released", 0, usage, None, now))
        self._forget(hold_id)
        return await self._run(
            audit_rows.with_audit, audit, ledger.close_hold, hold_id, "released", 0, usage, None, now
        )

    async def to_reconciling(self, hold_id: str, usage: UsageRecord | None, note: str, now: float) -> Hold:
        self._forget(hold_id)
        return await self._run(ledger.close_hold, hold_id, "reconciling", 0, usage, note, now)

    async def holds(
        self, state: HoldState | None, account_id: str | None = None, limit: int = 100
    ) -> list[Hold]:
        return await self._read(ledger.hold_list, state, account_id, limit)

    async def hold(self, hold_id: str) -> Hold | None:
        def get(db: Executor) -> Hold | None:
            row = db.fetchrow("SELECT * FROM holds WHERE id = $1", hold_id)
            return None if row is None else ledger.hold_row(row)

        return await self._read(get)

    async def reconcile_orphans(
        self,
        owner: str,
        *,
        all_others: bool,
        include_own: bool = False,
        hold_ids: Sequence[str] | None = None,
    ) -> int:
        if hold_ids is not None:
            if not hold_ids:
                return 0
            for hold_id in hold_ids:
                self._forget(hold_id)
        return await self._run(ledger.reconcile_orphans, owner, all_others, include_own, hold_ids)

    async def open_hold_ids(self, owner: str, limit: int) -> Sequence[str]:
        def get(db: Executor) -> list[str]:
            rows = db.fetch(
                "SELECT id FROM holds WHERE owner = $1 AND state = 'open' "
                f"ORDER BY created_at LIMIT {max(1, min(int(limit), 100_000))}",
                owner,
            )
            return [str(r["id"]) for r in rows]

        return await self._read(get)

    async def heartbeat(self, owner: str, lease_s: float) -> float:
        return await self._run(ledger.heartbeat, owner, lease_s)

    async def totals(self) -> Totals:
        return await self._read(ledger.totals)

    # -- keys -------------------------------------------------------------------------

    async def hold_counts(self) -> dict[str, tuple[int, int]]:
        """Open and reconciling holds: state -> (count, micro-USD) (for the metrics)."""
        return await self._read(ledger.hold_counts)

    async def job_counts(self) -> dict[str, int]:
        """Jobs by status (for the metrics)."""
        return await self._read(jobs.job_counts)

    async def create_key(self, key: ApiKey, key_hash: str, *, audit: AuditEntry | None = None) -> None:
        await self._run(audit_rows.with_audit, audit, accounts.create_key, key, key_hash)

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        return await self._read(accounts.key_by_hash, key_hash)

    async def key(self, key_id: str) -> ApiKey | None:
        def get(db: Executor) -> ApiKey | None:
            row = db.fetchrow(accounts.KEY_BY_ID, key_id)
            return (
                None if row is None else accounts.key_row(row, account_cap_period=row["account_cap_period"])
            )

        return await self._read(get)

    async def keys_page(self, account_id: str | None, *, limit: int, after: str | None) -> Sequence[ApiKey]:
        return await self._read(accounts.keys_page, account_id, limit, after)

    async def revoke_key(self, key_id: str, now: float, *, audit: AuditEntry | None = None) -> ApiKey:
        return await self._run(audit_rows.with_audit, audit, accounts.revoke_key, key_id, now)

    async def create_operator(self, op: Operator, key_hash: str, *, audit: AuditEntry | None = None) -> None:
        await self._run(audit_rows.with_audit, audit, operators.create_operator, op, key_hash)

    async def operator_by_hash(self, key_hash: str) -> Operator | None:
        return await self._read(operators.operator_by_hash, key_hash)

    async def operators(self) -> Sequence[Operator]:
        return await self._read(operators.operators)

    async def revoke_operator(
        self, operator_id: str, now: float, *, audit: AuditEntry | None = None
    ) -> Operator:
        return await self._run(audit_rows.with_audit, audit, operators.revoke_operator, operator_id, now)

    async def update_key(
        self, key_id: str, changes: Mapping[str, Any], *, audit: AuditEntry | None = None
    ) -> ApiKey:
        return await self._run(audit_rows.with_audit, audit, accounts.update_key, key_id, changes)

    async def rotate_key(
        self,
        key_id: str,
        new_hash: str,
        old_valid_until: float,
        now: float,
        *,
        audit: AuditEntry | None = None,
    ) -> ApiKey:
        return await self._run(
            audit_rows.with_audit, audit, accounts.rotate_key, key_id, new_hash, old_valid_until, now
        )

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        if used:
            await self._run(accounts.touch_keys, dict(used))

    # -- audit log --------------------------------------------------------------------

    async def add_audit(self, entry: AuditEntry) -> None:
        await self._run(audit_rows.add_audit, entry)

    async def audit_page(
        self, *, action: str | None, target: str | None, limit: int, after: str | None
    ) -> Sequence[AuditEntry]:
        return await self._read(audit_rows.audit_page, action, target, limit, after)

    # -- usage ------------------------------------------------------------------------

    async def put_usage(self, usage: UsageRecord) -> None:
        await self._run(usage_rows.put_usage, usage)

    async def usage(self, account_id: str, request_id: str) -> UsageRecord | None:
        def get(db: Executor) -> UsageRecord | None:
            row = db.fetchrow(
                "SELECT * FROM usage WHERE request_id = $1 AND account_id = $2", request_id, account_id
            )
            return None if row is None else usage_rows.usage_row(row)

        return await self._read(get)

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
        return await self._read(usage_rows.usage_page, account_id, limit, before, since, until, after)

    # -- idempotency ------------------------------------------------------------------

    async def idem_begin(
        self, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
    ) -> IdemBegin:
        try:
            return await self._run(idempotency.idem_begin, account_id, key, body_hash, now, ttl_s)
        except IntegrityError:  # a concurrent first use of the same key
            return IdemBegin("in_flight")

    async def idem_complete(self, account_id: str, key: str, response: StoredResponse | None) -> None:
        await self._run(idempotency.idem_complete, account_id, key, response)

    async def purge_idempotency(self, now: float, limit: int) -> int:
        def purge(db: Executor) -> int:
            return db.execute(
                "DELETE FROM idempotency WHERE (account_id, key) IN "
                f"(SELECT account_id, key FROM idempotency WHERE expires_at < $1 LIMIT {max(1, int(limit))})",
                now,
            )

        return await self._run(purge)

    # -- retention --------------------------------------------------------------------

    async def prunable(self, age_s: float, limit: int) -> Sequence[str]:
        return await self._read(retention.prunable, age_s, limit)

    async def prune(self, request_ids: Sequence[str], age_s: float) -> tuple[int, int]:
        return await self._run(retention.prune, list(request_ids), age_s)

    # -- jobs -------------------------------------------------------------------------

    async def put_job(self, job: Job) -> None:
        await self._run(jobs.put_job, job)

    async def job(self, job_id: str, account_id: str | None = None) -> Job | None:
        def get(db: Executor) -> Job | None:
            if account_id is None:
                row = db.fetchrow("SELECT * FROM jobs WHERE id = $1", job_id)
            else:
                row = db.fetchrow("SELECT * FROM jobs WHERE id = $1 AND account_id = $2", job_id, account_id)
            return None if row is None else jobs.job_row(row)

        return await self._read(get)

    async def jobs_page(self, account_id: str, *, limit: int, after: str | None) -> Sequence[Job]:
        return await self._read(jobs.jobs_page, account_id, limit, after)

    async def update_job(self, job_id: str, **fields: Any) -> None:
        await self._run(jobs.update_job, job_id, fields)

    async def fail_job_refunded(
        self, job_id: str, hold_id: str, fields: Mapping[str, Any], note: str, now: float
    ) -> int:
        return await self._run(jobs.fail_job_refunded, job_id, hold_id, dict(fields), note, now)

    async def claim_jobs(self, owner: str, *, all_others: bool, include_own: bool = False) -> Sequence[Job]:
        return await self._run(jobs.claim_jobs, owner, all_others, include_own)

    async def hold_webhook(self, job_id: str, why: str) -> bool:
        def hold(db: Executor) -> bool:
            sql = "UPDATE jobs SET webhook_state = 'held', webhook_error = $2 WHERE id = $1 AND webhook_state = 'pending'"
            return db.execute(sql, job_id, why) == 1

        return await self._run(hold)

    async def jobs_to_notify(self) -> Sequence[Job]:
        def get(db: Executor) -> list[Job]:
            rows = db.fetch(
                "SELECT * FROM jobs WHERE webhook_state = 'pending' ORDER BY finished_at LIMIT 1000"
            )
            return [jobs.job_row(r) for r in rows]

        return await self._read(get)

    async def expire_jobs(self, now: float) -> int:
        def run(db: Executor) -> int:
            return db.execute(
                "UPDATE jobs SET status = 'expired', result = NULL, error = NULL WHERE expires_at < $1 "
                "AND status IN ('succeeded', 'failed', 'canceled')",
                now,
            )

        return await self._run(run)

    # -- stored responses (the Responses API) -------------------------------------------

    async def put_response(self, record: ResponseRecord) -> None:
        await self._run(responses.put_response, record)

    async def response(self, response_id: str, account_id: str, now: float) -> ResponseRecord | None:
        def get(db: Executor) -> ResponseRecord | None:
            row = db.fetchrow(
                "SELECT * FROM responses WHERE id = $1 AND account_id = $2 AND expires_at > $3",
                response_id, account_id, now,
            )  # fmt: skip
            return None if row is None else responses.response_row(row)

        return await self._read(get)

    async def delete_response(self, response_id: str, account_id: str) -> bool:
        def delete(db: Executor) -> bool:
            n = db.execute("DELETE FROM responses WHERE id = $1 AND account_id = $2", response_id, account_id)
            return n > 0

        return await self._run(delete)

    async def purge_responses(self, now: float, limit: int) -> int:
        def purge(db: Executor) -> int:
            return db.execute(
                "DELETE FROM responses WHERE id IN "
                f"(SELECT id FROM responses WHERE expires_at < $1 LIMIT {max(1, int(limit))})",
                now,
            )

        return await self._run(purge)
