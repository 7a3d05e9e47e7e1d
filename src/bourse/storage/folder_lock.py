"""One serving process per data folder.

``bourse serve`` takes an exclusive ``flock`` on ``<data>/lock`` before it writes
anything in the folder, and holds it for the life of the process (the kernel lets go
when the process ends, however it ends: no stale lock after a crash). The file holds
the holder's pid. A second ``serve`` on the folder fails at once with
:class:`FolderInUse`, naming that pid, having changed nothing: the folder's ledger,
holds, jobs and keys stay the live gateway's.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = "lock"


class FolderInUse(Exception):
    """The data folder is locked by another process."""

    def __init__(self, folder: Path, pid: str | None) -> None:
        holder = f"process {pid}" if pid else "another process"
        super().__init__(
            f"the data folder {folder} is in use by {holder} (a running bourse serve); "
            "each gateway needs its own data folder"
        )
        self.pid = pid


@contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold the lock of ``folder`` (which exists) while the block runs; :class:`FolderInUse` if taken."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise FolderInUse(folder, pid if pid.isdigit() else None) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
