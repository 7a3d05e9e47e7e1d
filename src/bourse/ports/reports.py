"""The reporting port: read-only queries across accounts, for the operator's views.

The storage ports (:mod:`bourse.ports.stores`) answer one account at a time, as the
API does. The dashboard and the operator's CSV export also need every account, the
spend of each key over time and the finished requests filtered by key, product and
outcome. Adapters (``bourse.storage.reports``) implement this over SQLite and
PostgreSQL; nothing here writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from bourse.domain.values import immutable
from bourse.ports.stores import Account, Job, JobStatus, UsageRecord


@immutable
class UsageFilter:
    """Which usage records: every field left ``None`` matches all."""

    account_id: str | None = None
    key_id: str | None = None
    product: str | None = None
    outcome: str | None = None
    since: float | None = None
    """Created at or after (unix seconds)."""
    until: float | None = None
    """Created at or before (unix seconds)."""


@immutable
class SpendPoint:
    """What one key of one account spent in one time bucket."""

    t: float
    """The bucket's start (unix seconds)."""
    account_id: str
    key_id: str | None
    cost_micros: int
    requests: int


class ReportStore(Protocol):
    async def accounts(self, limit: int) -> Sequence[Account]:
        """Every account (up to ``limit``), by id, with its holds and spend."""
        ...

    async def usage_rows(
        self, where: UsageFilter, *, limit: int, after: str | None = None
    ) -> Sequence[UsageRecord]:
        """Newest first; ``after`` is a keyset cursor (the last request id of the previous page)."""
        ...

    async def spend(self, where: UsageFilter, bucket_s: int) -> Sequence[SpendPoint]:
        """The cost of the matching records by time bucket, account and key, oldest first."""
        ...

    async def jobs(self, account_id: str | None, status: JobStatus | None, limit: int) -> Sequence[Job]:
        """Jobs, newest first, of one account or all."""
        ...
