"""The market's configuration as the database keeps it (issue 37): a version number,
the products' tables (as the config file writes them, read as JSON), and the port
that stores the versions and tells replicas of a new one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from bourse.domain.values import immutable
from bourse.ports.stores import AuditEntry


@immutable
class MarketVersion:
    version: int
    products: Mapping[str, Any]
    """Each product's table, as in the config file (JSON types)."""
    file_digest: str | None
    """The SHA-256 of the config file's products it was seeded from (None: an admin change)."""
    actor: str
    created_at: float


class MarketConflict(Exception):
    """Another change wrote the version this one meant to write: read again and retry."""


class MarketStore(Protocol):
    async def market_version(self) -> int:
        """The newest version's number (0: none yet)."""
        ...

    async def latest_market(self) -> MarketVersion | None:
        """The newest version (None: none yet)."""
        ...

    async def last_file_digest(self) -> str | None:
        """The digest of the config file the newest file-seeded version came from."""
        ...

    async def put_market(self, version: MarketVersion, *, audit: AuditEntry | None = None) -> None:
        """Write ``version`` (the newest + 1) with its audit entry, in one transaction;
        MarketConflict if the newest is not ``version.version - 1`` any more."""
        ...


@immutable
class Outcome:
    """A change: the version in force after it, and what it changed (one line each)."""

    version: int
    changes: list[str]
    applied: bool


Edit = Callable[[dict[str, Any]], dict[str, Any]]
"""What a change does to the newest version's products (a copy it may change)."""


class MarketAdmin(Protocol):
    """The live market configuration as the admin API reads and changes it."""

    async def current(self) -> MarketVersion:
        """The newest version (503 ``unavailable`` before the first)."""
        ...

    async def change(
        self,
        edit: Edit,
        actor: str,
        *,
        action: str = "market.change",
        target: str = "market",
        dry_run: bool = False,
    ) -> Outcome:
        """Write the version ``edit`` makes (or only say what it would change); 400
        ``invalid_config`` naming each problem; in force on every replica within 1 s."""
        ...


class MarketNotes(Protocol):
    """How replicas hear of a new version at once (a heartbeat catches up the missed)."""

    async def publish(self, version: int) -> None: ...

    async def listen(self, heard: Callable[[int], Awaitable[None]]) -> None:
        """Call ``heard`` with each version published (by any replica) until cancelled."""
        ...
