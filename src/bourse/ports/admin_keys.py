"""The admin key as the database keeps it (migration 0016), and the secret that signs
dashboard sessions: the ports :mod:`bourse.services.admin_key` and
:mod:`bourse.services.sessions` use.

Only SHA-256 hashes of admin keys are stored. One key is current; a rotated-out key
keeps working until its ``valid_until`` (its grace period), then is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from bourse.domain.values import immutable
from bourse.ports.stores import AuditEntry


@immutable
class AdminKey:
    key_hash: str
    created_at: float
    valid_until: float | None = None
    """None: the current admin key; else when this rotated-out key stops (stopped) working."""

    @property
    def current(self) -> bool:
        return self.valid_until is None


class AdminKeyChanged(Exception):
    """Another rotation changed the current admin key during this one."""


class AdminKeyReader(Protocol):
    async def admin_keys(self) -> Sequence[AdminKey]:
        """Every admin key the database knows (the current one and the rotated-out ones)."""
        ...


class AdminKeyStore(AdminKeyReader, Protocol):
    async def seed_admin_key(self, key_hash: str, now: float) -> AdminKey | None:
        """Make ``key_hash`` the current admin key when the database has none (its first
        start); the database's record of ``key_hash`` either way (None: not one of its keys)."""
        ...

    async def rotate_admin_key(
        self, new_hash: str, old_valid_until: float, now: float, *, audit: AuditEntry | None = None
    ) -> AdminKey | None:
        """``new_hash`` becomes the current admin key; the one it replaces (returned, None
        when there was none) and every key still in a grace period work until
        ``old_valid_until`` at the latest. AdminKeyChanged when another rotation won."""
        ...


class SessionSecretStore(Protocol):
    async def session_secret(self, now: float) -> bytes:
        """The database's dashboard-session signing secret (made on first use)."""
        ...
