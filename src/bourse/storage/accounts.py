"""Accounts and their API keys (tables ``accounts``, ``credits``, ``api_keys``,
``api_key_grace``): an account's row with its totals, credits, and a key's life
(created, found by its hash, rotated with a grace period for the old one, revoked).
A key's spend cap and an account's are counted by the ledger's transactions
(:mod:`bourse.storage.ledger`); here they are set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from bourse.domain.periods import CapPeriod
from bourse.ports.stores import (
    Account,
    AccountClosed,
    AccountExists,
    AccountStatus,
    ApiKey,
    KeyChanged,
    KeyRevoked,
    UnknownAccount,
    UnknownKey,
    new_webhook_secret,
)
from bourse.storage.executor import Executor, Row, new_id

_ACCOUNTS = (
    "SELECT a.id, a.balance_micros, a.created_at, a.pending_micros, a.posted_micros, a.credited_micros, "
    "a.status, a.status_reason, a.spend_cap_micros, a.spend_cap_period, a.spend_micros, a.spend_period, "
    "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE account_id = a.id AND state = 'reconciling'), 0) AS rec_m "
    "FROM accounts a"
)
"""An account with its totals: the row's own columns (kept by the ledger's
transactions), and of its pending amount the part reconciling (few holds, found by
the ``(account_id, state)`` index)."""
_ACCOUNT = _ACCOUNTS + " WHERE a.id = $1"


def account(db: Executor, account_id: str) -> Account | None:
    row = db.fetchrow(_ACCOUNT, account_id)
    return None if row is None else _account_row(row)


def _account_row(row: Row) -> Account:
    return Account(
        id=row["id"],
        balance_micros=int(row["balance_micros"]),
        open_holds_micros=int(row["pending_micros"]) - int(row["rec_m"]),
        reconciling_micros=int(row["rec_m"]),
        spent_micros=int(row["posted_micros"]),
        credited_micros=int(row["credited_micros"]),
        created_at=float(row["created_at"]),
        status=row["status"],
        status_reason=row["status_reason"],
        spend_cap_micros=None if row["spend_cap_micros"] is None else int(row["spend_cap_micros"]),
        spend_cap_period=row["spend_cap_period"],
        spend_micros=int(row["spend_micros"]),
        spend_period=int(row["spend_period"]),
    )


def accounts_page(db: Executor, limit: int, after: str | None) -> list[Account]:
    where, args = ("", ()) if after is None else (" WHERE a.id > $1", (after,))
    rows = db.fetch(f"{_ACCOUNTS}{where} ORDER BY a.id LIMIT {max(1, min(limit, 1000))}", *args)
    return [_account_row(r) for r in rows]


def set_account_status(db: Executor, account_id: str, status: AccountStatus, reason: str | None) -> Account:
    """Set the account's status and its reason; a closed account keeps its own."""
    n = db.execute(
        "UPDATE accounts SET status = $2, status_reason = $3 WHERE id = $1 AND status <> 'closed'",
        account_id, status, reason,
    )  # fmt: skip
    acc = account(db, account_id)
    if acc is None:
        raise UnknownAccount(account_id)
    if n != 1:
        raise AccountClosed(account_id)
    return acc


def close_account(db: Executor, account_id: str, reason: str | None, now: float) -> tuple[Account, int]:
    """Close the account (for good) and revoke its keys that are not revoked yet."""
    acc = set_account_status(db, account_id, "closed", reason)
    revoked = db.execute(
        "UPDATE api_keys SET revoked_at = $2 WHERE account_id = $1 AND revoked_at IS NULL", account_id, now
    )
    return acc, revoked


def create_account(
    db: Executor,
    account_id: str,
    credit_micros: int,
    now: float,
    seal: Callable[[Executor, str], str],
    cap: tuple[int, CapPeriod] | None = None,
) -> Account:
    """A new account with its opening credit and, if given, its spend cap (micro-USD, period)."""
    if db.fetchrow("SELECT id FROM accounts WHERE id = $1", account_id) is not None:
        raise AccountExists(account_id)
    db.execute(
        "INSERT INTO accounts (id, balance_micros, credited_micros, created_at, "
        "spend_cap_micros, spend_cap_period) VALUES ($1, $2, $2, $3, $4, $5)",
        account_id, credit_micros, now, None if cap is None else cap[0], None if cap is None else cap[1],
    )  # fmt: skip
    db.execute(
        "INSERT INTO webhook_secrets (account_id, secret) VALUES ($1, $2)", account_id,
        seal(db, new_webhook_secret()),
    )  # fmt: skip
    if credit_micros:
        db.execute(
            "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ($1, $2, $3, $4, $5)",
            new_id("cr_"), account_id, credit_micros, "opening credit", now,
        )  # fmt: skip
    acc = account(db, account_id)
    assert acc is not None
    return acc


def credit(db: Executor, account_id: str, amount_micros: int, now: float, memo: str) -> Account:
    if (
        db.execute(
            "UPDATE accounts SET balance_micros = balance_micros + $2, credited_micros = credited_micros + $2 "
            "WHERE id = $1",
            account_id,
            amount_micros,
        )
        != 1
    ):
        raise UnknownAccount(account_id)
    db.execute(
        "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ($1, $2, $3, $4, $5)",
        new_id("cr_"), account_id, amount_micros, memo, now,
    )  # fmt: skip
    acc = account(db, account_id)
    assert acc is not None
    return acc


def create_key(db: Executor, key: ApiKey, key_hash: str) -> None:
    row = db.fetchrow("SELECT status FROM accounts WHERE id = $1", key.account_id)
    if row is None:
        raise UnknownAccount(key.account_id)
    if row["status"] == "closed":
        raise AccountClosed(key.account_id)
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


def key_row(
    row: Row,
    grace_until: float | None = None,
    account_status: AccountStatus = "active",
    account_cap_period: CapPeriod | None = None,
) -> ApiKey:
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
        account_status=account_status,
        account_cap_period=account_cap_period,
    )


_ACCOUNT_STATUS = (
    "(SELECT a.status FROM accounts a WHERE a.id = k.account_id) AS account_status, "
    "(SELECT a.spend_cap_period FROM accounts a WHERE a.id = k.account_id) AS account_cap_period"
)
"""What a key is read with of its account: its status, and its spend cap's period (a
hold of the key is counted on the account's cap when it has one)."""
_KEY_BY_HASH = (
    f"SELECT k.*, NULL AS grace_until, {_ACCOUNT_STATUS} FROM api_keys k WHERE k.key_hash = $1 "
    f"UNION ALL SELECT k.*, g.valid_until AS grace_until, {_ACCOUNT_STATUS} FROM api_key_grace g "
    "JOIN api_keys k ON k.id = g.key_id WHERE g.key_hash = $1"
)
KEY_BY_ID = f"SELECT k.*, {_ACCOUNT_STATUS} FROM api_keys k WHERE k.id = $1"


def key_by_hash(db: Executor, key_hash: str) -> ApiKey | None:
    row = db.fetchrow(_KEY_BY_HASH, key_hash)
    if row is None:
        return None
    return key_row(
        row, _opt_float(row["grace_until"]), row["account_status"] or "active", row["account_cap_period"]
    )


def keys_page(db: Executor, account_id: str | None, limit: int, after: str | None) -> list[ApiKey]:
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
    return [key_row(r) for r in db.fetch(sql, *args)]


def revoke_key(db: Executor, key_id: str, now: float) -> ApiKey:
    row = db.fetchrow(
        "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1 RETURNING *", key_id, now
    )
    if row is None:
        raise UnknownKey(key_id)
    return key_row(row)


KEY_EDITABLE = (
    "products",
    "rpm",
    "tpm",
    "max_streams",
    "name",
    "expires_at",
    "spend_cap_micros",
    "spend_cap_period",
)
"""The columns of ``api_keys`` an edit may set."""


def update_key(db: Executor, key_id: str, changes: Mapping[str, Any]) -> ApiKey:
    """Set the given columns (of :data:`KEY_EDITABLE`) of a key not revoked. The spend
    counter (``spend_micros``, ``spend_period``) is left as it is: it counts the holds
    of its own period number, so a new cap period starts its count at zero and the
    holds of the old one still give back what they took. UnknownKey, KeyRevoked."""
    cols = [c for c in KEY_EDITABLE if c in changes]
    values = [orjson.dumps(list(v)).decode() if c == "products" and v is not None else changes[c]
              for c, v in ((c, changes[c]) for c in cols)]  # fmt: skip
    sets = ", ".join(f"{c} = ${n}" for n, c in enumerate(cols, 2))
    if changes.get("spend_cap_micros") is not None and "spend_cap_period" not in changes:
        sets += ", spend_cap_period = COALESCE(spend_cap_period, 'total')"  # a first cap: total
    row = db.fetchrow(
        f"UPDATE api_keys SET {sets} WHERE id = $1 AND revoked_at IS NULL RETURNING *", key_id, *values
    )
    if row is not None:
        return key_row(row)
    if db.fetchrow("SELECT id FROM api_keys WHERE id = $1", key_id) is None:
        raise UnknownKey(key_id)
    raise KeyRevoked(key_id)


ACCOUNT_EDITABLE = ("spend_cap_micros", "spend_cap_period")
"""The columns of ``accounts`` an edit may set."""


def update_account(db: Executor, account_id: str, changes: Mapping[str, Any]) -> Account:
    """Set the given columns (of :data:`ACCOUNT_EDITABLE`) of an account not closed; its
    spend counter stays as it is (as :func:`update_key`'s). UnknownAccount, AccountClosed."""
    cols = [c for c in ACCOUNT_EDITABLE if c in changes]
    sets = ", ".join(f"{c} = ${n}" for n, c in enumerate(cols, 2))
    if changes.get("spend_cap_micros") is not None and "spend_cap_period" not in changes:
        sets += ", spend_cap_period = COALESCE(spend_cap_period, 'total')"  # a first cap: total
    n = db.execute(
        f"UPDATE accounts SET {sets} WHERE id = $1 AND status <> 'closed'",
        account_id,
        *(changes[c] for c in cols),
    )
    acc = account(db, account_id)
    if acc is None:
        raise UnknownAccount(account_id)
    if n != 1:
        raise AccountClosed(account_id)
    return acc


def rotate_key(db: Executor, key_id: str, new_hash: str, old_valid_until: float, now: float) -> ApiKey:
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
    return key_row(updated)


def touch_keys(db: Executor, used: Mapping[str, float]) -> None:
    for key_id, at in sorted(used.items()):  # one order, so two replicas never deadlock
        db.execute(
            "UPDATE api_keys SET last_used_at = $2 WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < $2)",
            key_id, at,
        )  # fmt: skip
