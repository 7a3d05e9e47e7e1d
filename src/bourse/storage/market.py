"""The ``market_versions`` table's transactions (migration 0014): the newest version,
the last file digest, and writing the next version (:class:`MarketTables`, a part of
:class:`~bourse.storage.sql.SqlStore`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson

from bourse.ports.market import MarketConflict, MarketVersion
from bourse.ports.stores import AuditEntry
from bourse.storage import audit as audit_rows
from bourse.storage.executor import Executor, IntegrityError

T = TypeVar("T")

KEEP_VERSIONS = 1000
"""Versions kept: older ones are deleted as new ones are written (the audit log keeps
what each change was)."""


def _row(row: Any) -> MarketVersion:
    return MarketVersion(
        version=int(row["version"]),
        products=orjson.loads(row["products"]),
        file_digest=row["file_digest"],
        actor=row["actor"],
        created_at=float(row["created_at"]),
    )


def market_version(db: Executor) -> int:
    row = db.fetchrow("SELECT MAX(version) AS v FROM market_versions")
    return 0 if row is None or row["v"] is None else int(row["v"])


def latest_market(db: Executor) -> MarketVersion | None:
    row = db.fetchrow("SELECT * FROM market_versions ORDER BY version DESC LIMIT 1")
    return None if row is None else _row(row)


def last_file_digest(db: Executor) -> str | None:
    row = db.fetchrow(
        "SELECT file_digest FROM market_versions WHERE file_digest IS NOT NULL ORDER BY version DESC LIMIT 1"
    )
    return None if row is None else str(row["file_digest"])


def put_market(db: Executor, v: MarketVersion) -> None:
    if market_version(db) != v.version - 1:
        raise MarketConflict(v.version)
    try:
        db.execute(
            "INSERT INTO market_versions (version, products, file_digest, actor, created_at) "
            "VALUES ($1, $2, $3, $4, $5)",
            v.version, orjson.dumps(v.products).decode(), v.file_digest, v.actor, v.created_at,
        )  # fmt: skip
    except IntegrityError:  # written meanwhile by another replica
        raise MarketConflict(v.version) from None
    db.execute("DELETE FROM market_versions WHERE version <= $1", v.version - KEEP_VERSIONS)


class MarketTables:
    """The store's :class:`~bourse.ports.market.MarketStore` methods."""

    def _run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        raise NotImplementedError

    def _read(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        raise NotImplementedError

    async def market_version(self) -> int:
        return await self._read(market_version)

    async def latest_market(self) -> MarketVersion | None:
        return await self._read(latest_market)

    async def last_file_digest(self) -> str | None:
        return await self._read(last_file_digest)

    async def put_market(self, version: MarketVersion, *, audit: AuditEntry | None = None) -> None:
        await self._run(audit_rows.with_audit, audit, put_market, version)
