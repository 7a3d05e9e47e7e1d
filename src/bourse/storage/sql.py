"""The stores' logic, written once over a minimal synchronous SQL executor.

:class:`SqlStore` implements every storage port (ledger, keys, usage, idempotency,
the audit log's writes)
with SQL that runs unchanged on SQLite and PostgreSQL (numbered ``$n`` parameters,
rewritten by each adapter). Each public method is one transaction, run as one
function on the adapter's database thread: a single hop off the event loop per
ledger change, however many statements it takes. Adapters supply
:meth:`SqlStore._run` (a transaction) and :meth:`SqlStore._read`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import orjson

from bourse.ports.stores import (
    Account,
    AccountExists,
    ApiKey,
    AuditEntry,
    Hold,
    HoldNotOpen,
    HoldState,
    IdemBegin,
    InsufficientFunds,
    Job,
    KeyBudgetExceeded,
    KeyChanged,
    KeyRevoked,
    ResealReport,
    ResponseRecord,
    StoredResponse,
    StoreUnavailable,
    Totals,
    UnknownAccount,
    UnknownKey,
    UsageRecord,
    WebhookSecretUnreadable,
    new_webhook_secret,
)
from bourse.storage import sealing
from bourse.storage.batching import Coalescer
from bourse.storage.executor import Executor, Row
from bourse.storage.schema import migrations
from bourse.storage.sealing import Sealer

T = TypeVar("T")


class IntegrityError(Exception):
    """A uniqueness or check constraint refused a write (adapter-neutral)."""


def _new_id(prefix: str) -> str:
    return prefix + os.urandom(10).hex()


def hold_row(row: Row) -> Hold:
    return Hold(
        id=row["id"],
        account_id=row["account_id"],
        request_id=row["request_id"],
        amount_micros=int(row["amount_micros"]),
        state=row["state"],
        charged_micros=int(row["charged_micros"]),
        owner=row["owner"],
        product=row["product"],
        created_at=float(row["created_at"]),
        note=row["note"],
        key_id=row["key_id"],
        spend_period=None if row["spend_period"] is None else int(row["spend_period"]),
    )


def _usage(row: Row) -> UsageRecord:
    return UsageRecord(
        request_id=row["request_id"],
        account_id=row["account_id"],
        product=row["product"],
        created_at=float(row["created_at"]),
        outcome=row["outcome"],
        cost_micros=int(row["cost_micros"]),
        record=orjson.loads(row["record"]),
    )


_USAGE_UPSERT = (
    "INSERT INTO usage (request_id, account_id, product, created_at, outcome, cost_micros, record) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7) "
    "ON CONFLICT (request_id) DO UPDATE SET outcome = excluded.outcome, cost_micros = excluded.cost_micros, "
    "record = excluded.record"
)
_ACCOUNTS = (
    "SELECT a.id, a.balance_micros, a.created_at, "
    "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE account_id = a.id AND state = 'open'), 0) AS open_m, "
    "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE account_id = a.id AND state = 'reconciling'), 0) AS rec_m, "
    "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE account_id = a.id AND state = 'settled'), 0) "
    "+ COALESCE((SELECT charged_micros FROM pruned WHERE account_id = a.id), 0) AS spent_m, "
    "COALESCE((SELECT SUM(amount_micros) FROM credits WHERE account_id = a.id), 0) AS credit_m "
    "FROM accounts a"
)
_ACCOUNT = _ACCOUNTS + " WHERE a.id = $1"


def _put_usage(db: Executor, usage: UsageRecord) -> None:
    db.execute(
        _USAGE_UPSERT,
        usage.request_id, usage.account_id, usage.product, usage.created_at, usage.outcome,
        usage.cost_micros, orjson.dumps(dict(usage.record)).decode(),
    )  # fmt: skip


def _account(db: Executor, account_id: str) -> Account | None:
    row = db.fetchrow(_ACCOUNT, account_id)
    return None if row is None else _account_row(row)


def _account_row(row: Row) -> Account:
    return Account(
        id=row["id"],
        balance_micros=int(row["balance_micros"]),
        open_holds_micros=int(row["open_m"]),
        reconciling_micros=int(row["rec_m"]),
        spent_micros=int(row["spent_m"]),
        credited_micros=int(row["credit_m"]),
        created_at=float(row["created_at"]),
    )


def _accounts_page(db: Executor, limit: int, after: str | None) -> list[Account]:
    where, args = ("", ()) if after is None else (" WHERE a.id > $1", (after,))
    rows = db.fetch(f"{_ACCOUNTS}{where} ORDER BY a.id LIMIT {max(1, min(limit, 1000))}", *args)
    return [_account_row(r) for r in rows]


# -- transactions (each runs on the database thread) ------------------------------------


def _with_audit(db: Executor, audit: AuditEntry | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(db, *args)``, then the audit entry of the action, in the same transaction."""
    out = fn(db, *args)
    if audit is not None:
        _add_audit(db, audit)
    return out


def _add_audit(db: Executor, entry: AuditEntry) -> None:
    db.execute(
        "INSERT INTO audit_log (id, at, actor, action, target, detail) VALUES ($1, $2, $3, $4, $5, $6)",
        entry.id, entry.at, entry.actor, entry.action, entry.target, orjson.dumps(dict(entry.detail)).decode(),
    )  # fmt: skip


def _audit_page(
    db: Executor, action: str | None, target: str | None, limit: int, after: str | None
) -> list[AuditEntry]:
    args: list[Any] = []
    where: list[str] = []
    for column, value in (("action", action), ("target", target)):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    if after is not None:
        row = db.fetchrow("SELECT at FROM audit_log WHERE id = $1", after)
        if row is None:
            return []
        args.extend((row["at"], after))
        t, i = len(args) - 1, len(args)
        where.append(f"(at < ${t} OR (at = ${t} AND id < ${i}))")
    sql = "SELECT * FROM audit_log" + (" WHERE " + " AND ".join(where) if where else "")
    sql += f" ORDER BY at DESC, id DESC LIMIT {max(1, min(limit, 1000))}"
    return [
        AuditEntry(r["id"], float(r["at"]), r["actor"], r["action"], r["target"], orjson.loads(r["detail"]))
        for r in db.fetch(sql, *args)
    ]


def _migrate(db: Executor, lock_sql: str | None, now: float) -> int:
    """Apply every pending migration in one transaction (under ``lock_sql`` if given,
    so replicas starting together migrate once)."""
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
        _add_audit(db, dataclasses.replace(audit, detail={**audit.detail, **counts}))
    return report


def _create_account(
    db: Executor, account_id: str, credit_micros: int, now: float, seal: Callable[[Executor, str], str]
) -> Account:
    if db.fetchrow("SELECT id FROM accounts WHERE id = $1", account_id) is not None:
        raise AccountExists(account_id)
    db.execute(
        "INSERT INTO accounts (id, balance_micros, created_at, webhook_secret) VALUES ($1, $2, $3, $4)",
        account_id, credit_micros, now, seal(db, new_webhook_secret()),
    )  # fmt: skip
    if credit_micros:
        db.execute(
            "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ($1, $2, $3, $4, $5)",
            _new_id("cr_"), account_id, credit_micros, "opening credit", now,
        )  # fmt: skip
    acc = _account(db, account_id)
    assert acc is not None
    return acc


def _credit(db: Executor, account_id: str, amount_micros: int, now: float, memo: str) -> Account:
    if (
        db.execute(
            "UPDATE accounts SET balance_micros = balance_micros + $2 WHERE id = $1",
            account_id,
            amount_micros,
        )
        != 1
    ):
        raise UnknownAccount(account_id)
    db.execute(
        "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ($1, $2, $3, $4, $5)",
        _new_id("cr_"), account_id, amount_micros, memo, now,
    )  # fmt: skip
    acc = _account(db, account_id)
    assert acc is not None
    return acc


_SPEND_IN_PERIOD = "(CASE WHEN spend_period = $2 THEN spend_micros ELSE 0 END)"


def _count_on_cap(db: Executor, key_id: str, period: int, amount: int) -> bool:
    """Count ``amount`` on the key's spend cap in ``period``, or KeyBudgetExceeded; False
    when the key has no cap (nothing counted). One conditional UPDATE: concurrent holds
    of one key queue on its row and each sees the others' amounts."""
    n = db.execute(
        f"UPDATE api_keys SET spend_micros = {_SPEND_IN_PERIOD} + $3, spend_period = $2 "
        f"WHERE id = $1 AND spend_cap_micros IS NOT NULL AND {_SPEND_IN_PERIOD} + $3 <= spend_cap_micros",
        key_id, period, amount,
    )  # fmt: skip
    if n == 1:
        return True
    row = db.fetchrow(
        "SELECT spend_cap_micros, spend_cap_period, spend_micros, spend_period FROM api_keys WHERE id = $1",
        key_id,
    )
    if row is None or row["spend_cap_micros"] is None:
        return False
    spent = int(row["spend_micros"]) if int(row["spend_period"]) == period else 0
    raise KeyBudgetExceeded(int(row["spend_cap_micros"]), spent, row["spend_cap_period"])


def _new_hold(db: Executor, hold: Hold) -> None:
    """The hold's row, counted on its key's cap: the key's row first (only a capped
    key's row is locked), the hold row next; the caller debits the account last, so
    the account's row lock (every request of an account takes it) is held for one
    statement and the commit. Raises without an SQL error (the transaction stays
    usable for a batch's other holds), having undone its cap count."""
    period = hold.spend_period
    if period is not None and (
        hold.key_id is None or not _count_on_cap(db, hold.key_id, period, hold.amount_micros)
    ):
        period = None
    n = db.execute(
        "INSERT INTO holds (id, account_id, request_id, amount_micros, charged_micros, state, owner, product, "
        "note, created_at, updated_at, key_id, spend_period) "
        "SELECT $1, $2, $3, $4, 0, 'open', $5, $6, NULL, $7, $7, $8, $9 "
        "WHERE EXISTS (SELECT 1 FROM accounts WHERE id = $2) ON CONFLICT DO NOTHING",
        hold.id, hold.account_id, hold.request_id, hold.amount_micros, hold.owner, hold.product, hold.created_at,
        hold.key_id, period,
    )  # fmt: skip
    if n == 1:
        return
    if period is not None:
        _uncount(db, hold.key_id, period, hold.amount_micros)
    if db.fetchrow("SELECT 1 AS x FROM accounts WHERE id = $1", hold.account_id) is None:
        raise UnknownAccount(hold.account_id)
    raise IntegrityError(f"hold {hold.id} exists")


def _uncount(db: Executor, key_id: Any, period: Any, amount: int) -> None:
    """Give back ``amount`` to the key's cap (if still in ``period``)."""
    db.execute(
        "UPDATE api_keys SET spend_micros = CASE WHEN spend_micros > $3 THEN spend_micros - $3 ELSE 0 END "
        "WHERE id = $1 AND spend_period = $2",
        key_id, period, amount,
    )  # fmt: skip


def _debit(db: Executor, account_id: str, amount: int) -> bool:
    """Take ``amount`` from the account's balance; False when it cannot cover it."""
    n = db.execute(
        "UPDATE accounts SET balance_micros = balance_micros - $2 WHERE id = $1 AND balance_micros >= $2",
        account_id, amount,
    )  # fmt: skip
    return n == 1


def _place_hold(db: Executor, hold: Hold) -> None:
    _new_hold(db, hold)
    if not _debit(
        db, hold.account_id, hold.amount_micros
    ):  # the transaction rolls back, the hold row with it
        row = db.fetchrow("SELECT balance_micros FROM accounts WHERE id = $1", hold.account_id)
        if row is None:
            raise UnknownAccount(hold.account_id)
        raise InsufficientFunds(int(row["balance_micros"]))


class BatchShort(Exception):
    """The account cannot cover a batch's holds together (the batch rolls back and
    each of its holds is placed alone, to find which ones it can cover)."""


@functools.lru_cache(maxsize=1024)
def values_list(rows: int, columns: int, cast: tuple[str, ...] = (), *, start: int = 0) -> str:
    """``($1, $2), ($3, $4)``: the parameters of a multi-row VALUES list, numbered
    after ``start`` (``cast``, if given, types each column, as ``CAST($n AS type)``).
    Kept once made: a batch of writes asks for one on every transaction, with a few
    shapes (batches are at most :data:`~bourse.storage.batching.MAX_BATCH` long)."""
    out = []
    for r in range(rows):
        cells = [f"${start + r * columns + c + 1}" for c in range(columns)]
        if cast:
            cells = [f"CAST({p} AS {t})" if t else p for p, t in zip(cells, cast, strict=True)]
        out.append("(" + ", ".join(cells) + ")")
    return ", ".join(out)


HOLD_COLUMNS = (
    "id, account_id, request_id, amount_micros, charged_micros, state, owner, product, note, created_at, "
    "updated_at, key_id, spend_period"
)


def hold_row_args(holds: list[Hold]) -> list[Any]:
    """The eight values each new hold is inserted with (id, account, request, amount,
    owner, product, created_at, key_id), flat, for one multi-row INSERT."""
    args: list[Any] = []
    for h in holds:
        args += (
            h.id,
            h.account_id,
            h.request_id,
            h.amount_micros,
            h.owner,
            h.product,
            h.created_at,
            h.key_id,
        )
    return args


def _insert_holds(db: Executor, holds: list[Hold]) -> set[str]:
    """Insert uncapped holds of existing accounts in one statement; the ids inserted
    (a hold whose id exists is left out)."""
    args = hold_row_args(holds)
    values = values_list(len(holds), 8)
    rows = db.fetch(
        f"INSERT INTO holds ({HOLD_COLUMNS}) SELECT column1, column2, column3, column4, 0, 'open', column5, "
        f"column6, NULL, column7, column7, column8, NULL FROM (VALUES {values}) AS v WHERE true "
        "ON CONFLICT DO NOTHING RETURNING id",
        *args,
    )
    return {r["id"] for r in rows}


def _new_holds(db: Executor, holds: list[Hold]) -> list[Exception | None]:
    """The rows of a batch's holds (the capped ones in key order, the others in one
    statement), each hold's refusal or None; the caller debits the accounts."""
    out: list[Exception | None] = [None] * len(holds)
    seen: set[str] = set()
    for i, h in enumerate(holds):  # one row per id: a second hold of an id in the batch is refused
        if h.id in seen:
            out[i] = IntegrityError(f"hold {h.id} exists")
        seen.add(h.id)
    for account_id in sorted({h.account_id for h in holds}):
        if db.fetchrow("SELECT 1 AS x FROM accounts WHERE id = $1", account_id) is None:
            for i, h in enumerate(holds):
                if h.account_id == account_id:
                    out[i] = UnknownAccount(account_id)
    capped = [i for i, h in enumerate(holds) if out[i] is None and h.spend_period is not None]
    for i in sorted(capped, key=lambda i: holds[i].key_id or ""):
        try:
            _new_hold(db, holds[i])
        except (KeyBudgetExceeded, UnknownAccount, IntegrityError) as exc:
            out[i] = exc
            continue
    plain = [i for i, h in enumerate(holds) if out[i] is None and h.spend_period is None]
    inserted = _insert_holds(db, [holds[i] for i in plain]) if plain else set()
    for i in plain:
        if holds[i].id not in inserted:
            out[i] = IntegrityError(f"hold {holds[i].id} exists")
    return out


Closing = tuple[str, HoldState, int, UsageRecord | None, str | None, float]
"""One settle or release: ``(hold_id, state, charge_micros, usage, note, now)``."""


def _close_row(db: Executor, item: Closing) -> Row | None:
    """Close the hold's row (settled or released) and write its usage record; the row,
    or None when the hold is not open. The caller returns the unused amount."""
    hold_id, state, charge_micros, usage, note, now = item
    charge = max(0, charge_micros) if state == "settled" else 0
    row = db.fetchrow(
        "UPDATE holds SET state = $2, "
        "charged_micros = CASE WHEN $3 < amount_micros THEN $3 ELSE amount_micros END, "
        "note = COALESCE($4, note), updated_at = $5 "
        "WHERE id = $1 AND state IN ('open', 'reconciling') RETURNING *",
        hold_id, state, charge, note, now,
    )  # fmt: skip
    if row is not None and usage is not None:
        _put_usage(db, usage)
    return row


def _unused(row: Row) -> int:
    return int(row["amount_micros"]) - int(row["charged_micros"])


def _refund_cap(db: Executor, row: Row) -> None:
    """The key's cap gets back what the hold did not charge (if still in that period)."""
    unused = _unused(row)
    if row["spend_period"] is not None and row["key_id"] is not None and unused:
        _uncount(db, row["key_id"], row["spend_period"], unused)


def _refund(db: Executor, account_id: str, unused: int) -> None:
    # the account last: its row lock is held for one statement and the commit
    db.execute("UPDATE accounts SET balance_micros = balance_micros + $2 WHERE id = $1", account_id, unused)


def _close_hold(
    db: Executor,
    hold_id: str,
    state: HoldState,
    charge_micros: int,
    usage: UsageRecord | None,
    note: str | None,
    now: float,
) -> Hold:
    if state == "reconciling":
        row = db.fetchrow(
            "UPDATE holds SET state = 'reconciling', note = $2, updated_at = $3 WHERE id = $1 AND state = 'open' "
            "RETURNING *",
            hold_id, note, now,
        )  # fmt: skip
        if row is not None and usage is not None:
            _put_usage(db, usage)
    else:
        row = _close_row(db, (hold_id, state, charge_micros, usage, note, now))
        if row is not None:
            _refund_cap(db, row)
            _refund(db, row["account_id"], _unused(row))
    if row is None:
        raise HoldNotOpen(hold_id)
    return hold_row(row)


def _close_rows(db: Executor, items: list[Closing]) -> list[Row]:
    """Close the holds' rows (settled or released) in one statement, then write their
    usage records in one more; the rows closed (a hold not open is left out)."""
    args: list[Any] = []
    for hold_id, state, charge, _, note, now in items:
        args += (hold_id, state, max(0, charge) if state == "settled" else 0, note, now)
    values = values_list(len(items), 5, ("", "", "BIGINT", "TEXT", "DOUBLE PRECISION"))
    rows = db.fetch(
        "UPDATE holds SET state = v.column2, "
        "charged_micros = CASE WHEN v.column3 < amount_micros THEN v.column3 ELSE amount_micros END, "
        f"note = COALESCE(v.column4, note), updated_at = v.column5 FROM (VALUES {values}) AS v "
        f"WHERE holds.id = v.column1 AND holds.state IN ('open', 'reconciling') RETURNING {HOLD_COLUMNS}",
        *args,
    )
    closed = {r["id"] for r in rows}
    usages = {u.request_id: u for hold_id, _, _, u, _, _ in items if u is not None and hold_id in closed}
    if usages:
        args = []
        for u in usages.values():
            args += (u.request_id, u.account_id, u.product, u.created_at, u.outcome, u.cost_micros)
            args.append(orjson.dumps(dict(u.record)).decode())
        db.execute(_USAGE_UPSERT.replace("($1, $2, $3, $4, $5, $6, $7)", values_list(len(usages), 7)), *args)
    return rows


LedgerWrite = Hold | Closing
"""A write of the ledger's group commit: a hold to place, or a close."""


def _ledger_batch(db: Executor, items: list[LedgerWrite]) -> list[Hold | Exception | None]:
    """Holds and closes of one account in one transaction, in the order every ledger
    transaction locks: the closed hold rows, the capped holds' key rows (in key
    order), then each account's row once, for the net of its debits and refunds
    (:class:`BatchShort` when that is more than its balance). A close gives its hold,
    a hold None, a refused write its exception."""
    out: list[Hold | Exception | None] = [None] * len(items)
    delta: dict[str, int] = {}
    closes: list[tuple[int, Closing]] = []
    closing: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, Hold):
            continue
        if item[0] in closing:  # a second close of one hold in the batch finds it closed
            out[i] = HoldNotOpen(item[0])
            continue
        closing.add(item[0])
        closes.append((i, item))
    rows = {r["id"]: r for r in _close_rows(db, [c for _, c in closes])} if closes else {}
    for i, close in closes:
        row = rows.get(close[0])
        out[i] = HoldNotOpen(close[0]) if row is None else hold_row(row)
        if row is not None:
            delta[row["account_id"]] = delta.get(row["account_id"], 0) + _unused(row)
    holds = [(i, item) for i, item in enumerate(items) if isinstance(item, Hold)]
    refused = _new_holds(db, [h for _, h in holds]) if holds else []
    for (i, hold), exc in zip(holds, refused, strict=True):
        out[i] = exc
        if exc is None:
            delta[hold.account_id] = delta.get(hold.account_id, 0) - hold.amount_micros
    for account_id in sorted(delta):
        if delta[account_id] > 0:
            _refund(db, account_id, delta[account_id])
        elif delta[account_id] < 0 and not _debit(db, account_id, -delta[account_id]):
            raise BatchShort(account_id)
    return out


def _holds(db: Executor, state: HoldState | None, account_id: str | None, limit: int) -> list[Hold]:
    where: list[str] = []
    args: list[Any] = []
    if state is not None:
        args.append(state)
        where.append(f"state = ${len(args)}")
    if account_id is not None:
        args.append(account_id)
        where.append(f"account_id = ${len(args)}")
    sql = "SELECT * FROM holds" + (" WHERE " + " AND ".join(where) if where else "")
    sql += f" ORDER BY created_at DESC LIMIT {max(1, min(limit, 1000))}"
    return [hold_row(r) for r in db.fetch(sql, *args)]


RECONCILE_CHUNK = 500
"""Hold ids one reconciling statement names (SQLite's parameter limit is far above)."""


def _reconcile_orphans(
    db: Executor, owner: str, all_others: bool, include_own: bool, hold_ids: Sequence[str] | None
) -> int:
    if hold_ids is not None:  # the hold sweeper's: this instance's own, that no run holds any more
        n = 0
        for i in range(0, len(hold_ids), RECONCILE_CHUNK):
            chunk = hold_ids[i : i + RECONCILE_CHUNK]
            marks = ", ".join(f"${k}" for k in range(2, 2 + len(chunk)))
            n += db.execute(
                "UPDATE holds SET state = 'reconciling', note = 'no run of its gateway holds it', "
                f"updated_at = {db.clock} WHERE state = 'open' AND owner = $1 AND id IN ({marks})",
                owner, *chunk,
            )  # fmt: skip
        return n
    own = " OR owner = $1" if include_own else ""
    if all_others:
        return db.execute(
            "UPDATE holds SET state = 'reconciling', note = 'open when its gateway stopped', "
            f"updated_at = {db.clock} WHERE state = 'open' AND (owner <> $1{own})",
            owner,
        )  # fmt: skip
    return db.execute(
        f"UPDATE holds SET state = 'reconciling', note = 'its gateway lease lapsed', updated_at = {db.clock} "
        "WHERE state = 'open' AND (owner <> $1 AND owner NOT IN "
        f"(SELECT id FROM instances WHERE lease_until >= {db.clock}){own})",
        owner,
    )  # fmt: skip


def _heartbeat(db: Executor, owner: str, lease_s: float) -> float:
    """Renew ``owner``'s lease until the database's now + ``lease_s``; the database's now."""
    row = db.fetchrow(f"SELECT {db.clock} AS now")
    assert row is not None
    now = float(row["now"])
    if db.execute("UPDATE instances SET lease_until = $2 WHERE id = $1", owner, now + lease_s) == 0:
        db.execute(
            "INSERT INTO instances (id, started_at, lease_until) VALUES ($1, $2, $3)",
            owner,
            now,
            now + lease_s,
        )
    db.execute("DELETE FROM instances WHERE lease_until < $1", now - 86_400)
    return now


def _totals(db: Executor) -> Totals:
    row = db.fetchrow(
        "SELECT "
        "COALESCE((SELECT SUM(amount_micros) FROM credits), 0) AS c, "
        "COALESCE((SELECT SUM(balance_micros) FROM accounts), 0) AS b, "
        "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE state IN ('open', 'reconciling')), 0) AS h, "
        "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE state = 'settled'), 0) "
        "+ COALESCE((SELECT SUM(charged_micros) FROM pruned), 0) AS r"
    )
    assert row is not None
    return Totals(int(row["c"]), int(row["b"]), int(row["h"]), int(row["r"]))


def _hold_counts(db: Executor) -> dict[str, tuple[int, int]]:
    rows = db.fetch(
        "SELECT state, COUNT(*) AS n, COALESCE(SUM(amount_micros), 0) AS m FROM holds "
        "WHERE state IN ('open', 'reconciling') GROUP BY state"
    )
    return {str(r["state"]): (int(r["n"]), int(r["m"])) for r in rows}


def _job_counts(db: Executor) -> dict[str, int]:
    return {
        str(r["status"]): int(r["n"])
        for r in db.fetch("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
    }


# -- retention: usage records and closed holds past their age ---------------------------
#
# The unit is a request: its holds and its usage record go together, and only once all
# of them are old (the usage record by its created_at, each hold by its updated_at, the
# time it was closed), none of its holds is open or reconciling and no unfinished job
# runs it (a resumed job reads its earlier hold). What they added up to goes to
# ``pruned`` in the same transaction, so the ledger's sums still balance.

_OLD_ENOUGH = (
    "{h}.state IN ('settled', 'released') AND {h}.updated_at < {cutoff} "
    "AND NOT EXISTS (SELECT 1 FROM holds o WHERE o.request_id = {h}.request_id "
    "AND (o.state IN ('open', 'reconciling') OR o.updated_at >= {cutoff})) "
    "AND NOT EXISTS (SELECT 1 FROM usage u WHERE u.request_id = {h}.request_id AND u.created_at >= {cutoff}) "
    "AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.request_id = {h}.request_id AND j.status IN ('queued', 'running'))"
)
"""A closed hold whose request's records are all older than the cutoff, and free to go."""


def _prunable(db: Executor, age_s: float, limit: int) -> list[str]:
    """Up to ``limit`` requests whose records are all older than ``age_s`` (a read)."""
    where = _OLD_ENOUGH.format(h="h", cutoff=f"({db.clock} - $1)")
    rows = db.fetch(
        f"SELECT DISTINCT h.request_id FROM holds h WHERE {where} LIMIT {max(1, int(limit))}", age_s
    )
    return [str(r["request_id"]) for r in rows]


def _prune(db: Executor, request_ids: Sequence[str], age_s: float) -> tuple[int, int]:
    """Delete the holds and usage records of ``request_ids`` that are still old enough
    (checked again: this is a later transaction than the look), adding their sums to
    ``pruned``; (holds, usage records) deleted."""
    if not request_ids:
        return 0, 0
    ids = ", ".join(f"${i}" for i in range(2, len(request_ids) + 2))
    where = _OLD_ENOUGH.format(h="holds", cutoff=f"({db.clock} - $1)")
    gone = db.fetch(
        f"DELETE FROM holds WHERE request_id IN ({ids}) AND {where} "
        "RETURNING account_id, request_id, state, charged_micros, key_id, spend_period",
        age_s, *request_ids,
    )  # fmt: skip
    if not gone:
        return 0, 0
    sums: dict[str, list[int]] = {}  # account -> [charged, usage cost, holds, usage records]
    caps: dict[tuple[str, int], int] = {}  # (key, spend period) -> charged
    for r in gone:
        charged = int(r["charged_micros"]) if r["state"] == "settled" else 0
        acc = sums.setdefault(str(r["account_id"]), [0, 0, 0, 0])
        acc[0] += charged
        acc[2] += 1
        if charged and r["key_id"] is not None and r["spend_period"] is not None:
            cap = (str(r["key_id"]), int(r["spend_period"]))
            caps[cap] = caps.get(cap, 0) + charged
    done = sorted({str(r["request_id"]) for r in gone})
    used = db.fetch(
        f"DELETE FROM usage WHERE request_id IN ({', '.join(f'${i}' for i in range(1, len(done) + 1))}) "
        "RETURNING account_id, cost_micros",
        *done,
    )
    for r in used:
        acc = sums.setdefault(str(r["account_id"]), [0, 0, 0, 0])
        acc[1] += int(r["cost_micros"])
        acc[3] += 1
    for account_id, (charged, cost, holds, records) in sums.items():
        db.execute(
            "INSERT INTO pruned (account_id, charged_micros, usage_cost_micros, holds, usage_records, updated_at) "
            f"VALUES ($1, $2, $3, $4, $5, {db.clock}) ON CONFLICT (account_id) DO UPDATE SET "
            "charged_micros = pruned.charged_micros + excluded.charged_micros, "
            "usage_cost_micros = pruned.usage_cost_micros + excluded.usage_cost_micros, "
            "holds = pruned.holds + excluded.holds, usage_records = pruned.usage_records + excluded.usage_records, "
            "updated_at = excluded.updated_at",
            account_id, charged, cost, holds, records,
        )  # fmt: skip
    for (key_id, period), charged in caps.items():
        db.execute(
            "INSERT INTO pruned_key_spend (key_id, spend_period, charged_micros) VALUES ($1, $2, $3) "
            "ON CONFLICT (key_id, spend_period) DO UPDATE SET "
            "charged_micros = pruned_key_spend.charged_micros + excluded.charged_micros",
            key_id, period, charged,
        )  # fmt: skip
    return len(gone), len(used)


def _create_key(db: Executor, key: ApiKey, key_hash: str) -> None:
    if db.fetchrow("SELECT id FROM accounts WHERE id = $1", key.account_id) is None:
        raise UnknownAccount(key.account_id)
    db.execute(
        "INSERT INTO api_keys (id, key_hash, account_id, products, rpm, tpm, max_streams, created_at, name, "
        "expires_at, spend_cap_micros, spend_cap_period) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        key.id, key_hash, key.account_id,
        None if key.products is None else orjson.dumps(list(key.products)).decode(),
        key.rpm, key.tpm, key.max_streams, key.created_at, key.name, key.expires_at,
        key.spend_cap_micros, None if key.spend_cap_micros is None else key.spend_cap_period or "total",
    )  # fmt: skip


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _key(row: Row, grace_until: float | None = None) -> ApiKey:
    products = row["products"]
    cap = row["spend_cap_micros"]
    return ApiKey(
        id=row["id"],
        account_id=row["account_id"],
        products=None if products is None else tuple(orjson.loads(products)),
        rpm=row["rpm"],
        tpm=row["tpm"],
        max_streams=row["max_streams"],
        created_at=float(row["created_at"]),
        name=row["name"],
        expires_at=_opt_float(row["expires_at"]),
        revoked_at=_opt_float(row["revoked_at"]),
        last_used_at=_opt_float(row["last_used_at"]),
        spend_cap_micros=None if cap is None else int(cap),
        spend_cap_period=row["spend_cap_period"],
        spend_micros=int(row["spend_micros"]),
        spend_period=int(row["spend_period"]),
        grace_until=grace_until,
    )


_KEY_BY_HASH = (
    "SELECT k.*, NULL AS grace_until FROM api_keys k WHERE k.key_hash = $1 "
    "UNION ALL SELECT k.*, g.valid_until AS grace_until FROM api_key_grace g "
    "JOIN api_keys k ON k.id = g.key_id WHERE g.key_hash = $1"
)


def _key_by_hash(db: Executor, key_hash: str) -> ApiKey | None:
    row = db.fetchrow(_KEY_BY_HASH, key_hash)
    return None if row is None else _key(row, _opt_float(row["grace_until"]))


def _keys_page(db: Executor, account_id: str | None, limit: int, after: str | None) -> list[ApiKey]:
    args: list[Any] = []
    where: list[str] = []
    if account_id is not None:
        args.append(account_id)
        where.append(f"account_id = ${len(args)}")
    if after is not None:
        row = db.fetchrow("SELECT created_at FROM api_keys WHERE id = $1", after)
        if row is None:
            return []
        args.extend((row["created_at"], after))
        t, i = len(args) - 1, len(args)
        where.append(f"(created_at < ${t} OR (created_at = ${t} AND id < ${i}))")
    sql = "SELECT * FROM api_keys" + (" WHERE " + " AND ".join(where) if where else "")
    sql += f" ORDER BY created_at DESC, id DESC LIMIT {max(1, min(limit, 1000))}"
    return [_key(r) for r in db.fetch(sql, *args)]


def _revoke_key(db: Executor, key_id: str, now: float) -> ApiKey:
    row = db.fetchrow(
        "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1 RETURNING *", key_id, now
    )
    if row is None:
        raise UnknownKey(key_id)
    return _key(row)


def _rotate_key(db: Executor, key_id: str, new_hash: str, old_valid_until: float, now: float) -> ApiKey:
    row = db.fetchrow("SELECT key_hash, revoked_at FROM api_keys WHERE id = $1", key_id)
    if row is None:
        raise UnknownKey(key_id)
    if row["revoked_at"] is not None:
        raise KeyRevoked(key_id)
    old_hash = row["key_hash"]
    # compare and swap: of two rotations at once, the second finds the hash changed
    updated = db.fetchrow(
        "UPDATE api_keys SET key_hash = $2 WHERE id = $1 AND key_hash = $3 AND revoked_at IS NULL RETURNING *",
        key_id, new_hash, old_hash,
    )  # fmt: skip
    if updated is None:  # revoked, or rotated by another call, since the SELECT
        raise KeyChanged(key_id)
    db.execute("DELETE FROM api_key_grace WHERE key_id = $1 AND valid_until <= $2", key_id, now)
    if old_valid_until > now:
        db.execute(
            "INSERT INTO api_key_grace (key_hash, key_id, valid_until) VALUES ($1, $2, $3)",
            old_hash, key_id, old_valid_until,
        )  # fmt: skip
    return _key(updated)


def _touch_keys(db: Executor, used: Mapping[str, float]) -> None:
    for key_id, at in sorted(used.items()):  # one order, so two replicas never deadlock
        db.execute(
            "UPDATE api_keys SET last_used_at = $2 WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < $2)",
            key_id, at,
        )  # fmt: skip


def _usage_page(
    db: Executor,
    account_id: str,
    limit: int,
    before: float | None,
    since: float | None,
    until: float | None,
    after: str | None,
) -> list[UsageRecord]:
    args: list[Any] = [account_id]
    where = ["account_id = $1"]
    for op, value in (("<", before), (">=", since), ("<=", until)):
        if value is not None:
            args.append(value)
            where.append(f"created_at {op} ${len(args)}")
    if after is not None:
        # keyset cursor: strictly after the record ``after`` in (created_at, request_id) order
        row = db.fetchrow(
            "SELECT created_at FROM usage WHERE account_id = $1 AND request_id = $2", account_id, after
        )
        if row is None:
            return []
        args.extend((row["created_at"], after))
        t, r = len(args) - 1, len(args)
        where.append(f"(created_at < ${t} OR (created_at = ${t} AND request_id < ${r}))")
    sql = (
        f"SELECT * FROM usage WHERE {' AND '.join(where)} ORDER BY created_at DESC, request_id DESC "
        f"LIMIT {max(1, min(limit, 1000))}"
    )
    return [_usage(r) for r in db.fetch(sql, *args)]


def _idem_begin(
    db: Executor, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
) -> IdemBegin:
    db.execute(
        "DELETE FROM idempotency WHERE account_id = $1 AND key = $2 AND expires_at < $3", account_id, key, now
    )
    row = db.fetchrow(
        "SELECT body_hash, state, status, headers, body FROM idempotency WHERE account_id = $1 AND key = $2",
        account_id, key,
    )  # fmt: skip
    if row is None:
        db.execute(
            "INSERT INTO idempotency (account_id, key, body_hash, state, created_at, expires_at) "
            "VALUES ($1, $2, $3, 'in_flight', $4, $5)",
            account_id, key, body_hash, now, now + ttl_s,
        )  # fmt: skip
        return IdemBegin("new")
    if row["body_hash"] != body_hash:
        return IdemBegin("conflict")
    if row["state"] != "done":
        return IdemBegin("in_flight")
    headers = orjson.loads(row["headers"]) if row["headers"] else {}
    return IdemBegin("done", StoredResponse(int(row["status"]), headers, bytes(row["body"] or b"")))


def _idem_complete(db: Executor, account_id: str, key: str, response: StoredResponse | None) -> None:
    if response is None:
        db.execute("DELETE FROM idempotency WHERE account_id = $1 AND key = $2", account_id, key)
        return
    db.execute(
        "UPDATE idempotency SET state = 'done', status = $3, headers = $4, body = $5 WHERE account_id = $1 AND key = $2",
        account_id, key, response.status, orjson.dumps(dict(response.headers)).decode(), response.body,
    )  # fmt: skip


_JOB_FIELDS = frozenset(
    {
        "status",
        "hold_id",
        "request_id",
        "started_at",
        "finished_at",
        "result",
        "error",
        "webhook_state",
        "webhook_error",
        "bid",
        "owner",
        "expires_at",
    }
)


def _job(row: Row) -> Job:
    return Job(
        id=row["id"],
        account_id=row["account_id"],
        key_id=row["key_id"],
        endpoint=row["endpoint"],
        body=orjson.loads(row["body"]),
        status=row["status"],
        request_id=row["request_id"],
        bid=float(row["bid"]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
        hold_id=row["hold_id"],
        webhook_url=row["webhook_url"],
        webhook_state=row["webhook_state"],
        webhook_error=row["webhook_error"],
        result=None if row["result"] is None else orjson.loads(row["result"]),
        error=None if row["error"] is None else orjson.loads(row["error"]),
        started_at=None if row["started_at"] is None else float(row["started_at"]),
        finished_at=None if row["finished_at"] is None else float(row["finished_at"]),
        owner=row["owner"],
    )


def _put_job(db: Executor, job: Job) -> None:
    db.execute(
        "INSERT INTO jobs (id, account_id, key_id, endpoint, body, status, request_id, bid, hold_id, webhook_url, "
        "webhook_state, created_at, expires_at, owner) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        job.id, job.account_id, job.key_id, job.endpoint, orjson.dumps(dict(job.body)).decode(), job.status,
        job.request_id, job.bid, job.hold_id, job.webhook_url, job.webhook_state, job.created_at, job.expires_at,
        job.owner,
    )  # fmt: skip


def _claim_jobs(db: Executor, owner: str, all_others: bool, include_own: bool) -> list[Job]:
    mine = " OR owner = $1" if include_own else ""
    sql = "UPDATE jobs SET owner = $1 WHERE status IN ('queued', 'running') AND ("
    if all_others:
        rows = db.fetch(sql + f"owner IS NULL OR owner <> $1{mine}) RETURNING *", owner)
    else:  # only those whose owner's lease lapsed, on the database's clock
        live = (
            "owner IS NULL OR (owner <> $1 AND owner NOT IN "
            f"(SELECT id FROM instances WHERE lease_until >= {db.clock}))"
        )
        rows = db.fetch(sql + live + mine + ") RETURNING *", owner)
    jobs = [_job(r) for r in rows]
    jobs.sort(key=lambda j: (j.created_at, j.id))
    return jobs


def _update_job(db: Executor, job_id: str, fields: dict[str, Any]) -> None:
    sets: list[str] = []
    args: list[Any] = [job_id]
    for name, value in fields.items():
        if name not in _JOB_FIELDS:
            raise ValueError(f"not a job field: {name}")
        if name in ("result", "error") and value is not None:
            value = orjson.dumps(value).decode()
        args.append(value)
        sets.append(f"{name} = ${len(args)}")
    if sets:
        db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = $1", *args)


def _reverse_charge(db: Executor, hold_id: str, note: str, now: float) -> int:
    """A settled hold's charge given back (its answer was lost after it): the hold
    released with nothing charged, its usage record an ``error`` at no cost, the key's
    cap and the account given the charge back, in the ledger's lock order (the hold
    row, the key's, the account's). The amount given back; 0 when not settled."""
    row = db.fetchrow(
        "UPDATE holds SET state = 'released', note = $2, updated_at = $3 WHERE id = $1 AND state = 'settled' "
        "RETURNING *",
        hold_id, note, now,
    )  # fmt: skip
    if row is None:
        return 0
    charged = int(row["charged_micros"])
    db.execute("UPDATE holds SET charged_micros = 0 WHERE id = $1", hold_id)
    usage = db.fetchrow("SELECT record FROM usage WHERE request_id = $1", row["request_id"])
    if usage is not None:
        record = orjson.loads(usage["record"])
        record["outcome"] = "error"
        record["usage"] = {**(record.get("usage") or {}), "cost": 0.0, "cost_micros": 0}
        record["receipt"] = {**(record.get("receipt") or {}), "outcome": "error", "cost_micros": 0}
        record["reversed_micros"] = charged
        db.execute(
            "UPDATE usage SET outcome = 'error', cost_micros = 0, record = $2 WHERE request_id = $1",
            row["request_id"], orjson.dumps(record).decode(),
        )  # fmt: skip
    if charged and row["spend_period"] is not None and row["key_id"] is not None:
        _uncount(db, row["key_id"], row["spend_period"], charged)
    if charged:
        _refund(db, row["account_id"], charged)
    return charged


def _fail_job_refunded(
    db: Executor, job_id: str, hold_id: str, fields: dict[str, Any], note: str, now: float
) -> int:
    given_back = _reverse_charge(db, hold_id, note, now)
    _update_job(db, job_id, fields)
    return given_back


def _jobs_page(db: Executor, account_id: str, limit: int, after: str | None) -> list[Job]:
    args: list[Any] = [account_id]
    where = "account_id = $1"
    if after is not None:
        row = db.fetchrow("SELECT created_at FROM jobs WHERE account_id = $1 AND id = $2", account_id, after)
        if row is None:
            return []
        args.extend((row["created_at"], after))
        where += " AND (created_at < $2 OR (created_at = $2 AND id < $3))"
    sql = (
        f"SELECT * FROM jobs WHERE {where} ORDER BY created_at DESC, id DESC LIMIT {max(1, min(limit, 1000))}"
    )
    return [_job(r) for r in db.fetch(sql, *args)]


def _response(row: Row) -> ResponseRecord:
    return ResponseRecord(
        id=row["id"],
        account_id=row["account_id"],
        status=row["status"],
        body=orjson.loads(row["body"]),
        input_items=orjson.loads(row["input_items"]),
        context=orjson.loads(row["context"]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
        job_id=row["job_id"],
    )


def _put_response(db: Executor, r: ResponseRecord) -> None:
    db.execute(
        "INSERT INTO responses (id, account_id, status, job_id, body, input_items, context, created_at, expires_at) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO UPDATE SET status = $3, job_id = $4, "
        "body = $5, input_items = $6, context = $7, expires_at = $9",
        r.id, r.account_id, r.status, r.job_id, orjson.dumps(r.body).decode(),
        orjson.dumps(r.input_items).decode(), orjson.dumps(r.context).decode(), r.created_at, r.expires_at,
    )  # fmt: skip


class SqlStore:
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
        return await self._run(_migrate, self.migration_lock_sql, time.time())

    # -- ledger -----------------------------------------------------------------------

    async def create_account(
        self, account_id: str, credit_micros: int, now: float, *, audit: AuditEntry | None = None
    ) -> Account:
        if credit_micros < 0:
            raise ValueError("credit cannot be negative")
        try:
            return await self._run(
                _with_audit,
                audit,
                _create_account,
                account_id,
                credit_micros,
                now,
                sealing.sealer_in(self.secret_box),
            )
        except IntegrityError:
            raise AccountExists(account_id) from None

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
        return await self._run(_with_audit, audit, _credit, account_id, amount_micros, now, memo)

    async def account(self, account_id: str) -> Account | None:
        return await self._read(_account, account_id)

    async def accounts_page(self, *, limit: int, after: str | None) -> Sequence[Account]:
        return await self._read(_accounts_page, limit, after)

    async def webhook_secret(self, account_id: str) -> str | None:
        def get(db: Executor) -> str | None:
            row = db.fetchrow("SELECT webhook_secret FROM accounts WHERE id = $1", account_id)
            return None if row is None or row["webhook_secret"] is None else str(row["webhook_secret"])

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
            _with_audit, audit, sealing.set_secret, sealing.sealer_in(self.secret_box), account_id, secret
        )

    async def reseal_webhook_secrets(self, now: float, *, audit: AuditEntry | None = None) -> ResealReport:
        box = self.secret_box
        assert box is not None, "a re-seal needs a secret box"
        return await self._run(_reseal_audited, box, now, audit)

    # Holds and closes of one account are group-committed (storage.batching): one
    # writer per account, its account's row taken once per batch, not once per request.
    _writes: Coalescer[LedgerWrite, Hold | None] | None = None
    _hold_accounts: dict[str, str] | None = None
    """Open uncapped holds placed here, by id: their account (the partition of their close).
    Every way out of open takes its hold out (``_close``, ``_forget``)."""
    HOLD_ACCOUNTS_MAX = 100_000
    """Open holds remembered; beyond it a close runs alone (the map is only a hint)."""

    def _ledger_writer(self) -> tuple[Coalescer[LedgerWrite, Hold | None], dict[str, str]]:
        if self._writes is None or self._hold_accounts is None:
            self._writes = Coalescer(self._write_one, self._write_many, fail_together=(StoreUnavailable,))
            self._hold_accounts = {}
        return self._writes, self._hold_accounts

    def _write_one(self, item: LedgerWrite) -> Awaitable[Hold | None]:
        if isinstance(item, Hold):
            return self._run(_place_hold, item)  # None: placed
        return self._run(_close_hold, *item)

    async def _write_many(self, items: list[LedgerWrite]) -> list[Hold | Exception | None]:
        # a hold is in at most one batch, and after its placement: its close takes it
        # out of _hold_accounts, which has it once it is placed
        try:
            return await self._run(_ledger_batch, items)
        except BatchShort:
            return await self._write_each(items)

    async def _write_each(self, items: list[LedgerWrite]) -> list[Hold | Exception | None]:
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
        writes, accounts = self._ledger_writer()
        await writes.submit(hold.account_id, hold)
        if hold.spend_period is None and len(accounts) < self.HOLD_ACCOUNTS_MAX:
            accounts[hold.id] = hold.account_id  # (a capped hold closes alone)

    def _forget(self, hold_id: str) -> None:
        """``hold_id`` leaves open without the account's writer (reconciling, or an
        operator's close with its audit entry): drop its account from the map."""
        if self._hold_accounts is not None:
            self._hold_accounts.pop(hold_id, None)

    async def _close(self, item: Closing) -> Hold:
        writes, accounts = self._ledger_writer()
        account_id = accounts.pop(item[0], None)
        if account_id is None:  # placed elsewhere (or forgotten): alone
            return await self._run(_close_hold, *item)
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
            _with_audit, audit, _close_hold, hold_id, "settled", charge_micros, usage, None, now
        )

    async def release(
        self, hold_id: str, usage: UsageRecord | None, now: float, *, audit: AuditEntry | None = None
    ) -> Hold:
        if audit is None:
            return await self._close((hold_id, "released", 0, usage, None, now))
        self._forget(hold_id)
        return await self._run(_with_audit, audit, _close_hold, hold_id, "released", 0, usage, None, now)

    async def to_reconciling(self, hold_id: str, usage: UsageRecord | None, note: str, now: float) -> Hold:
        self._forget(hold_id)
        return await self._run(_close_hold, hold_id, "reconciling", 0, usage, note, now)

    async def holds(
        self, state: HoldState | None, account_id: str | None = None, limit: int = 100
    ) -> list[Hold]:
        return await self._read(_holds, state, account_id, limit)

    async def hold(self, hold_id: str) -> Hold | None:
        def get(db: Executor) -> Hold | None:
            row = db.fetchrow("SELECT * FROM holds WHERE id = $1", hold_id)
            return None if row is None else hold_row(row)

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
        return await self._run(_reconcile_orphans, owner, all_others, include_own, hold_ids)

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
        return await self._run(_heartbeat, owner, lease_s)

    async def totals(self) -> Totals:
        return await self._read(_totals)

    # -- keys -------------------------------------------------------------------------

    async def hold_counts(self) -> dict[str, tuple[int, int]]:
        """Open and reconciling holds: state -> (count, micro-USD) (for the metrics)."""
        return await self._read(_hold_counts)

    async def job_counts(self) -> dict[str, int]:
        """Jobs by status (for the metrics)."""
        return await self._read(_job_counts)

    async def create_key(self, key: ApiKey, key_hash: str, *, audit: AuditEntry | None = None) -> None:
        await self._run(_with_audit, audit, _create_key, key, key_hash)

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        return await self._read(_key_by_hash, key_hash)

    async def key(self, key_id: str) -> ApiKey | None:
        def get(db: Executor) -> ApiKey | None:
            row = db.fetchrow("SELECT * FROM api_keys WHERE id = $1", key_id)
            return None if row is None else _key(row)

        return await self._read(get)

    async def keys_page(self, account_id: str | None, *, limit: int, after: str | None) -> Sequence[ApiKey]:
        return await self._read(_keys_page, account_id, limit, after)

    async def revoke_key(self, key_id: str, now: float, *, audit: AuditEntry | None = None) -> ApiKey:
        return await self._run(_with_audit, audit, _revoke_key, key_id, now)

    async def rotate_key(
        self,
        key_id: str,
        new_hash: str,
        old_valid_until: float,
        now: float,
        *,
        audit: AuditEntry | None = None,
    ) -> ApiKey:
        return await self._run(_with_audit, audit, _rotate_key, key_id, new_hash, old_valid_until, now)

    async def touch_keys(self, used: Mapping[str, float]) -> None:
        if used:
            await self._run(_touch_keys, dict(used))

    # -- audit log --------------------------------------------------------------------

    async def add_audit(self, entry: AuditEntry) -> None:
        await self._run(_add_audit, entry)

    async def audit_page(
        self, *, action: str | None, target: str | None, limit: int, after: str | None
    ) -> Sequence[AuditEntry]:
        return await self._read(_audit_page, action, target, limit, after)

    # -- usage ------------------------------------------------------------------------

    async def put_usage(self, usage: UsageRecord) -> None:
        await self._run(_put_usage, usage)

    async def usage(self, account_id: str, request_id: str) -> UsageRecord | None:
        def get(db: Executor) -> UsageRecord | None:
            row = db.fetchrow(
                "SELECT * FROM usage WHERE request_id = $1 AND account_id = $2", request_id, account_id
            )
            return None if row is None else _usage(row)

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
        return await self._read(_usage_page, account_id, limit, before, since, until, after)

    # -- idempotency ------------------------------------------------------------------

    async def idem_begin(
        self, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
    ) -> IdemBegin:
        try:
            return await self._run(_idem_begin, account_id, key, body_hash, now, ttl_s)
        except IntegrityError:  # a concurrent first use of the same key
            return IdemBegin("in_flight")

    async def idem_complete(self, account_id: str, key: str, response: StoredResponse | None) -> None:
        await self._run(_idem_complete, account_id, key, response)

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
        return await self._read(_prunable, age_s, limit)

    async def prune(self, request_ids: Sequence[str], age_s: float) -> tuple[int, int]:
        return await self._run(_prune, list(request_ids), age_s)

    # -- jobs -------------------------------------------------------------------------

    async def put_job(self, job: Job) -> None:
        await self._run(_put_job, job)

    async def job(self, job_id: str, account_id: str | None = None) -> Job | None:
        def get(db: Executor) -> Job | None:
            if account_id is None:
                row = db.fetchrow("SELECT * FROM jobs WHERE id = $1", job_id)
            else:
                row = db.fetchrow("SELECT * FROM jobs WHERE id = $1 AND account_id = $2", job_id, account_id)
            return None if row is None else _job(row)

        return await self._read(get)

    async def jobs_page(self, account_id: str, *, limit: int, after: str | None) -> Sequence[Job]:
        return await self._read(_jobs_page, account_id, limit, after)

    async def update_job(self, job_id: str, **fields: Any) -> None:
        await self._run(_update_job, job_id, fields)

    async def fail_job_refunded(
        self, job_id: str, hold_id: str, fields: Mapping[str, Any], note: str, now: float
    ) -> int:
        return await self._run(_fail_job_refunded, job_id, hold_id, dict(fields), note, now)

    async def claim_jobs(self, owner: str, *, all_others: bool, include_own: bool = False) -> Sequence[Job]:
        return await self._run(_claim_jobs, owner, all_others, include_own)

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
            return [_job(r) for r in rows]

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
        await self._run(_put_response, record)

    async def response(self, response_id: str, account_id: str, now: float) -> ResponseRecord | None:
        def get(db: Executor) -> ResponseRecord | None:
            row = db.fetchrow(
                "SELECT * FROM responses WHERE id = $1 AND account_id = $2 AND expires_at > $3",
                response_id, account_id, now,
            )  # fmt: skip
            return None if row is None else _response(row)

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
