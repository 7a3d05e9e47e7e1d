"""The admin key, kept in the database and rotated live with a grace period.

- **Seeding.** ``BOURSE_ADMIN_KEY`` (or, without it, the data folder's ``admin_key``,
  generated on the first start) becomes the admin key of a database that has none
  yet: its first start, or its first start since migration 16. From then on the
  database decides: a gateway whose configured key is neither the current admin key
  nor one still in its grace period logs one WARNING at start (naming where the key
  came from, never the key) and that key is refused (401); the database's current key
  works on it as on every replica. A configured key in its grace period works until
  the grace ends, with a WARNING too.
- **Rotation** (:meth:`AdminKeyAdmin.rotate_admin_key`, ``POST /admin/admin_key/rotate``,
  role ``owner``): a new key, shown once; the old one keeps working ``grace_s`` more
  seconds (0 to :data:`MAX_GRACE_S`), then is refused with a 401 saying it was rotated
  and when it stopped. No older key outlives the new grace period (so ``grace_s`` 0
  leaves the new key alone). Audited (``admin_key.rotate``) in the rotation's
  transaction. Every replica sees it within the authenticator's cache TTL (1 s). The
  replica that rotates writes the new key into its data folder's ``admin_key`` when
  its configured key came from there (not from ``BOURSE_ADMIN_KEY``), so that file and
  ``bourse admin`` (which reads it) keep up.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bourse.domain.errors import GatewayError, invalid_request
from bourse.ports.admin_keys import AdminKeyChanged, AdminKeyStore
from bourse.ports.stores import audit_entry
from bourse.services.auth import Authenticator, hash_key, new_secret
from bourse.services.keys import MAX_GRACE_S, SYSTEM

log = logging.getLogger("bourse.admin")

ADMIN_KEY_PREFIX = "bk_admin_"
DEFAULT_GRACE_S = 3600.0
"""How long a rotated-out admin key keeps working when the rotation names no grace."""


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_key_file(path: Path, key: str) -> None:
    """``key`` into ``path`` (0600), replacing it atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    tmp.replace(path)


class AdminKeyAdmin:
    """The admin-key use case of :class:`bourse.services.accounts.AdminService`."""

    store: AdminKeyStore
    auth: Authenticator
    admin_key_file: Path | None
    """Where this gateway's configured admin key came from, when it is a file."""

    async def rotate_admin_key(self, grace_s: float, actor: str = SYSTEM) -> dict[str, Any]:
        """A new admin key (shown once, in ``key``); the old one works ``grace_s`` more seconds."""
        if not 0 <= grace_s <= MAX_GRACE_S:
            raise invalid_request(f"grace_s: expected 0 to {MAX_GRACE_S} seconds", param="grace_s")
        store = self.store
        now = self.auth.clock()
        until = now + grace_s
        secret = new_secret(ADMIN_KEY_PREFIX)
        entry = audit_entry(
            actor, "admin_key.rotate", "admin_key", {"grace_s": grace_s, "old_valid_until": until}, now
        )
        try:
            await store.rotate_admin_key(hash_key(secret), until, now, audit=entry)
        except AdminKeyChanged:
            raise GatewayError(
                409, "admin_key_changed", "The admin key was rotated by another call meanwhile; try again."
            ) from None
        self.auth.forget_admin_keys()
        written = None
        if self.admin_key_file is not None:
            try:
                write_key_file(self.admin_key_file, secret)
                written = str(self.admin_key_file)
            except OSError as exc:
                log.warning("admin key rotated, but %s was not updated: %s", self.admin_key_file, exc)
        log.warning("the admin key was rotated by %s; the old key works until %s", actor, _when(until))
        return {
            "object": "bourse.admin_key",
            "key": secret,
            "rotated_at": now,
            "grace_s": grace_s,
            "old_key_valid_until": until,
            "key_file": written,
        }


async def seed_admin_key(store: AdminKeyStore, configured_hash: str, now: float, source: str) -> None:
    """Make the configured admin key the database's when it has none; say (one WARNING)
    when the database's admin key is another (``source``: where the configured key came from)."""
    found = await store.seed_admin_key(configured_hash, now)
    if found is None:
        log.warning(
            "the configured admin key (%s) is not this database's admin key: it was rotated away, or "
            "another replica's key came first; it is refused. Use the key the last rotation returned "
            "(POST /admin/admin_key/rotate, bourse admin admin-key rotate): set BOURSE_ADMIN_KEY to it",
            source,
        )
    elif found.valid_until is not None and found.valid_until <= now:
        log.warning(
            "the configured admin key (%s) was rotated away: it stopped working at %s and is refused. "
            "Use the key the rotation returned: set BOURSE_ADMIN_KEY to it",
            source, _when(found.valid_until),
        )  # fmt: skip
    elif found.valid_until is not None:
        log.warning(
            "the configured admin key (%s) was rotated: it works until %s (its grace period), then is "
            "refused. Use the key the rotation returned: set BOURSE_ADMIN_KEY to it",
            source, _when(found.valid_until),
        )  # fmt: skip
