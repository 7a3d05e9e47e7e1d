"""Secrets at rest in the data folder.

- The folder is private to its owner (0700) and the files bourse writes there are
  0600: the database and its ``-wal``/``-shm`` (SQLite gives those the mode of the
  database file), ``admin_key``, ``secret_key`` and ``demo_key``.
- Webhook secrets are stored sealed (:class:`SecretBox`: Fernet, AES-128-CBC with
  HMAC-SHA256, from the ``cryptography`` package) under a key kept in
  ``<data>/secret_key`` (generated on first start) or given in ``BOURSE_SECRET_KEY``,
  which replicas sharing one PostgreSQL database must all set to the same value.
  ``BOURSE_SECRET_KEY`` may list older keys after the first (``NEW,OLD``): they still
  open what they sealed, for a rotation. The database names the key it seals with by
  its fingerprint (:meth:`SecretBox.fingerprints`, an HMAC of a fixed text under the
  key: it tells keys apart and reveals nothing of them). A secret stored before
  sealing existed is read as it is.
- Keys generated at the first start (the admin key, the demo account's API key) are
  shown once on a terminal; when stderr is not a terminal (a log file, a service
  manager) only the path of the 0600 file holding each key is written.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

log = logging.getLogger("bourse.storage")

SEALED = "fernet:"
"""Prefix of a sealed value in the database (anything else was stored in clear)."""


def private_folder(path: Path) -> Path:
    """Create ``path`` (0700), or narrow an existing folder of ours to 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _narrow(path, 0o700)
    return path


def private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 if missing; narrow it to 0600 if it exists."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        _narrow(path, 0o600)


def narrow_files(*paths: Path) -> None:
    """Narrow each of ``paths`` that exists to 0600."""
    for path in paths:
        _narrow(path, 0o600)


def _narrow(path: Path, mode: int) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if stat.S_IMODE(st.st_mode) & ~mode and st.st_uid == os.geteuid():
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (0600), replacing it atomically."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


class SecretUnreadable(ValueError):
    """A sealed secret that none of this box's keys opens (another replica's key?)."""


class BadSecretKey(ValueError):
    """``BOURSE_SECRET_KEY`` (or the data folder's ``secret_key``) is not a Fernet key."""


_CHECK_TEXT = b"bourse webhook secret sealing key v1"


def fingerprint(key: bytes) -> str:
    """The check value of a Fernet key that the database keeps (hex HMAC-SHA256)."""
    return hmac.new(key, _CHECK_TEXT, hashlib.sha256).hexdigest()


class SecretBox:
    """Seals short secrets for the database, and opens them again, with one or more
    keys: the first seals by default, every one opens."""

    def __init__(self, keys: Sequence[bytes], source: str = "BOURSE_SECRET_KEY") -> None:
        if not keys:
            raise BadSecretKey(f"{source}: no key")
        fernets: list[Fernet] = []
        for n, key in enumerate(keys, 1):
            try:
                fernets.append(Fernet(key))
            except ValueError:
                raise BadSecretKey(
                    f"{source}: key {n} is not a Fernet key (32 url-safe base64-encoded bytes; "
                    "make one with: python -c 'from cryptography.fernet import Fernet; "
                    "print(Fernet.generate_key().decode())')"
                ) from None
        self._fernets = fernets
        self.fingerprints: tuple[str, ...] = tuple(fingerprint(k) for k in keys)
        """One per key, in order: the first is the key this box seals with by default."""
        self.source = source
        """Where the keys came from (``BOURSE_SECRET_KEY``, or "the key in <path>"), for messages."""

    @classmethod
    def for_folder(cls, data_dir: Path, env_key: str | None = None) -> SecretBox:
        """The box of ``BOURSE_SECRET_KEY`` if given (comma-separated keys, the first
        sealing), else of ``<data_dir>/secret_key`` (generated, 0600, on the first start)."""
        if env_key:
            return cls([k.strip().encode() for k in env_key.split(",") if k.strip()])
        path = data_dir / "secret_key"
        try:
            return cls([path.read_bytes().strip()], f"the key in {path}")
        except FileNotFoundError:
            pass
        private_folder(data_dir)
        key = Fernet.generate_key()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process on the same folder won the race
            return cls([path.read_bytes().strip()], f"the key in {path}")
        with os.fdopen(fd, "wb") as f:
            f.write(key + b"\n")
        return cls([key], f"the key in {path}")

    def seal(self, secret: str, with_key: str | None = None) -> str:
        """``secret`` sealed with the key of fingerprint ``with_key`` (default: the first);
        KeyError when this box does not hold that key."""
        if with_key is None:
            index = 0
        elif with_key in self.fingerprints:
            index = self.fingerprints.index(with_key)
        else:
            raise KeyError(with_key)
        return SEALED + self._fernets[index].encrypt(secret.encode()).decode("ascii")

    def open(self, stored: str) -> str:
        """The secret of a stored value; one stored in clear (before sealing) as it is."""
        return self.opened(stored)[0]

    def opened(self, stored: str) -> tuple[str, int | None]:
        """The secret of a stored value and the index of the key that opened it (None: it
        was stored in clear); SecretUnreadable when no key opens it."""
        if not stored.startswith(SEALED):
            return stored, None
        token = stored[len(SEALED) :].encode("ascii", "replace")
        for index, f in enumerate(self._fernets):
            try:
                return f.decrypt(token).decode(), index
            except InvalidToken:
                continue
        raise SecretUnreadable(
            f"a webhook secret cannot be opened with this gateway's key ({self.source}); "
            "replicas sharing one database need the same BOURSE_SECRET_KEY"
        )


def key_notices(
    data_dir: Path | None, admin_key: str | None, demo_key: str | None, *, terminal: bool
) -> list[str]:
    """What to tell the operator of the keys generated at this start, once (the caller
    writes the lines, in the log's format): on a ``terminal``, the keys; otherwise the
    paths of the 0600 files that hold them (``admin_key`` is written when generated;
    ``demo_key`` here; without a data folder, only that keys were made)."""
    lines: list[str] = []
    if admin_key:
        where = "kept in the data folder" if data_dir is None else f"kept in {data_dir / 'admin_key'}"
        lines.append(
            f"admin key (shown once, {where}): {admin_key}" if terminal else f"admin key {where} (mode 600)"
        )
    if demo_key:
        what = "demo account 'demo' with $5.00 of credit; its API key"
        if terminal:
            lines.append(f"{what} (shown once): {demo_key}")
        elif data_dir is None:
            lines.append(f"{what} was made; it is shown on a terminal only")
        else:
            path = data_dir / "demo_key"
            write_private(path, demo_key + "\n")
            lines.append(f"{what} is in the file {path} (mode 600)")
    return lines
