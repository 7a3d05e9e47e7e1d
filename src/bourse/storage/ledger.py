"""Holds and the ledger (tables ``holds``, ``instances``, the balance on ``accounts``
and the spend counts on ``api_keys`` and ``accounts``): a hold placed (counted on its
key's cap and its account's, the account debited), closed (settled, released,
reconciling: the unused amount given back), a settled charge reversed, and one
account's holds and closes group-committed in one transaction (:func:`ledger_batch`).
Every ledger transaction locks in one order: the hold rows, the capped keys' rows (in
key order), the account's row last (its cap counted there too).

A new hold's row is written once, in :data:`NEW_HOLD_ROW`: the single insert here,
the batch insert, and PostgreSQL's one-statement batch (:mod:`bourse.storage.postgres`)
are built from it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from bourse.ports.budgets import AccountBudgetExceeded, BudgetExceeded, KeyBudgetExceeded
from bourse.ports.stores import (
    ChargeAboveHold,
    Hold,
    HoldNotOpen,
    HoldState,
    InsufficientFunds,
    Totals,
    UnknownAccount,
    UsageRecord,
)
from bourse.storage.executor import Executor, IntegrityError, Row, values_list
from bourse.storage.usage import put_usage, put_usages, usage_row
from bourse.storage.usage_codec import encode

HOLD_PARAMS = ("id", "account_id", "request_id", "amount_micros", "owner", "product", "created_at", "key_id")
"""The :class:`Hold` fields a new hold's row is inserted with, in their parameters' order
(a single insert passes the spend periods it counted the hold in next: its key's, its account's)."""
NEW_HOLD_ROW = (
    ("id", "id"),
    ("account_id", "account_id"),
    ("request_id", "request_id"),
    ("amount_micros", "amount_micros"),
    ("charged_micros", "0"),
    ("state", "'open'"),
    ("owner", "owner"),
    ("product", "product"),
    ("note", "NULL"),
    ("created_at", "created_at"),
    ("updated_at", "created_at"),
    ("key_id", "key_id"),
    ("spend_period", "spend_period"),
    ("account_period", "account_period"),
)
"""Every column of ``holds``, and what a new hold's row has in it: a parameter (named by
its field in :data:`HOLD_PARAMS`, ``spend_period`` or ``account_period``) or an SQL value."""
HOLD_COLUMNS = ", ".join(column for column, _ in NEW_HOLD_ROW)
HOLD_ACCOUNT_PARAM = HOLD_PARAMS.index("account_id") + 1
"""The number of the account's parameter in a new hold's (``$n``, ``column<n>``)."""


def new_hold_values(param: Callable[[int], str], spend_period: str, account_period: str) -> str:
    """The values of a new hold's row as a SELECT list: the parameter ``n`` of
    :data:`HOLD_PARAMS` (from 1) spelled ``param(n)``, the spend periods ``spend_period``
    (its key's) and ``account_period``."""
    periods = {"spend_period": spend_period, "account_period": account_period}
    named = {name: param(n) for n, name in enumerate(HOLD_PARAMS, 1)} | periods
    return ", ".join(named.get(value, value) for _, value in NEW_HOLD_ROW)


def counted(hold: Hold) -> bool:
    """Counted on a spend cap (its key's or its account's): such a hold closes alone
    (:func:`close_hold`, which gives back to the caps), never in a batch of closes."""
    return hold.spend_period is not None or hold.account_period is not None


_hold_params = operator.attrgetter(*HOLD_PARAMS)
_ONE_HOLD = new_hold_values("${}".format, f"${len(HOLD_PARAMS) + 1}", f"${len(HOLD_PARAMS) + 2}")
_INSERT_HOLD = (
    f"INSERT INTO holds ({HOLD_COLUMNS}) SELECT {_ONE_HOLD} "
    f"WHERE EXISTS (SELECT 1 FROM accounts WHERE id = ${HOLD_ACCOUNT_PARAM}) ON CONFLICT DO NOTHING"
)
_VALUES_HOLD = new_hold_values("column{}".format, "NULL", "NULL")  # uncapped: no spend period
HOLDS_FROM_VALUES = f"INSERT INTO holds ({HOLD_COLUMNS}) SELECT {_VALUES_HOLD} FROM (VALUES {{values}}) AS v "
"""The head of a multi-row insert of uncapped holds (``{values}``: a :func:`values_list`
of :data:`HOLD_PARAMS`, aliased ``v``): its WHERE and what follows come next."""
_INSERT_HOLDS = HOLDS_FROM_VALUES + "WHERE true ON CONFLICT DO NOTHING RETURNING id"


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
        account_period=None if row["account_period"] is None else int(row["account_period"]),
    )


_SPEND_IN_PERIOD = "(CASE WHEN spend_period = $2 THEN spend_micros ELSE 0 END)"
_CAPPED: dict[str, type[BudgetExceeded]] = {"api_keys": KeyBudgetExceeded, "accounts": AccountBudgetExceeded}
"""The tables whose rows carry a spend cap (the same four columns), and the refusal of each."""


def _count_on_cap(db: Executor, table: str, row_id: str, period: int, amount: int) -> bool:
    """Count ``amount`` on the spend cap of the key or account (``table``) in ``period``,
    or KeyBudgetExceeded / AccountBudgetExceeded; False when it has no cap (nothing
    counted). One conditional UPDATE: concurrent holds on one row queue on it and each
    sees the others' amounts."""
    n = db.execute(
        f"UPDATE {table} SET spend_micros = {_SPEND_IN_PERIOD} + $3, spend_period = $2 "
        f"WHERE id = $1 AND spend_cap_micros IS NOT NULL AND {_SPEND_IN_PERIOD} + $3 <= spend_cap_micros",
        row_id, period, amount,
    )  # fmt: skip
    if n == 1:
        return True
    row = db.fetchrow(
        f"SELECT spend_cap_micros, spend_cap_period, spend_micros, spend_period FROM {table} WHERE id = $1",
        row_id,
    )
    if row is None or row["spend_cap_micros"] is None:
        return False
    spent = int(row["spend_micros"]) if int(row["spend_period"]) == period else 0
    raise _CAPPED[table](int(row["spend_cap_micros"]), spent, row["spend_cap_period"])


def _count_on_key(db: Executor, hold: Hold) -> int | None:
    """Count the hold on its key's cap (KeyBudgetExceeded); the period counted, or None
    (no cap: not counted). The key's row is locked (only a capped key's)."""
    period = hold.spend_period
    if (
        period is None
        or hold.key_id is None
        or not _count_on_cap(db, "api_keys", hold.key_id, period, hold.amount_micros)
    ):
        return None
    return period


def _new_hold(db: Executor, hold: Hold, key_period: int | None) -> None:
    """The hold's row, counted on its account's cap (its key's counted already, in
    ``key_period``): the account's row after the key's (only a capped account's is
    locked here), the hold row next; the caller debits the account last, so an
    uncapped account's row lock (every request of an account takes it) is held for one
    statement and the commit. Raises without an SQL error (the transaction stays
    usable for a batch's other holds), having undone its cap counts."""
    amount = hold.amount_micros
    account_period = hold.account_period
    try:
        if account_period is not None and not _count_on_cap(
            db, "accounts", hold.account_id, account_period, amount
        ):
            account_period = None
    except AccountBudgetExceeded:
        _uncount(db, "api_keys", hold.key_id, key_period, amount)
        raise
    n = db.execute(_INSERT_HOLD, *_hold_params(hold), key_period, account_period)
    if n == 1:
        return
    _uncount(db, "api_keys", hold.key_id, key_period, amount)
    _uncount(db, "accounts", hold.account_id, account_period, amount)
    if db.fetchrow("SELECT 1 AS x FROM accounts WHERE id = $1", hold.account_id) is None:
        raise UnknownAccount(hold.account_id)
    raise IntegrityError(f"hold {hold.id} exists")


def _uncount(db: Executor, table: str, row_id: Any, period: Any, amount: int) -> None:
    """Give back ``amount`` to the cap of the key or account (if still in ``period``;
    nothing when the period or the id is None: not counted)."""
    if period is None or row_id is None or not amount:
        return
    db.execute(
        f"UPDATE {table} SET spend_micros = CASE WHEN spend_micros > $3 THEN spend_micros - $3 ELSE 0 END "
        "WHERE id = $1 AND spend_period = $2",
        row_id, period, amount,
    )  # fmt: skip


_MOVE = (
    "UPDATE accounts SET balance_micros = balance_micros + $2, pending_micros = pending_micros + $3, "
    "posted_micros = posted_micros + $4 WHERE id = $1 AND balance_micros + $2 >= 0"
)


def move(db: Executor, account_id: str, balance: int, pending: int, posted: int) -> bool:
    """Change the account's balance and its pending and posted totals by these amounts in
    one statement (so that credited = balance + pending + posted holds after each);
    False when the balance cannot give ``-balance``. Every ledger write to an
    account's money is one of these."""
    return db.execute(_MOVE, account_id, balance, pending, posted) == 1


def _debit(db: Executor, account_id: str, amount: int) -> bool:
    """Move ``amount`` from the account's balance to pending; False when it cannot cover it."""
    return move(db, account_id, -amount, amount, 0)


def place_hold(db: Executor, hold: Hold) -> None:
    _new_hold(db, hold, _count_on_key(db, hold))
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


def hold_row_args(holds: list[Hold]) -> list[Any]:
    """The values of :data:`HOLD_PARAMS` of each new hold, flat, for one multi-row INSERT."""
    args: list[Any] = []
    for h in holds:
        args += _hold_params(h)
    return args


def _insert_holds(db: Executor, holds: list[Hold]) -> set[str]:
    """Insert uncapped holds of existing accounts in one statement; the ids inserted
    (a hold whose id exists is left out)."""
    values = values_list(len(holds), len(HOLD_PARAMS))
    rows = db.fetch(_INSERT_HOLDS.format(values=values), *hold_row_args(holds))
    return {r["id"] for r in rows}


def _new_capped(db: Executor, holds: list[Hold], out: list[Exception | None]) -> None:
    """The rows of a batch's holds counted on a cap and not refused yet (``out[i]`` None):
    each counted on its key in key order, then on its account and inserted; a refusal
    into ``out``. Every key's count comes before any account's (the lock order): a hold
    the account's cap then refuses gives its key count back, and may have made another
    hold of its key in the batch refused (never one more taken than the cap)."""
    capped = [i for i, h in enumerate(holds) if out[i] is None and counted(h)]
    key_periods: dict[int, int | None] = {}
    for i in sorted(capped, key=lambda i: holds[i].key_id or ""):
        try:
            key_periods[i] = _count_on_key(db, holds[i])
        except KeyBudgetExceeded as exc:
            out[i] = exc
    for i in capped:
        if i in key_periods:
            try:
                _new_hold(db, holds[i], key_periods[i])
            except (BudgetExceeded, UnknownAccount, IntegrityError) as exc:
                out[i] = exc


def _new_holds(db: Executor, holds: list[Hold]) -> list[Exception | None]:
    """The rows of a batch's holds (the capped ones first, :func:`_new_capped`; the
    others in one statement), each hold's refusal or None; the caller debits the accounts."""
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
    _new_capped(db, holds, out)
    plain = [i for i, h in enumerate(holds) if out[i] is None and not counted(h)]
    inserted = _insert_holds(db, [holds[i] for i in plain]) if plain else set()
    for i in plain:
        if holds[i].id not in inserted:
            out[i] = IntegrityError(f"hold {holds[i].id} exists")
    return out


Closing = tuple[str, HoldState, int, UsageRecord | None, str | None, float]
"""One settle or release: ``(hold_id, state, charge_micros, usage, note, now)``."""


def closing_charge(item: Closing) -> int:
    """What a close charges: a settlement its charge (never below 0), a release nothing."""
    return max(0, item[2]) if item[1] == "settled" else 0


CLOSABLE = "state IN ('open', 'reconciling')"
"""The holds a settle or release closes. Its charge must be within the hold as well:
the store refuses a charge above it (:func:`refusal`), never clamps it."""


def refusal(db: Executor, hold_id: str, charge_micros: int | None) -> Exception:
    """Why a close of ``hold_id`` found no row to change, read in its transaction: the
    hold's state (:class:`HoldNotOpen`; None when there is no such hold), or, for a
    hold still closable, the charge above it (:class:`ChargeAboveHold`).
    ``charge_micros`` None: a move to reconciling, which takes an open hold only."""
    row = db.fetchrow("SELECT state, amount_micros FROM holds WHERE id = $1", hold_id)
    if row is None:
        return HoldNotOpen(hold_id, None)
    amount = int(row["amount_micros"])
    if charge_micros is not None and row["state"] in ("open", "reconciling") and charge_micros > amount:
        return ChargeAboveHold(hold_id, charge_micros, amount)
    return HoldNotOpen(hold_id, row["state"])  # closable still: a batch's earlier close of it was refused


def _close_row(db: Executor, item: Closing) -> Row | None:
    """Close the hold's row (settled or released) and write its usage record; the row,
    or None when the hold is not closable or the charge is above it. The caller
    returns the unused amount."""
    hold_id, state, _, usage, note, now = item
    row = db.fetchrow(
        "UPDATE holds SET state = $2, charged_micros = $3, note = COALESCE($4, note), updated_at = $5 "
        f"WHERE id = $1 AND {CLOSABLE} AND $3 <= amount_micros RETURNING *",
        hold_id, state, closing_charge(item), note, now,
    )  # fmt: skip
    if row is not None and usage is not None:
        put_usage(db, usage)
    return row


def _unused(row: Row) -> int:
    return int(row["amount_micros"]) - int(row["charged_micros"])


def _refund_cap(db: Executor, row: Row, amount: int | None = None) -> None:
    """The key's cap and the account's get back what the hold did not charge, or
    ``amount`` (each if still in the period the hold was counted in)."""
    back = _unused(row) if amount is None else amount
    _uncount(db, "api_keys", row["key_id"], row["spend_period"], back)
    _uncount(db, "accounts", row["account_id"], row["account_period"], back)


def _closed(db: Executor, row: Row) -> None:
    """A closed hold on its account: its amount leaves pending, its charge is posted
    and the rest is back in the balance. The account last: its row lock is held for
    one statement and the commit."""
    amount, charged = int(row["amount_micros"]), int(row["charged_micros"])
    move(db, row["account_id"], amount - charged, -amount, charged)


def debit(db: Executor, hold: Hold, usage: UsageRecord, now: float) -> Hold:
    """An operator's debit of ``hold.amount_micros``: a hold placed and settled for its
    whole amount in one transaction, with its usage record (a charge like any other: the
    books' identity, the usage export and retention need nothing new).
    InsufficientFunds when the balance cannot cover it, UnknownAccount for no account."""
    place_hold(db, hold)
    return close_hold(db, hold.id, "settled", hold.amount_micros, usage, None, now)


def close_hold(
    db: Executor,
    hold_id: str,
    state: HoldState,
    charge_micros: int,
    usage: UsageRecord | None,
    note: str | None,
    now: float,
) -> Hold:
    item: Closing = (hold_id, state, charge_micros, usage, note, now)
    if state == "reconciling":
        row = db.fetchrow(
            "UPDATE holds SET state = 'reconciling', note = $2, updated_at = $3 WHERE id = $1 AND state = 'open' "
            "RETURNING *",
            hold_id, note, now,
        )  # fmt: skip
        if row is not None and usage is not None:
            put_usage(db, usage)
    else:
        row = _close_row(db, item)
        if row is not None:
            _refund_cap(db, row)
            _closed(db, row)
    if row is None:
        raise refusal(db, hold_id, None if state == "reconciling" else closing_charge(item))
    return hold_row(row)


CLOSE_FROM_VALUES = (
    "UPDATE holds SET state = v.column2, charged_micros = v.column3, note = COALESCE(v.column4, note), "
    "updated_at = v.column5 FROM (VALUES {values}) AS v "
    f"WHERE holds.id = v.column1 AND holds.{CLOSABLE} AND v.column3 <= holds.amount_micros"
)
"""Closes of several holds in one statement (``{values}``: a :func:`values_list` of
``(hold_id, state, charge, note, now)``, aliased ``v``); its RETURNING comes next."""


def _close_rows(db: Executor, items: list[Closing]) -> list[Row]:
    """Close the holds' rows (settled or released) in one statement, then write their
    usage records in one more; the rows closed (a hold not open is left out)."""
    args: list[Any] = []
    for item in items:
        args += (item[0], item[1], closing_charge(item), item[4], item[5])
    values = values_list(len(items), 5, ("", "", "BIGINT", "TEXT", "DOUBLE PRECISION"))
    rows = db.fetch(
        f"{CLOSE_FROM_VALUES.format(values=values)} RETURNING {HOLD_COLUMNS}",
        *args,
    )
    closed = {r["id"] for r in rows}
    usages = {u.request_id: u for hold_id, _, _, u, _, _ in items if u is not None and hold_id in closed}
    if usages:
        put_usages(db, list(usages.values()))
    return rows


LedgerWrite = Hold | Closing
"""A write of the ledger's group commit: a hold to place, or a close."""


def ledger_batch(db: Executor, items: list[LedgerWrite]) -> list[Hold | Exception | None]:
    """Holds and closes of one account in one transaction, in the order every ledger
    transaction locks: the closed hold rows, the capped holds' key rows (in key
    order), then each account's row once, for the net of its debits and refunds (and of
    its pending and posted totals)
    (:class:`BatchShort` when that is more than its balance). A close gives its hold,
    a hold None, a refused write its exception."""
    out: list[Hold | Exception | None] = [None] * len(items)
    delta: dict[str, list[int]] = {}  # per account: balance, pending, posted
    closes: list[tuple[int, Closing]] = []
    again: list[tuple[int, Closing]] = []
    closing: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, Hold):
            continue
        if item[0] in closing:  # a second close of one hold in the batch finds it closed
            again.append((i, item))
            continue
        closing.add(item[0])
        closes.append((i, item))
    rows = {r["id"]: r for r in _close_rows(db, [c for _, c in closes])} if closes else {}
    for i, close in closes:
        row = rows.get(close[0])
        out[i] = refusal(db, close[0], closing_charge(close)) if row is None else hold_row(row)
        if row is not None:
            amount, charged = int(row["amount_micros"]), int(row["charged_micros"])
            d = delta.setdefault(row["account_id"], [0, 0, 0])
            d[0] += amount - charged
            d[1] -= amount
            d[2] += charged
    for i, close in again:
        out[i] = refusal(db, close[0], closing_charge(close))
    holds = [(i, item) for i, item in enumerate(items) if isinstance(item, Hold)]
    refused = _new_holds(db, [h for _, h in holds]) if holds else []
    for (i, hold), exc in zip(holds, refused, strict=True):
        out[i] = exc
        if exc is None:
            d = delta.setdefault(hold.account_id, [0, 0, 0])
            d[0] -= hold.amount_micros
            d[1] += hold.amount_micros
    for account_id in sorted(delta):
        if any(delta[account_id]) and not move(db, account_id, *delta[account_id]):
            raise BatchShort(account_id)
    return out


CLOSED = "state IN ('settled', 'released')"
"""The predicate of the closed holds' partial indexes (migration 19), written out in a
query that is to use one (SQLite's planner matches it term for term)."""
_ONE_STATE = {"open": "state = 'open'", "reconciling": "state = 'reconciling'",
              "settled": f"{CLOSED} AND state = 'settled'", "released": f"{CLOSED} AND state = 'released'"}  # fmt: skip


def hold_list(db: Executor, state: HoldState | None, account_id: str | None, limit: int) -> list[Hold]:
    """Holds newest first, of one state or all, of one account or all. Each state is
    read from its partial index (the closed holds of an account from their index by
    account and time, the open and reconciling ones, few, from theirs), and the parts
    merged: no index has every hold of an account (migration 19)."""
    n = max(1, min(limit, 1000))
    if state is None and account_id is None:
        return [hold_row(r) for r in db.fetch(f"SELECT * FROM holds ORDER BY created_at DESC LIMIT {n}")]
    wheres = (
        [_ONE_STATE[state]] if state is not None else [_ONE_STATE["open"], _ONE_STATE["reconciling"], CLOSED]
    )
    of = "" if account_id is None else " AND account_id = $1"
    sql = " UNION ALL ".join(
        f"SELECT * FROM (SELECT * FROM holds WHERE {w}{of} ORDER BY created_at DESC LIMIT {n}) AS s{i}"
        for i, w in enumerate(wheres)
    )
    args = () if account_id is None else (account_id,)
    return [hold_row(r) for r in db.fetch(f"{sql} ORDER BY created_at DESC LIMIT {n}", *args)]


RECONCILE_CHUNK = 500
"""Hold ids one reconciling statement names (SQLite's parameter limit is far above)."""


def reconcile_orphans(
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


def heartbeat(db: Executor, owner: str, lease_s: float) -> float:
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


def totals(db: Executor) -> Totals:
    row = db.fetchrow(
        "SELECT "
        "COALESCE((SELECT SUM(amount_micros) FROM credits), 0) AS c, "
        "COALESCE((SELECT SUM(balance_micros) FROM accounts), 0) AS b, "
        "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE state = 'open'), 0) "
        "+ COALESCE((SELECT SUM(amount_micros) FROM holds WHERE state = 'reconciling'), 0) AS h, "
        "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE state = 'settled'), 0) "
        "+ COALESCE((SELECT SUM(charged_micros) FROM pruned), 0) AS r"
    )
    assert row is not None
    return Totals(int(row["c"]), int(row["b"]), int(row["h"]), int(row["r"]))


def hold_counts(db: Executor) -> dict[str, tuple[int, int]]:
    # one query a state: each reads its partial index (holds_open, holds_reconciling)
    rows = db.fetch(
        "SELECT state, COUNT(*) AS n, COALESCE(SUM(amount_micros), 0) AS m FROM holds WHERE state = 'open' "
        "GROUP BY state UNION ALL "
        "SELECT state, COUNT(*) AS n, COALESCE(SUM(amount_micros), 0) AS m FROM holds WHERE state = 'reconciling' "
        "GROUP BY state"
    )
    return {str(r["state"]): (int(r["n"]), int(r["m"])) for r in rows}


def reverse_charge(db: Executor, hold_id: str, note: str, now: float) -> int:
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
    usage = db.fetchrow("SELECT * FROM usage WHERE request_id = $1", row["request_id"])
    if usage is not None:
        record = dict(usage_row(usage).record)
        record["outcome"] = "error"
        record["usage"] = {**(record.get("usage") or {}), "cost": 0.0, "cost_micros": 0}
        record["receipt"] = {**(record.get("receipt") or {}), "outcome": "error", "cost_micros": 0}
        record["reversed_micros"] = charged
        db.execute(
            "UPDATE usage SET outcome = 'error', cost_micros = 0, record = $2 WHERE request_id = $1",
            row["request_id"], encode(record, usage["request_id"], usage["product"], float(usage["created_at"])),
        )  # fmt: skip
    _refund_cap(db, row, charged)
    if charged:
        move(db, row["account_id"], charged, 0, -charged)
    return charged
