"""The audit log port (:class:`bourse.ports.stores.AuditStore`) over a SQL store's
``audit_log`` table, in the ledger database.

Admin actions that change the ledger or the keys write their entry in the same
transaction as the change (the ``audit`` argument of the store's methods); this
adapter writes an entry on its own and reads the log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bourse.ports.stores import AuditEntry, audit_entry
from bourse.storage.sql import SqlStore


class SqlAuditLog:
    """The audit log of one :class:`SqlStore`."""

    def __init__(self, store: SqlStore) -> None:
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
