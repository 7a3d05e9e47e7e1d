"""The ``admin_keys`` and ``dashboard_secret`` tables' transactions (migration 0016):
seed, list and rotate the admin key; make, seal and read the dashboard-session secret.
:class:`AdminKeyTables` gives them to :class:`bourse.storage.sql.SqlStore`.

Rotation is a compare-and-swap on the current row (``is_current`` is UNIQUE): of two
rotations at once, the second finds the current key changed (AdminKeyChanged) and
writes nothing. The session secret is sealed with the key the database seals webhook
secrets with (:func:`bourse.storage.sealing.sealer_in`); one that no key of this
gateway opens (its ``BOURSE_SECRET_KEY`` was taken over, ``--adopt-secret-key``) is
replaced by a new one, which ends every dashboard session.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from bourse.ports.admin_keys import AdminKey, AdminKeyChanged
from bourse.ports.stores import AuditEntry
from bourse.storage import audit as audit_rows
from bourse.storage.executor import Executor, IntegrityError, Row
from bourse.storage.sealing import Sealer, sealer_in

log = logging.getLogger("bourse.storage")
T = TypeVar("T")


def _row(row: Row) -> AdminKey:
    until = row["valid_until"]
    return AdminKey(str(row["key_hash"]), float(row["created_at"]), None if until is None else float(until))


def admin_keys(db: Executor) -> list[AdminKey]:
    return [_row(r) for r in db.fetch("SELECT * FROM admin_keys ORDER BY created_at, key_hash")]


def seed_admin_key(db: Executor, key_hash: str, now: float) -> AdminKey | None:
    # ON CONFLICT: replicas starting together on a new database; the first one's key wins
    db.execute(
        "INSERT INTO admin_keys (key_hash, is_current, created_at) SELECT $1, 1, $2 "
        "WHERE NOT EXISTS (SELECT 1 FROM admin_keys WHERE is_current = 1) ON CONFLICT DO NOTHING",
        key_hash, now,
    )  # fmt: skip
    row = db.fetchrow("SELECT * FROM admin_keys WHERE key_hash = $1", key_hash)
    return None if row is None else _row(row)


def rotate_admin_key(db: Executor, new_hash: str, old_valid_until: float, now: float) -> AdminKey | None:
    row = db.fetchrow("SELECT * FROM admin_keys WHERE is_current = 1")
    # no key outlives the new grace period (an earlier rotation's included): grace 0 leaves the new key alone
    db.execute(
        "UPDATE admin_keys SET valid_until = $1 WHERE is_current IS NULL AND valid_until > $1",
        old_valid_until,
    )
    if row is not None:
        swapped = db.execute(
            "UPDATE admin_keys SET is_current = NULL, valid_until = $2 WHERE key_hash = $1 AND is_current = 1",
            row["key_hash"], old_valid_until,
        )  # fmt: skip
        if swapped != 1:  # another rotation ended this key since the SELECT
            raise AdminKeyChanged()
    try:
        db.execute(
            "INSERT INTO admin_keys (key_hash, is_current, created_at) VALUES ($1, 1, $2)", new_hash, now
        )
    except IntegrityError:  # another rotation made its key current meanwhile
        raise AdminKeyChanged() from None
    return None if row is None else dataclasses.replace(_row(row), valid_until=old_valid_until)


def _new_secret() -> str:
    return base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()


def session_secret(db: Executor, box: Sealer | None, now: float) -> bytes:
    """The dashboard-session secret (made on first use; replaced when unreadable)."""
    seal = sealer_in(box)
    row = db.fetchrow("SELECT secret FROM dashboard_secret WHERE id = 1")
    if row is None:
        db.execute(
            "INSERT INTO dashboard_secret (id, secret, created_at) VALUES (1, $1, $2) ON CONFLICT (id) DO NOTHING",
            seal(db, _new_secret()), now,
        )  # fmt: skip
        row = db.fetchrow("SELECT secret FROM dashboard_secret WHERE id = 1")
        assert row is not None
    stored = str(row["secret"])
    try:
        secret = stored if box is None else box.opened(stored)[0]
    except ValueError:
        log.warning(
            "dashboard sessions: the database's session secret cannot be opened with this gateway's "
            "BOURSE_SECRET_KEY; a new one is made, which ends every dashboard session"
        )
        secret = _new_secret()
        db.execute(
            "UPDATE dashboard_secret SET secret = $1, created_at = $2 WHERE id = 1", seal(db, secret), now
        )
    return secret.encode()


class AdminKeyTables:
    """The admin key's and the session secret's store methods (mixed into SqlStore)."""

    secret_box: Sealer | None = None

    def _run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        raise NotImplementedError

    def _read(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return self._run(fn, *args)

    async def admin_keys(self) -> Sequence[AdminKey]:
        return await self._read(admin_keys)

    async def seed_admin_key(self, key_hash: str, now: float) -> AdminKey | None:
        return await self._run(seed_admin_key, key_hash, now)

    async def rotate_admin_key(
        self, new_hash: str, old_valid_until: float, now: float, *, audit: AuditEntry | None = None
    ) -> AdminKey | None:
        return await self._run(audit_rows.with_audit, audit, rotate_admin_key, new_hash, old_valid_until, now)

    async def session_secret(self, now: float) -> bytes:
        return await self._run(session_secret, self.secret_box, now)
