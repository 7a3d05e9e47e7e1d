"""Secrets at rest in the data folder.

- The folder is private to its owner (0700) and the files bourse writes there are
  0600: the database and its ``-wal``/``-shm`` (SQLite gives those the mode of the
  database file), ``admin_key``, ``secret_key`` and ``demo_key``.
- Webhook secrets are stored sealed (:class:`SecretBox`: Fernet, AES-128-CBC with
  HMAC-SHA256, from the ``cryptography`` package) under a key kept in
  ``<data>/secret_key`` (generated on first start) or given in ``BOURSE_SECRET_KEY``,
  which replicas sharing one PostgreSQL database must all set to the same value. A
  secret stored before sealing existed is read as it is.
- Keys generated at the first start (the admin key, the demo account's API key) are
  shown once on a terminal; when stderr is not a terminal (a log file, a service
  manager) only the path of the 0600 file holding each key is written.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import TextIO

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
    """A sealed secret that this key cannot open (another replica's key?)."""


class SecretBox:
    """Seals short secrets for the database, and opens them again."""

    def __init__(self, key: bytes) -> None:
        self._fernet = Fernet(key)

    @classmethod
    def for_folder(cls, data_dir: Path, env_key: str | None = None) -> SecretBox:
        """The box of ``BOURSE_SECRET_KEY`` if given, else of ``<data_dir>/secret_key``
        (generated, 0600, on the first start)."""
        if env_key:
            return cls(env_key.encode())
        path = data_dir / "secret_key"
        try:
            return cls(path.read_bytes().strip())
        except FileNotFoundError:
            pass
        private_folder(data_dir)
        key = Fernet.generate_key()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process on the same folder won the race
            return cls(path.read_bytes().strip())
        with os.fdopen(fd, "wb") as f:
            f.write(key + b"\n")
        return cls(key)

    def seal(self, secret: str) -> str:
        return SEALED + self._fernet.encrypt(secret.encode()).decode("ascii")

    def open(self, stored: str) -> str:
        """The secret of a stored value; one stored in clear (before sealing) as it is."""
        if not stored.startswith(SEALED):
            return stored
        try:
            return self._fernet.decrypt(stored[len(SEALED) :].encode("ascii")).decode()
        except InvalidToken:
            raise SecretUnreadable(
                "a webhook secret cannot be decrypted with this gateway's key; replicas sharing "
                "one database need the same BOURSE_SECRET_KEY"
            ) from None


def announce_keys(
    data_dir: Path | None, admin_key: str | None, demo_key: str | None, err: TextIO | None = None
) -> None:
    """Show keys generated at this start once: on a terminal, the keys; otherwise the
    paths of the 0600 files that hold them (``admin_key`` is written when generated;
    without a data folder, only that keys were made)."""
    err = sys.stderr if err is None else err
    terminal = err.isatty()
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
    for line in lines:
        print(f"bourse: {line}", file=err, flush=True)
