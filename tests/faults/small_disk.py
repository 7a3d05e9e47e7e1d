"""A small filesystem of a test's own (a tmpfs it mounts), and filling it up.

Mounting needs root (CI runs as root); elsewhere the tests that need it skip, saying
so, except under ``BOURSE_REQUIRE_SERVICES=1`` (CI), where not being root is a failure
like any other missing service. As root a mount that fails is a failure, not a skip: the
fault is not tested.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.databases import MISSING_SERVICE_MARK, services_required

NOT_ROOT = "mounting a small tmpfs needs root (CI runs the fault suite as root)"


def require_root() -> None:
    """Skip unless root, or fail under ``BOURSE_REQUIRE_SERVICES=1``."""
    if os.geteuid() == 0:
        return
    if services_required():
        pytest.fail(f"{NOT_ROOT}; BOURSE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
    pytest.skip(f"{NOT_ROOT}; {MISSING_SERVICE_MARK}")


@contextmanager
def small_disk(folder: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` MiB mounted on ``folder`` for the block; unmounted after
    (lazily, if a process that outlived the test still has a file open on it)."""
    require_root()
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(folder)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, f"mount -t tmpfs failed as root: {done.stderr.strip()}"
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def fill(path: Path) -> int:
    """Write ``path`` until its filesystem has no byte left (ENOSPC); the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            block = b"\0" * chunk
            while True:
                try:
                    n = out.write(block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
                written += n or 0
                if not n:
                    break
    return written


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize
