"""Which key seals the webhook secrets of one database, and the transactions that
seal, open and re-seal them (run inside :class:`bourse.storage.sql.SqlStore`'s).

The table ``sealing_key`` (one row) names the key by its fingerprint
(:func:`bourse.storage.private.fingerprint`). The first gateway to start on a database
writes its own; a gateway whose keys do not include the named one refuses to start
(:class:`SealingKeyMismatch`), so replicas never seal with different keys. A single
node (SQLite) takes the database over instead, with a warning: no other gateway shares
it. Every seal reads the row in the sealing transaction and locks it, so a seal that
runs while a re-seal changes the key waits for it and uses the new key. A re-seal
(:func:`reseal`) opens every secret with any of the gateway's keys and seals it with
its first, which the row names from then on (the dashboard-session secret of
:mod:`bourse.storage.admin_keys` too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from bourse.domain.values import immutable
from bourse.ports.stores import ResealReport, SealingKeyMissing, UnknownAccount
from bourse.storage.private import SEALED

if TYPE_CHECKING:
    from bourse.storage.executor import Executor

UNREADABLE_NAMED = 100
"""A re-seal's report names at most this many accounts whose secret it cannot open."""
SAMPLE = 100
"""Sealed secrets tried when a database is adopted for the first time."""


class Sealer(Protocol):
    """Seals secrets at rest (:class:`bourse.storage.private.SecretBox`)."""

    fingerprints: tuple[str, ...]
    source: str

    def seal(self, secret: str, with_key: str | None = None) -> str:
        """Sealed with the key of fingerprint ``with_key`` (default the first); KeyError
        when the sealer does not hold it."""
        ...

    def opened(self, stored: str) -> tuple[str, int | None]:
        """The secret and the index of the key that opened it (None: stored in clear);
        ValueError when no key opens it."""
        ...


class SealingKeyMismatch(Exception):
    """This gateway's keys do not include the one the database seals with."""


@immutable
class Adoption:
    """What :func:`adopt` found: the key the database seals with, and whether this
    gateway named it first (a new database) or took it over from another key."""

    fingerprint: str
    first: bool = False
    took_over_from: str | None = None
    unreadable: int = 0
    """Of the sealed secrets tried (at most :data:`SAMPLE`), those this gateway cannot open."""


def _short(fp: str) -> str:
    return fp[:12]


def _named(db: Executor) -> str | None:
    row = db.fetchrow("SELECT fingerprint FROM sealing_key WHERE id = 1")
    return None if row is None else str(row["fingerprint"])


def _unreadable_sample(db: Executor, box: Sealer) -> tuple[int, int]:
    """Of at most :data:`SAMPLE` sealed secrets: (tried, not opened by ``box``)."""
    rows = db.fetch(f"SELECT secret FROM webhook_secrets WHERE secret LIKE $1 LIMIT {SAMPLE}", SEALED + "%")
    bad = 0
    for row in rows:
        try:
            box.opened(str(row["secret"]))
        except ValueError:
            bad += 1
    return len(rows), bad


def adopt(db: Executor, box: Sealer, now: float, take_over: bool) -> Adoption:
    """Check (or name, on a new database) the key the database seals with against
    ``box``; ``take_over``: name this gateway's first key instead of refusing."""
    mine = box.fingerprints[0]
    named = _named(db)
    if named is not None and named in box.fingerprints:
        return Adoption(named)
    tried, bad = _unreadable_sample(db, box)
    if named is None:
        if tried and bad == tried and not take_over:  # sealed before keys were checked, by another key
            raise SealingKeyMismatch(
                f"{box.source} opens none of the webhook secrets already in this database ({tried} tried): "
                "they were sealed by another replica's key; give every replica that key in "
                "BOURSE_SECRET_KEY (or start once with --adopt-secret-key to give those secrets up)"
            )
        # ON CONFLICT: replicas starting together; the one that wrote first names the key
        db.execute(
            "INSERT INTO sealing_key (id, fingerprint, set_at) VALUES (1, $1, $2) ON CONFLICT (id) DO NOTHING",
            mine, now,
        )  # fmt: skip
        named = _named(db)
        assert named is not None
        if named in box.fingerprints:
            return Adoption(named, first=named == mine, unreadable=bad)
    if not take_over:
        raise SealingKeyMismatch(
            f"the webhook secrets in this database are sealed with another key (check value "
            f"{_short(named)}…) than {box.source} ({_short(mine)}…): give every replica of one database "
            "the same BOURSE_SECRET_KEY (the first replica's is its BOURSE_SECRET_KEY or <data>/secret_key), "
            "or start once with --adopt-secret-key to give up the secrets sealed with the other key"
        )
    db.execute("UPDATE sealing_key SET fingerprint = $1, set_at = $2 WHERE id = 1", mine, now)
    return Adoption(mine, took_over_from=named, unreadable=bad)


def sealer_in(box: Sealer | None) -> Callable[[Executor, str], str]:
    """Seal a secret in a transaction, with the key the database names (the row locked
    until the transaction ends); SealingKeyMissing when ``box`` does not hold it."""

    def seal(db: Executor, secret: str) -> str:
        if box is None:  # a store without sealing (tests): kept in clear
            return secret
        row = db.fetchrow(
            "UPDATE sealing_key SET fingerprint = fingerprint WHERE id = 1 RETURNING fingerprint"
        )
        try:
            return box.seal(secret, None if row is None else str(row["fingerprint"]))
        except KeyError:
            raise SealingKeyMissing(
                f"webhook secrets are now sealed with a key this gateway does not have (check value "
                f"{_short(str(row['fingerprint'])) if row else '?'}…): give it the cluster's BOURSE_SECRET_KEY "
                "and restart it"
            ) from None

    return seal


def set_secret(db: Executor, seal: Callable[[Executor, str], str], account_id: str, secret: str) -> int:
    """Replace the account's secret; release its held webhooks (how many)."""
    if db.fetchrow("SELECT id FROM accounts WHERE id = $1", account_id) is None:
        raise UnknownAccount(account_id)
    db.execute(
        "INSERT INTO webhook_secrets (account_id, secret) VALUES ($1, $2) "
        "ON CONFLICT (account_id) DO UPDATE SET secret = excluded.secret",
        account_id, seal(db, secret),
    )  # fmt: skip
    return db.execute(
        "UPDATE jobs SET webhook_state = 'pending', webhook_error = NULL "
        "WHERE account_id = $1 AND webhook_state = 'held'",
        account_id,
    )


def reseal(db: Executor, box: Sealer, now: float) -> ResealReport:
    """Every secret ``box`` opens, sealed with its first key, which the database names
    from now on; the held webhooks of accounts whose secret opens go back to pending."""
    mine = box.fingerprints[0]
    # the row first: a seal running meanwhile waits for this transaction, then uses the new key
    if db.execute("UPDATE sealing_key SET fingerprint = $1, set_at = $2 WHERE id = 1", mine, now) == 0:
        db.execute("INSERT INTO sealing_key (id, fingerprint, set_at) VALUES (1, $1, $2)", mine, now)
    resealed = unchanged = 0
    unreadable: list[str] = []
    for row in db.fetch("SELECT account_id AS id, secret FROM webhook_secrets ORDER BY account_id"):
        stored = str(row["secret"])
        try:
            secret, index = box.opened(stored)
        except ValueError:
            unreadable.append(str(row["id"]))
            continue
        if index == 0 and stored.startswith(SEALED):
            unchanged += 1
            continue
        db.execute(
            "UPDATE webhook_secrets SET secret = $2 WHERE account_id = $1", row["id"], box.seal(secret, mine)
        )
        resealed += 1
    _reseal_session_secret(db, box, mine)
    released = 0
    blocked = set(unreadable)
    for row in db.fetch("SELECT DISTINCT account_id FROM jobs WHERE webhook_state = 'held'"):
        if row["account_id"] not in blocked:
            released += db.execute(
                "UPDATE jobs SET webhook_state = 'pending', webhook_error = NULL "
                "WHERE account_id = $1 AND webhook_state = 'held'",
                row["account_id"],
            )
    return ResealReport(resealed, unchanged, unreadable[:UNREADABLE_NAMED], len(unreadable), released)


def _reseal_session_secret(db: Executor, box: Sealer, seal_with: str) -> None:
    """Seal the session secret with the key of fingerprint ``seal_with`` (a re-seal of
    the webhook secrets); left alone when this gateway cannot open it."""
    row = db.fetchrow("SELECT secret FROM dashboard_secret WHERE id = 1")
    if row is None:
        return
    try:
        secret = box.opened(str(row["secret"]))[0]
    except ValueError:
        return
    db.execute("UPDATE dashboard_secret SET secret = $1 WHERE id = 1", box.seal(secret, seal_with))
