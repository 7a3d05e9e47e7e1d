"""Test helpers for the external services: PostgreSQL and Redis.

- :func:`postgres_url` / :func:`redis_url`: where the services are (env
  ``BOURSE_TEST_POSTGRES_URL`` / ``BOURSE_TEST_REDIS_URL``, local defaults).
- :func:`require_postgres` / :func:`require_redis`: the availability rule. A service
  is probed once per session (2 s connect timeout). When it cannot be reached the
  test is skipped with a reason naming the URL, unless ``BOURSE_REQUIRE_SERVICES=1``
  (CI), where it fails.
- :func:`fresh_postgres_database` (sync) / :func:`afresh_postgres_database` (async):
  a new database ``bourse_t_<hex>`` for one test, dropped ``WITH (FORCE)`` after, by
  :data:`DROPS`'s thread while the next tests run (PostgreSQL checkpoints on every
  ``DROP DATABASE``: 0.1-2 s of a test's teardown); the session waits for the last.
  Admin statements use psycopg when installed (the project's driver), else asyncpg
  (run with ``asyncio.run``, in a worker thread if a loop is already running).
- :class:`StoreFactory`: opens stores of one adapter on one test's database.
- :func:`hand_off_every_write`: no SQLite write on the loop's thread (for a test of
  writes in flight on the commit thread).
"""

from __future__ import annotations

import asyncio
import os
import queue
import secrets
import socket
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import pytest

from bourse.storage.inline import InlineGate

T = TypeVar("T")

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CONNECT_TIMEOUT_S = 2.0

MISSING_SERVICE_MARK = "CI runs these with BOURSE_REQUIRE_SERVICES=1"
"""Every skip for a missing service carries this text (the terminal summary counts them)."""


def postgres_url() -> str:
    return os.environ.get("BOURSE_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL


def redis_url() -> str:
    return os.environ.get("BOURSE_TEST_REDIS_URL") or DEFAULT_REDIS_URL


def services_required() -> bool:
    return os.environ.get("BOURSE_REQUIRE_SERVICES", "").strip() == "1"


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even when this thread already
    runs an event loop (then in a short-lived worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=work, name="run_sync", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


# -- reachability ------------------------------------------------------------------

_probes: dict[str, str | None] = {}
"""url -> None when reachable, else why not (one probe per URL per session)."""


def _admin_execute(url: str, *statements: str) -> None:
    """Run statements outside a transaction on ``url`` (CREATE/DROP DATABASE), with
    whichever PostgreSQL driver is installed: psycopg (the project's), else asyncpg."""
    try:
        import psycopg
    except ImportError:
        run_sync(_admin_execute_asyncpg(url, statements))
        return
    with psycopg.connect(url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S)) as conn:
        for sql in statements:
            conn.execute(sql)


async def _admin_execute_asyncpg(url: str, statements: tuple[str, ...]) -> None:
    import asyncpg

    conn = await asyncio.wait_for(asyncpg.connect(url, timeout=CONNECT_TIMEOUT_S), CONNECT_TIMEOUT_S + 1)
    try:
        for sql in statements:
            await conn.execute(sql)
    finally:
        await conn.close()


def _probe_postgres(url: str) -> str | None:
    try:
        _admin_execute(url, "SELECT 1")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".strip()
    return None


def _probe_redis(url: str) -> str | None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = sock.recv(64)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if reply[:1] not in (b"+", b"-"):  # "+PONG", or an error such as "-NOAUTH": a Redis answered
        return f"unexpected reply {reply!r}"
    return None


def postgres_problem(url: str | None = None) -> str | None:
    """None when PostgreSQL answers at ``url``; else the reason (cached per session)."""
    url = url or postgres_url()
    key = "postgres:" + url
    if key not in _probes:
        _probes[key] = _probe_postgres(url)
    return _probes[key]


def redis_problem(url: str | None = None) -> str | None:
    url = url or redis_url()
    key = "redis:" + url
    if key not in _probes:
        _probes[key] = _probe_redis(url)
    return _probes[key]


def redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(":" + parts.password + "@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _unavailable(service: str, env: str, url: str, problem: str) -> None:
    shown = redact(url)
    if services_required():
        pytest.fail(
            f"{service} not reachable at {shown} ({problem}); BOURSE_REQUIRE_SERVICES=1 makes this a failure: "
            f"start {service} or point {env} at a running one",
            pytrace=False,
        )
    pytest.skip(
        f"{service} not reachable at {shown}; start it (see README) or set {env}; {MISSING_SERVICE_MARK}"
    )


def require_postgres() -> str:
    """The PostgreSQL admin URL; skips (or fails under BOURSE_REQUIRE_SERVICES=1) when unreachable."""
    url = postgres_url()
    problem = postgres_problem(url)
    if problem is not None:
        _unavailable("PostgreSQL", "BOURSE_TEST_POSTGRES_URL", url, problem)
    return url


def require_redis() -> str:
    """The Redis URL; skips (or fails under BOURSE_REQUIRE_SERVICES=1) when unreachable."""
    url = redis_url()
    problem = redis_problem(url)
    if problem is not None:
        _unavailable("Redis", "BOURSE_TEST_REDIS_URL", url, problem)
    return url


# -- fresh PostgreSQL databases ----------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` (same host, user, options)."""
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def create_database(admin_url: str | None = None, options: str = "") -> str:
    """Create ``bourse_t_<hex>`` (``options``: more of ``CREATE DATABASE``, such as an
    encoding); its DSN."""
    admin_url = admin_url or postgres_url()
    name = "bourse_t_" + secrets.token_hex(8)
    _admin_execute(admin_url, f"CREATE DATABASE {_quote_ident(name)} {options}".rstrip())
    return with_database(admin_url, name)


def drop_database(dsn: str, admin_url: str | None = None) -> None:
    """Drop the database of ``dsn``, closing whatever is still connected to it."""
    admin_url = admin_url or postgres_url()
    name = urlsplit(dsn).path.lstrip("/")
    if not name.startswith("bourse_t_"):
        raise ValueError(f"refusing to drop {name!r}: not a test database")
    _admin_execute(admin_url, f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)")


async def acreate_database(admin_url: str | None = None) -> str:
    return await asyncio.to_thread(create_database, admin_url)


class DeferredDrops:
    """Test databases dropped one after another by a daemon thread, so that a test's
    teardown does not wait for the checkpoint each ``DROP DATABASE`` makes. At most
    :attr:`BACKLOG` wait (a test leaving one more then waits for room: the disk holds
    a bounded number of them); :meth:`finish` waits for the last and says which
    could not be dropped."""

    BACKLOG = 8

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, str]] = queue.Queue(maxsize=self.BACKLOG)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.failures: list[str] = []

    def later(self, dsn: str, admin_url: str) -> None:
        """Drop the database of ``dsn`` soon (it is never used again)."""
        name = urlsplit(dsn).path.lstrip("/")
        if not name.startswith("bourse_t_"):
            raise ValueError(f"refusing to drop {name!r}: not a test database")
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="drop-test-databases", daemon=True)
                self._thread.start()
        self._queue.put((dsn, admin_url))

    def _run(self) -> None:
        while True:
            dsn, admin_url = self._queue.get()
            try:
                drop_database(dsn, admin_url)
            except Exception as exc:
                self.failures.append(f"{redact(dsn)}: {type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

    def finish(self) -> list[str]:
        """Wait until every database handed over is dropped; the ones that failed."""
        self._queue.join()
        return list(self.failures)


DROPS = DeferredDrops()
"""The test process's one dropper (test support only, as :data:`tests.support.ledgers.WATCH`);
the suite's ``pytest_sessionfinish`` waits for it."""


@contextmanager
def fresh_postgres_database(options: str = "") -> Iterator[str]:
    """A new PostgreSQL database for one test (sync); yields its DSN, drops it after
    (:data:`DROPS`). Skips or fails per the availability rule when PostgreSQL is not
    reachable."""
    admin = require_postgres()
    dsn = create_database(admin, options)
    try:
        yield dsn
    finally:
        DROPS.later(dsn, admin)


@asynccontextmanager
async def afresh_postgres_database() -> AsyncIterator[str]:
    """The async form of :func:`fresh_postgres_database`."""
    admin = require_postgres()
    dsn = await acreate_database(admin)
    try:
        yield dsn
    finally:
        await asyncio.to_thread(DROPS.later, dsn, admin)


# -- stores over each adapter ----------------------------------------------------------


class StoreFactory:
    """Opens stores of one kind on this test's database.

    ``async with store_factory() as store:`` opens (and migrates) a store, closing it
    on exit; every call opens a new store on the *same* database (SQLite file or
    PostgreSQL database), so a test can reopen it.
    """

    def __init__(self, kind: str, target: str) -> None:
        self.kind = kind
        self.target = target
        """the SQLite file path, or the PostgreSQL DSN"""

    def new(self) -> Any:
        """An unopened store (the caller opens and closes it)."""
        if self.kind == "sqlite":
            from bourse.storage.sqlite import SqliteStore

            return SqliteStore(self.target)
        from bourse.storage.postgres import PostgresStore

        return PostgresStore(self.target)

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[Any]:
        store = self.new()
        await store.open()
        try:
            yield store
        finally:
            await store.close()


def hand_off_every_write(store: Any) -> None:
    """Turn SQLite's inline writes off (``storage.inline``; nothing for other adapters):
    a write run on the loop's thread ends before its caller's next step, so none would
    be in flight for a test that cancels one or queues others behind it."""
    if hasattr(store, "_gate"):
        store._gate = InlineGate(per_turn=0)
