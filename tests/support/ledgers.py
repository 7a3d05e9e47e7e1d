"""The gateway ledgers (a data folder's SQLite file or a PostgreSQL database) that the
tests have open, so that a suite can check its invariants on each one.

Whatever starts a gateway (:func:`tests.support.gateway.running_gateway`,
:func:`tests.support.processes.serve_process`, :func:`tests.support.asgi.in_process_gateway`)
wraps its life in :func:`watched`; a test that opens a store or builds a container
itself wraps their use in it too.
A suite that wants the check (tests/faults/conftest.py) installs it with
:meth:`Watch.checking`: it then runs when each watched gateway stops (its database
still there, the gateway drained or dead) and, through the suite's fixture, after
each test on the gateways still running (module-scoped ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Ledger:
    """One gateway's database: ``dsn`` for PostgreSQL, else ``data_dir``'s ``bourse.db``."""

    data_dir: Path
    dsn: str | None

    @property
    def database(self) -> str:
        """What two gateways on one database share (replicas)."""
        return self.dsn if self.dsn is not None else str(self.data_dir.resolve())

    @property
    def exists(self) -> bool:
        return self.dsn is not None or (self.data_dir / "bourse.db").exists()


@dataclass
class Watch:
    live: list[Ledger] = field(default_factory=list)
    checks: list[Callable[[Ledger], None]] = field(default_factory=list)

    @contextmanager
    def checking(self, check: Callable[[Ledger], None]) -> Iterator[None]:
        """Run ``check`` on each watched ledger as its gateway stops, while in the block."""
        self.checks.append(check)
        try:
            yield
        finally:
            self.checks.remove(check)


WATCH = Watch()
"""The test process's one registry (test support only; the product has no such global)."""


@contextmanager
def watched(data_dir: str | Path, dsn: str | None) -> Iterator[Ledger]:
    """Register a gateway's ledger while it runs; the installed checks run as it stops,
    once the last gateway on that database has stopped (not when the block ends in an
    exception: that failure is the one to report)."""
    ledger = Ledger(Path(data_dir), dsn)
    WATCH.live.append(ledger)
    try:
        yield ledger
    finally:
        WATCH.live.remove(ledger)
    if not ledger.exists or any(other.database == ledger.database for other in WATCH.live):
        return
    for check in list(WATCH.checks):
        check(ledger)
