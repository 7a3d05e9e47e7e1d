"""The audit log (table ``audit_log``, in the ledger database): its rows' transactions
and the port (:class:`bourse.ports.stores.AuditStore`) over a SQL store.

Admin actions that change the ledger or the keys write their entry in the same
transaction as the change (:func:`with_audit`, the ``audit`` argument of the store's
methods); :class:`SqlAuditLog` writes an entry on its own and reads the log.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import orjson

from bourse.ports.stores import AuditEntry, audit_entry
from bourse.storage.executor import Executor

T = TypeVar("T")


def with_audit(db: Executor, audit: AuditEntry | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(db, *args)``, then the audit entry of the action, in the same transaction."""
    out = fn(db, *args)
    if audit is not None:
        add_audit(db, audit)
    return out


def add_audit(db: Executor, entry: AuditEntry) -> None:
    db.execute(
        "INSERT INTO audit_log (id, at, actor, action, target, detail) VALUES ($1, $2, $3, $4, $5, $6)",
        entry.id, entry.at, entry.actor, entry.action, entry.target, orjson.dumps(dict(entry.detail)).decode(),
    )  # fmt: skip


def audit_page(
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


class AuditRows(Protocol):
    """The audit log's methods of a SQL store (:class:`bourse.storage.sql.SqlStore`)."""

    async def add_audit(self, entry: AuditEntry) -> None: ...
    async def audit_page(
        self, *, action: str | None, target: str | None, limit: int, after: str | None
    ) -> Sequence[AuditEntry]: ...


class SqlAuditLog:
    """The audit log of one SQL store."""

    def __init__(self, store: AuditRows) -> None:
        self._store = store

    async def record(
        self, actor: str, action: str, target: str, detail: Mapping[str, Any] | None = None
    ) -> AuditEntry:
        entry = audit_entry(actor, action, target, detail)
        await self._store.add_audit(entry)
        return entry

    async def list(
        self,
        *,
        action: str | None = None,
        target: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> Sequence[AuditEntry]:
        return await self._store.audit_page(action=action, target=target, limit=limit, after=after)
