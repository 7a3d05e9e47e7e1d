"""Suite-wide fixtures: the anyio backend, external services, stores over each adapter;
the child processes' bytecode cache and the httpx clients' shared SSL contexts
(:mod:`tests.support.ssl_contexts`); at the session's end, the wait for the test
databases still being dropped."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.databases import (
    DROPS,
    MISSING_SERVICE_MARK,
    StoreFactory,
    fresh_postgres_database,
    postgres_url,
    redact,
    redis_url,
    require_redis,
)
from tests.support.processes import PYCACHE_PREFIX_VAR
from tests.support.ssl_contexts import share_ssl_contexts

PYCACHE = pytest.StashKey[str]()
"""The bytecode folder this session made for its ``bourse`` children (removed at its end)."""
UNSHARE = pytest.StashKey[Callable[[], None]]()


def pytest_configure(config: pytest.Config) -> None:
    """httpx clients share their SSL contexts (:mod:`tests.support.ssl_contexts`).

    Under ``PYTHONDONTWRITEBYTECODE`` every ``bourse`` child (hundreds of ``serve`` and
    ``admin`` processes) would compile bourse's ~190 modules from source again (~0.15 s
    each): the children started with :func:`tests.support.processes.clean_env` share a
    bytecode cache in a folder of this session instead (``BOURSE_TEST_PYCACHE_PREFIX``,
    or one made here and removed at the end; nothing is written beside the sources).
    This process is unaffected (its flags are read at start-up)."""
    config.stash[UNSHARE] = share_ssl_contexts()
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get(PYCACHE_PREFIX_VAR):
        return
    folder = tempfile.mkdtemp(prefix="bourse-test-pycache-")
    config.stash[PYCACHE] = folder
    os.environ[PYCACHE_PREFIX_VAR] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    if UNSHARE in config.stash:
        config.stash[UNSHARE]()
    if PYCACHE in config.stash:
        os.environ.pop(PYCACHE_PREFIX_VAR, None)
        shutil.rmtree(config.stash[PYCACHE], ignore_errors=True)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (``@pytest.mark.anyio``) run on asyncio."""
    return "asyncio"


# -- services ------------------------------------------------------------------------


@pytest.fixture
def postgres_dsn() -> Iterator[str]:
    """A fresh PostgreSQL database for this test (dropped after); skips/fails per the
    availability rule in :mod:`tests.support.databases`."""
    with fresh_postgres_database() as dsn:
        yield dsn


@pytest.fixture
def redis_service_url() -> str:
    """The Redis URL; skips/fails per the availability rule when it is not reachable."""
    return require_redis()


# -- stores ---------------------------------------------------------------------------


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], ids=["sqlite", "postgres"]
)
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreFactory]:
    kind: str = request.param
    if kind == "sqlite":
        yield StoreFactory("sqlite", str(tmp_path / "bourse.db"))
        return
    with fresh_postgres_database() as dsn:
        yield StoreFactory("postgres", dsn)


# -- reporting ------------------------------------------------------------------------


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Wait for the test databases still being dropped; a drop that failed fails the run."""
    failures = DROPS.finish()
    if not failures:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "test databases that could not be dropped", red=True, bold=True)
        for line in failures:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One clear block when tests were skipped because a service was not reachable."""
    by_service: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = _skip_reason(report)
        if MISSING_SERVICE_MARK not in reason:
            continue
        service = "PostgreSQL" if "PostgreSQL" in reason else "Redis" if "Redis" in reason else "a service"
        by_service[service] = by_service.get(service, 0) + 1
    if not by_service:
        return
    total = sum(by_service.values())
    where = {"PostgreSQL": redact(postgres_url()), "Redis": redact(redis_url())}
    tr = terminalreporter
    tr.write_sep("=", "services not reachable", yellow=True, bold=True)
    tr.write_line(f"{total} test(s) could NOT run because a service was not reachable:")
    for service, n in sorted(by_service.items()):
        tr.write_line(f"  - {service} at {where.get(service, '?')}: {n} test(s) skipped")
    tr.write_line("To run them: start the service (see README), or point BOURSE_TEST_POSTGRES_URL /")
    tr.write_line("BOURSE_TEST_REDIS_URL at a running one. CI sets BOURSE_REQUIRE_SERVICES=1, which turns")
    tr.write_line("these skips into failures; set it locally to check the whole suite really ran.")
