"""The stores' logic, written once over a minimal async SQL executor.

:class:`SqlStore` implements every storage port (ledger, keys, usage, idempotency)
with SQL that runs unchanged on SQLite and PostgreSQL (numbered ``$n`` parameters;
the SQLite executor rewrites them to ``?n``). Adapters supply :class:`Executor`
and transactions; each ledger change is one transaction.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import orjson

from bourse.ports.stores import (
    Account,
    AccountExists,
    ApiKey,
    Hold,
    HoldNotOpen,
    HoldState,
    IdemBegin,
    InsufficientFunds,
    StoredResponse,
    Totals,
    UnknownAccount,
    UsageRecord,
)
from bourse.storage.schema import MIGRATIONS

Row = Mapping[str, Any]


class Executor(Protocol):
    async def fetch(self, sql: str, *args: Any) -> list[Row]: ...
    async def fetchrow(self, sql: str, *args: Any) -> Row | None: ...
    async def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; the number of rows it changed."""
        ...


class IntegrityError(Exception):
    """A uniqueness or check constraint refused a write (adapter-neutral)."""


def _new_id(prefix: str) -> str:
    return prefix + os.urandom(10).hex()


def _hold(row: Row) -> Hold:
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


_USAGE_INSERT = (
    "INSERT INTO usage (request_id, account_id, product, created_at, outcome, cost_micros, record) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7)"
)


class SqlStore:
    """All storage ports over one database. Subclasses provide connections."""

    single_node: bool = True
    """True when one process owns the database (SQLite): at start-up every open hold
    of another owner is an orphan. False for shared databases (lease-based)."""

    # -- adapter hooks --------------------------------------------------------------

    def tx(self) -> AbstractAsyncContextManager[Executor]:
        """A transaction (serializable enough for the statements below)."""
        raise NotImplementedError

    def read(self) -> AbstractAsyncContextManager[Executor]:
        """A connection for reads outside a transaction."""
        raise NotImplementedError

    async def open(self) -> None:
        """Connect and migrate."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def _integrity(self, exc: BaseException) -> bool:
        return False

    # -- migrations -----------------------------------------------------------------

    async def migrate(self) -> int:
        """Apply pending migrations; returns the schema version."""
        async with self.tx() as db:
            await db.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
            )
        version = 0
        async with self.read() as db:
            row = await db.fetchrow("SELECT MAX(version) AS v FROM schema_migrations")
            if row is not None and row["v"] is not None:
                version = int(row["v"])
        for v, sql in MIGRATIONS:
            if v <= version:
                continue
            async with self.tx() as db:
                await self._script(db, sql)
                await db.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2)", v, 0.0
                )
            version = v
        return version

    async def _script(self, db: Executor, sql: str) -> None:
        for statement in sql.split(";"):
            if statement.strip():
                await db.execute(statement)

    # -- ledger ---------------------------------------------------------------------

    async def create_account(self, account_id: str, credit_micros: int, now: float) -> Account:
        if credit_micros < 0:
            raise ValueError("credit cannot be negative")
        try:
            async with self.tx() as db:
                if await db.fetchrow("SELECT id FROM accounts WHERE id = $1", account_id) is not None:
                    raise AccountExists(account_id)
                await db.execute(
                    "INSERT INTO accounts (id, balance_micros, created_at, webhook_secret) VALUES ($1, $2, $3, $4)",
                    account_id, credit_micros, now, os.urandom(24).hex(),
                )  # fmt: skip
                if credit_micros:
                    await db.execute(
                        "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ($1, $2, $3, $4, $5)",
                        _new_id("cr_"), account_id, credit_micros, "opening credit", now,
                    )  # fmt: skip
        except IntegrityError:
            raise AccountExists(account_id) from None
        acc = await self.account(account_id)
        assert acc is not None
        return acc

    async def credit(self, account_id: str, amount_micros: int, now: float, memo: str = "") -> Account:
        if amount_micros <= 0:
            raise ValueError("a credit must be positive")
        async with self.tx() as db:
            n = await db.execute(
                "UPDATE accounts SET balance_micros = balance_micros + $2 WHERE id = $1",
                account_id,
                amount_micros,
            )
            if n != 1:
                raise UnknownAccount(account_id)
            await db.execute(
                "INSERT INTO credits (id, account_id, amount_micros, memo, created_at) VALUES ($1, $2, $3, $4, $5)",
                _new_id("cr_"), account_id, amount_micros, memo, now,
            )  # fmt: skip
        acc = await self.account(account_id)
        assert acc is not None
        return acc

    async def account(self, account_id: str) -> Account | None:
        async with self.read() as db:
            row = await db.fetchrow(
                "SELECT a.id, a.balance_micros, a.created_at, "
                "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE account_id = a.id AND state = 'open'), 0) AS open_m, "
                "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE account_id = a.id AND state = 'reconciling'), 0) AS rec_m, "
                "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE account_id = a.id AND state = 'settled'), 0) AS spent_m, "
                "COALESCE((SELECT SUM(amount_micros) FROM credits WHERE account_id = a.id), 0) AS credit_m "
                "FROM accounts a WHERE a.id = $1",
                account_id,
            )
        if row is None:
            return None
        return Account(
            id=row["id"],
            balance_micros=int(row["balance_micros"]),
            open_holds_micros=int(row["open_m"]),
            reconciling_micros=int(row["rec_m"]),
            spent_micros=int(row["spent_m"]),
            credited_micros=int(row["credit_m"]),
            created_at=float(row["created_at"]),
        )

    async def webhook_secret(self, account_id: str) -> str | None:
        async with self.read() as db:
            row = await db.fetchrow("SELECT webhook_secret FROM accounts WHERE id = $1", account_id)
        return None if row is None else row["webhook_secret"]

    async def place_hold(self, hold: Hold) -> None:
        if hold.amount_micros < 0:
            raise ValueError("a hold cannot be negative")
        async with self.tx() as db:
            n = await db.execute(
                "UPDATE accounts SET balance_micros = balance_micros - $2 WHERE id = $1 AND balance_micros >= $2",
                hold.account_id, hold.amount_micros,
            )  # fmt: skip
            if n != 1:
                row = await db.fetchrow("SELECT balance_micros FROM accounts WHERE id = $1", hold.account_id)
                if row is None:
                    raise UnknownAccount(hold.account_id)
                raise InsufficientFunds(int(row["balance_micros"]))
            await db.execute(
                "INSERT INTO holds (id, account_id, request_id, amount_micros, charged_micros, state, owner, product, "
                "note, created_at, updated_at) VALUES ($1, $2, $3, $4, 0, 'open', $5, $6, NULL, $7, $7)",
                hold.id, hold.account_id, hold.request_id, hold.amount_micros, hold.owner, hold.product, hold.created_at,
            )  # fmt: skip

    async def _close_hold(
        self,
        hold_id: str,
        state: HoldState,
        charge_micros: int,
        usage: UsageRecord | None,
        note: str | None,
        now: float,
    ) -> Hold:
        async with self.tx() as db:
            row = await db.fetchrow(
                "SELECT * FROM holds WHERE id = $1 AND state IN ('open', 'reconciling')", hold_id
            )
            if row is None:
                raise HoldNotOpen(hold_id)
            amount = int(row["amount_micros"])
            charged = max(0, min(charge_micros, amount)) if state == "settled" else 0
            if state == "reconciling":
                n = await db.execute(
                    "UPDATE holds SET state = 'reconciling', note = $2, updated_at = $3 WHERE id = $1 AND state = 'open'",
                    hold_id, note, now,
                )  # fmt: skip
            else:
                n = await db.execute(
                    "UPDATE holds SET state = $2, charged_micros = $3, note = COALESCE($4, note), updated_at = $5 "
                    "WHERE id = $1 AND state IN ('open', 'reconciling')",
                    hold_id, state, charged, note, now,
                )  # fmt: skip
                if n == 1:
                    await db.execute(
                        "UPDATE accounts SET balance_micros = balance_micros + $2 WHERE id = $1",
                        row["account_id"], amount - charged,
                    )  # fmt: skip
            if n != 1:
                raise HoldNotOpen(hold_id)
            if usage is not None:
                await self._upsert_usage(db, usage)
            out = await db.fetchrow("SELECT * FROM holds WHERE id = $1", hold_id)
        assert out is not None
        return _hold(out)

    async def settle(self, hold_id: str, charge_micros: int, usage: UsageRecord | None, now: float) -> Hold:
        return await self._close_hold(hold_id, "settled", charge_micros, usage, None, now)

    async def release(self, hold_id: str, usage: UsageRecord | None, now: float) -> Hold:
        return await self._close_hold(hold_id, "released", 0, usage, None, now)

    async def to_reconciling(self, hold_id: str, usage: UsageRecord | None, note: str, now: float) -> Hold:
        return await self._close_hold(hold_id, "reconciling", 0, usage, note, now)

    async def holds(
        self, state: HoldState | None, account_id: str | None = None, limit: int = 100
    ) -> list[Hold]:
        limit = max(1, min(limit, 1000))
        where: list[str] = []
        args: list[Any] = []
        if state is not None:
            args.append(state)
            where.append(f"state = ${len(args)}")
        if account_id is not None:
            args.append(account_id)
            where.append(f"account_id = ${len(args)}")
        sql = "SELECT * FROM holds" + (" WHERE " + " AND ".join(where) if where else "")
        sql += f" ORDER BY created_at DESC LIMIT {limit}"
        async with self.read() as db:
            rows = await db.fetch(sql, *args)
        return [_hold(r) for r in rows]

    async def hold(self, hold_id: str) -> Hold | None:
        async with self.read() as db:
            row = await db.fetchrow("SELECT * FROM holds WHERE id = $1", hold_id)
        return None if row is None else _hold(row)

    async def reconcile_orphans(self, owner: str, now: float, *, all_others: bool) -> int:
        async with self.tx() as db:
            if all_others:
                return await db.execute(
                    "UPDATE holds SET state = 'reconciling', note = 'open when its gateway stopped', updated_at = $2 "
                    "WHERE state = 'open' AND owner <> $1",
                    owner, now,
                )  # fmt: skip
            return await db.execute(
                "UPDATE holds SET state = 'reconciling', note = 'its gateway lease lapsed', updated_at = $2 "
                "WHERE state = 'open' AND owner <> $1 AND owner NOT IN "
                "(SELECT id FROM instances WHERE lease_until >= $2)",
                owner, now,
            )  # fmt: skip

    async def heartbeat(self, owner: str, lease_until: float, now: float) -> None:
        async with self.tx() as db:
            n = await db.execute("UPDATE instances SET lease_until = $2 WHERE id = $1", owner, lease_until)
            if n == 0:
                await db.execute(
                    "INSERT INTO instances (id, started_at, lease_until) VALUES ($1, $2, $3)",
                    owner,
                    now,
                    lease_until,
                )
            await db.execute("DELETE FROM instances WHERE lease_until < $1", now - 86_400)

    async def totals(self) -> Totals:
        async with self.read() as db:
            row = await db.fetchrow(
                "SELECT "
                "COALESCE((SELECT SUM(amount_micros) FROM credits), 0) AS c, "
                "COALESCE((SELECT SUM(balance_micros) FROM accounts), 0) AS b, "
                "COALESCE((SELECT SUM(amount_micros) FROM holds WHERE state IN ('open', 'reconciling')), 0) AS h, "
                "COALESCE((SELECT SUM(charged_micros) FROM holds WHERE state = 'settled'), 0) AS r"
            )
        assert row is not None
        return Totals(int(row["c"]), int(row["b"]), int(row["h"]), int(row["r"]))

    # -- keys -----------------------------------------------------------------------

    async def create_key(self, key: ApiKey, key_hash: str) -> None:
        async with self.tx() as db:
            if await db.fetchrow("SELECT id FROM accounts WHERE id = $1", key.account_id) is None:
                raise UnknownAccount(key.account_id)
            await db.execute(
                "INSERT INTO api_keys (id, key_hash, account_id, products, rpm, tpm, max_streams, created_at) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                key.id, key_hash, key.account_id,
                None if key.products is None else orjson.dumps(list(key.products)).decode(),
                key.rpm, key.tpm, key.max_streams, key.created_at,
            )  # fmt: skip

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        async with self.read() as db:
            row = await db.fetchrow("SELECT * FROM api_keys WHERE key_hash = $1", key_hash)
        if row is None:
            return None
        products = row["products"]
        return ApiKey(
            id=row["id"],
            account_id=row["account_id"],
            products=None if products is None else tuple(orjson.loads(products)),
            rpm=row["rpm"],
            tpm=row["tpm"],
            max_streams=row["max_streams"],
            created_at=float(row["created_at"]),
        )

    # -- usage ----------------------------------------------------------------------

    async def _upsert_usage(self, db: Executor, usage: UsageRecord) -> None:
        n = await db.execute(
            "UPDATE usage SET outcome = $2, cost_micros = $3, record = $4 WHERE request_id = $1",
            usage.request_id, usage.outcome, usage.cost_micros, orjson.dumps(dict(usage.record)).decode(),
        )  # fmt: skip
        if n == 0:
            await db.execute(
                _USAGE_INSERT,
                usage.request_id, usage.account_id, usage.product, usage.created_at, usage.outcome,
                usage.cost_micros, orjson.dumps(dict(usage.record)).decode(),
            )  # fmt: skip

    async def put_usage(self, usage: UsageRecord) -> None:
        async with self.tx() as db:
            await self._upsert_usage(db, usage)

    async def usage(self, account_id: str, request_id: str) -> UsageRecord | None:
        async with self.read() as db:
            row = await db.fetchrow(
                "SELECT * FROM usage WHERE request_id = $1 AND account_id = $2", request_id, account_id
            )
        return None if row is None else _usage(row)

    async def usage_page(
        self, account_id: str, *, limit: int, before: float | None, since: float | None, until: float | None
    ) -> Sequence[UsageRecord]:
        args: list[Any] = [account_id]
        where = ["account_id = $1"]
        for op, value in (("<", before), (">=", since), ("<=", until)):
            if value is not None:
                args.append(value)
                where.append(f"created_at {op} ${len(args)}")
        limit = max(1, min(limit, 1000))
        sql = f"SELECT * FROM usage WHERE {' AND '.join(where)} ORDER BY created_at DESC, request_id DESC LIMIT {limit}"
        async with self.read() as db:
            rows = await db.fetch(sql, *args)
        return [_usage(r) for r in rows]

    # -- idempotency ----------------------------------------------------------------

    async def idem_begin(
        self, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
    ) -> IdemBegin:
        try:
            return await self._idem_begin(account_id, key, body_hash, now, ttl_s)
        except IntegrityError:  # a concurrent first use of the same key
            return IdemBegin("in_flight")

    async def _idem_begin(
        self, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
    ) -> IdemBegin:
        async with self.tx() as db:
            await db.execute(
                "DELETE FROM idempotency WHERE account_id = $1 AND key = $2 AND expires_at < $3",
                account_id,
                key,
                now,
            )
            row = await db.fetchrow(
                "SELECT body_hash, state, status, headers, body FROM idempotency WHERE account_id = $1 AND key = $2",
                account_id, key,
            )  # fmt: skip
            if row is None:
                await db.execute(
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

    async def idem_complete(self, account_id: str, key: str, response: StoredResponse | None) -> None:
        async with self.tx() as db:
            if response is None:
                await db.execute(
                    "DELETE FROM idempotency WHERE account_id = $1 AND key = $2", account_id, key
                )
                return
            await db.execute(
                "UPDATE idempotency SET state = 'done', status = $3, headers = $4, body = $5 WHERE account_id = $1 AND key = $2",
                account_id, key, response.status, orjson.dumps(dict(response.headers)).decode(), response.body,
            )  # fmt: skip

    async def purge_idempotency(self, now: float) -> int:
        async with self.tx() as db:
            return await db.execute("DELETE FROM idempotency WHERE expires_at < $1", now)
