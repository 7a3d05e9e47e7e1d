"""The composition root: builds engines, stores, markets and services from a
:class:`Config`.

The only module that imports adapters (``bourse.engines``, ``bourse.storage``,
``bourse.coordination``), the optional ones lazily, so an optional dependency is
needed only when configured.
Nothing is built at import time; :func:`build` is called by the CLI and the tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp

from bourse.coordination.book_local import LocalBook
from bourse.coordination.limits_local import MemoryRateLimiter
from bourse.domain.book import Deployment, ProductBook
from bourse.http.app import create_app
from bourse.market_build import MarketBuilder, build_engine
from bourse.market_desk import MarketDesk
from bourse.observability import WorkerPeers, build_observer
from bourse.observability.logs import say
from bourse.ports.book import BookPort
from bourse.ports.engine import Engine
from bourse.ports.limits import RateLimiter
from bourse.ports.observer import NULL_OBSERVER, Observer
from bourse.ports.reports import ReportStore
from bourse.services.accounts import AdminService, DemoRule, admin_key_hash, bootstrap_demo
from bourse.services.admin_key import seed_admin_key
from bourse.services.auth import Authenticator
from bourse.services.billing import Billing
from bourse.services.clock import DatabaseClock
from bourse.services.completion import CompletionService, Limits
from bourse.services.dashboard import Dashboard
from bourse.services.drain import Drain
from bourse.services.housekeeping import Housekeeping
from bourse.services.jobs import JobLimits, JobService
from bourse.services.market import Market
from bourse.services.probes import Prober
from bourse.services.request_feed import RequestFeed
from bourse.services.responses import ResponseLimits, ResponseService
from bourse.services.sessions import Sessions
from bourse.services.tape import MarketTape
from bourse.settings import Config, Environment
from bourse.storage.audit import SqlAuditLog
from bourse.storage.private import SecretBox, key_notices
from bourse.storage.sql import SqlStore
from bourse.workers import WorkerLink

__all__ = ["Container", "build", "build_engine", "build_store"]

log = logging.getLogger("bourse")


def build_store(database: str | None, data_dir: Path, unavailable_timeout_s: float = 5.0) -> SqlStore:
    if database and database.startswith(("postgresql://", "postgres://")):
        from bourse.storage.postgres import PostgresStore

        return PostgresStore(database, unavailable_timeout_s=unavailable_timeout_s)
    from bourse.storage.sqlite import SqliteStore

    if database and database.startswith("sqlite:///"):
        return SqliteStore(database.removeprefix("sqlite:///"), unavailable_timeout_s=unavailable_timeout_s)
    if database:
        raise ValueError(
            f"database: expected postgresql://… or sqlite:///path, got {database.split(':', 1)[0]}:…"
        )
    return SqliteStore(data_dir / "bourse.db", unavailable_timeout_s=unavailable_timeout_s)


@dataclass
class Container:
    config: Config
    completions: CompletionService
    auth: Authenticator
    admin: AdminService
    store: SqlStore
    billing: Billing
    jobs: JobService
    housekeeping: Housekeeping
    engines: dict[str, Engine] = field(default_factory=dict)
    generated_admin_key: str | None = None
    hub: Any = None
    """The Redis hub (``bourse.coordination.redis_hub.RedisHub``) when ``[cluster] redis_url`` is set."""
    demo_key: str | None = None
    announce: bool = True
    data_dir: Path | None = None
    """Where keys generated at the first start are kept (set by ``bourse serve``)."""
    reports: ReportStore = field(kw_only=True)
    dashboard: Dashboard = field(kw_only=True)
    observer: Observer = field(default=NULL_OBSERVER, kw_only=True)
    responses: ResponseService = field(kw_only=True)
    prober: Prober = field(default_factory=Prober, kw_only=True)
    adopt_secret_key: bool = field(default=False, kw_only=True)
    """``serve --adopt-secret-key``: this gateway's key seals the database's webhook
    secrets from now on, whichever sealed them before."""
    worker_peers: WorkerPeers | None = field(default=None, kw_only=True)
    """Under ``serve --workers``: where this worker answers the others' scrapes."""
    demo: DemoRule = field(default=DemoRule.OFF, kw_only=True)
    """Whether the start makes the ``demo`` account (set by ``bourse serve``: :func:`demo_rule`)."""
    desk: MarketDesk = field(kw_only=True)
    """The live market configuration: its versions in the database, applied here."""
    config_path: str | None = field(default=None, kw_only=True)
    """The config file ``bourse serve`` read (None: the built-in defaults): SIGHUP reads it again."""
    admin_key_hash: str = field(default="", kw_only=True)
    """The configured admin key's hash: the database's admin key if it has none yet."""
    admin_key_source: str = field(default="BOURSE_ADMIN_KEY", kw_only=True)
    """Where the configured admin key came from (for the start's warning; never the key)."""

    @property
    def max_body_bytes(self) -> int:
        return self.config.server.max_body_bytes

    @property
    def max_json_depth(self) -> int:
        return self.config.server.max_json_depth

    @property
    def idempotency_ttl_s(self) -> float:
        return self.config.storage.idempotency_ttl_s

    @property
    def clock(self) -> DatabaseClock:
        return self.billing.clock

    async def start(self) -> None:
        if self.worker_peers is not None:  # first: a peer scraped meanwhile waits for no engine
            await self.worker_peers.start()
        for engine in self.engines.values():
            await engine.start()
        await self.store.open()
        await self._adopt_sealing_key()
        if self.admin_key_hash:
            await seed_admin_key(self.store, self.admin_key_hash, self.clock.now(), self.admin_key_source)
        await self.dashboard.sessions.start()
        if self.hub is not None:
            await self.hub.start()
        for m in self.completions.markets.values():
            await m.book.start()
        await self.prober.start()  # each upstream checked before the first request
        await self.desk.start(self.config.source)  # the database's market, or the file as its next version
        await self.billing.start()
        resumed = await self.jobs.start()
        if resumed:
            log.info("resumed %d jobs left queued or running by the previous run", resumed)
        self.demo_key = await bootstrap_demo(self.admin, self.demo)
        self.housekeeping.start()
        self.responses.start()
        if self.announce:
            for line in key_notices(
                self.data_dir, self.generated_admin_key, self.demo_key, terminal=sys.stderr.isatty()
            ):
                say(line)
        log.info("bourse serving %d products from %s", len(self.completions.markets), self.config.source)

    async def _adopt_sealing_key(self) -> None:
        """Check this gateway's webhook-secret keys against the one its database seals
        with (SealingKeyMismatch on a replica with another key; :func:`sealing_problem`
        says so in one line before ``bourse serve`` gets here); one node takes it over."""
        box = self.store.secret_box
        if box is None:
            return
        take_over = self.store.single_node or self.adopt_secret_key
        adoption = await self.store.adopt_sealing_key(time.time(), take_over=take_over)
        key = f"{box.source} (check value {adoption.fingerprint[:12]}…)"
        if adoption.took_over_from is not None:
            log.warning(
                "webhook secrets: %s seals this database's webhook secrets from now on, instead of the key "
                "%s…; secrets sealed with that key cannot be opened: their webhooks are held until an admin "
                "sets a new secret (POST /admin/accounts/{id}/webhook_secret)",
                key, adoption.took_over_from[:12],
            )  # fmt: skip
        elif adoption.first:
            log.info("webhook secrets: this database seals them with %s", key)
        if adoption.unreadable:
            log.warning(
                "webhook secrets: %d of the first sealed secrets in this database cannot be opened with %s; "
                "their webhooks are held until an admin sets a new secret for each account",
                adoption.unreadable, key,
            )  # fmt: skip

    async def stop(self) -> None:
        await self.desk.stop()
        await self.prober.stop()
        await self.dashboard.stop()
        await self.housekeeping.stop()
        await self.responses.stop()
        await self.jobs.stop()
        for m in self.completions.markets.values():
            await m.aclose()
        if self.hub is not None:
            await self.hub.aclose()
        pending = list(self.completions.background)
        if pending:
            await asyncio.wait(pending, timeout=10)
        await self.billing.stop()
        await self.jobs.sender.aclose()
        for engine in self.engines.values():
            await engine.aclose()
        await self.auth.aclose()
        await self.store.close()
        if self.worker_peers is not None:
            await self.worker_peers.stop()
        self.observer.close()

    async def reload(self) -> None:
        """SIGHUP: the config file's products written as the market's next version
        (:meth:`bourse.market_desk.MarketDesk.reload_file`)."""
        await self.desk.reload_file(self.config_path)

    def app(self) -> ASGIApp:
        return create_app(self, cors_origins=self.config.server.cors_origins)

    def drainer(self, grace_s: float = 0.0) -> Drain:
        """What a stop signal runs before the server stops (``[server] drain_timeout_s``;
        ``grace_s``: the least time the listener stays open, ``/readyz`` saying 503)."""
        return Drain(
            self.completions, self.jobs, self.config.server.drain_timeout_s, self.housekeeping.sweep_once,
            grace_s=grace_s,
        )  # fmt: skip


def unreachable_services(config: Config, env: Environment, database: str | None = None) -> list[str]:
    """Why a configured shared service (PostgreSQL, Redis) cannot be reached, one line
    each; checked before serving so start-up fails with a clear message."""
    problems: list[str] = []
    database = database or env.database or config.storage.database
    if database and database.startswith(("postgresql://", "postgres://")):
        import psycopg

        try:
            psycopg.connect(database, connect_timeout=5).close()
        except Exception as exc:
            problems.append(
                f"cannot reach PostgreSQL ({_redact(database)}): {str(exc).strip().splitlines()[0]}"
            )
    redis_url = env.redis_url or config.cluster.redis_url
    if redis_url:
        import redis

        try:
            client = redis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=5)
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:
            problems.append(f"cannot reach Redis ({_redact(redis_url)}): {exc}")
    return problems


def sealing_problem(container: Container) -> str | None:
    """Why this replica may not serve (one line), checked before serving: its webhook-
    secret keys do not include the one its shared (PostgreSQL) database seals with.
    A new database is named this replica's key here."""
    store = container.store
    if store.single_node or store.secret_box is None or container.adopt_secret_key:
        return None  # one node, or told to take the database over: start() does it, and logs it
    from bourse.storage.postgres import PostgresStore
    from bourse.storage.sealing import SealingKeyMismatch

    assert isinstance(store, PostgresStore)
    probe = PostgresStore(store.dsn, max_size=1)
    probe.secret_box = store.secret_box

    async def check() -> None:
        await probe.open()
        try:
            await probe.adopt_sealing_key(time.time(), take_over=False)
        finally:
            await probe.close()

    for attempt in range(SEALING_ATTEMPTS):
        try:
            asyncio.run(check())
        except SealingKeyMismatch as exc:
            return str(exc)
        except Exception as exc:  # the database went away since it was reached: one line, no traceback
            # a name that did not resolve, or a connection refused, just after the database
            # was reached (a container network's DNS at start): tried again, a second apart
            if attempt + 1 < SEALING_ATTEMPTS and _transient(exc):
                time.sleep(SEALING_RETRY_S)
                continue
            return f"cannot check the webhook-secret key (BOURSE_SECRET_KEY) in the database: {type(exc).__name__}: {exc}"
        return None
    return None


SEALING_ATTEMPTS = 5
"""Checks of the sealing key before a replica gives up on a database it just reached."""
SEALING_RETRY_S = 1.0


def _transient(exc: Exception) -> bool:
    """A connection that could not be made (psycopg's OperationalError), not a refusal."""
    import psycopg

    return isinstance(exc, psycopg.OperationalError)


def instance_id(data_dir: Path) -> str:
    """This gateway's id, kept in the data folder so a restart is the same instance:
    it owns its holds and jobs from before the crash and resumes them at once.
    Each replica needs its own data folder."""
    path = data_dir / "instance_id"
    try:
        value = path.read_text().strip()
        if value.startswith("gw_") and 4 <= len(value) <= 64:
            return value
    except FileNotFoundError:
        pass
    value = "gw_" + os.urandom(8).hex()
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(value + "\n")
    tmp.replace(path)
    return value


def _redact(url: str) -> str:
    """A URL without its password."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        creds, _, host = rest.rpartition("@")
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else f"{scheme}://{user}@{host}"
    return url


def build(
    config: Config,
    *,
    data_dir: str | Path,
    env: Environment | None = None,
    database: str | None = None,
    worker: int = 0,
    link: WorkerLink | None = None,
) -> Container:
    env = env or Environment()
    data = Path(data_dir)
    database = database or env.database or config.storage.database
    redis_url = env.redis_url or config.cluster.redis_url
    owner = instance_id(data) + (f".w{worker}" if worker else "")  # serve --workers: one replica each
    hub = None
    if redis_url:
        from bourse.coordination.redis_hub import RedisHub

        cl = config.cluster
        hub = RedisHub(
            redis_url,
            prefix=cl.key_prefix,
            lease_s=cl.lease_s,
            replica=owner,
            take_up_s=cl.take_up_s,
            park_s=cl.park_s,
        )
        if not (database and database.startswith(("postgresql://", "postgres://"))):
            log.warning(
                "cluster: redis_url is set but the ledger is SQLite; replicas need one PostgreSQL database"
            )

    def make_book(product: str, deployments: list[Deployment], max_waiting: int) -> BookPort:
        if hub is not None:
            from bourse.coordination.book_redis import RedisBook

            return RedisBook(hub, product, deployments, max_waiting=max_waiting)
        return LocalBook(ProductBook(product, deployments, max_waiting=max_waiting))

    store = build_store(database, data, config.storage.unavailable_timeout_s)
    markets: dict[str, Market] = {}
    kind = "postgresql" if database and database.startswith(("postgresql://", "postgres://")) else "sqlite"
    # the observer reads the markets' books when scraped: the dict is filled below
    observer = build_observer(
        config.server, books=markets, store=store, instance=owner, database=kind, link=link
    )
    engines: dict[str, Engine] = {}
    models: dict[str, str] = {}
    prober = Prober()
    builder = MarketBuilder(observer, prober, make_book, engines, models)
    for pname, pconf in config.products.items():
        markets[pname], targets = builder.market(pname, pconf, config.policy_for(pname))
        for target in targets:
            prober.add(target)
    prober.bind(markets)
    store.secret_box = SecretBox.for_folder(data, env.secret_key)
    admin_hash, generated = admin_key_hash(data, env.admin_key)
    clock = DatabaseClock()  # its offset measured by the billing's heartbeat
    auth = Authenticator(store, admin_hash, clock=clock.now, operators=store, admin_keys=store)
    billing = Billing(
        store, owner=owner, lease_s=max(15.0, config.cluster.lease_s * 5), observer=observer, clock=clock
    )
    limits = Limits(config.server.book_timeout_s, config.server.book_timeout_max_s)
    limiter: RateLimiter = MemoryRateLimiter()
    if hub is not None:
        from bourse.coordination.limits_redis import RedisRateLimiter

        limiter = RedisRateLimiter(hub)
    service = CompletionService(
        markets, limits, models, billing=billing, limiter=limiter, auth=auth, observer=observer
    )
    key_file = None if env.admin_key else data / "admin_key"
    admin = AdminService(
        store, auth, products=markets.keys(), audit=SqlAuditLog(store), admin_key_file=key_file
    )
    notes = None
    if hub is not None:
        from bourse.coordination.market_notes import RedisMarketNotes

        notes = RedisMarketNotes(hub)
    desk = MarketDesk(config, markets, builder, prober, store, notes)
    from bourse.outbound.webhook_http import HttpWebhookSender

    j = config.jobs
    jobs = JobService(
        store,
        service,
        HttpWebhookSender(allow_private=j.allow_private_webhooks, allow_loopback=j.allow_loopback_webhooks),
        JobLimits(
            ttl_s=j.ttl_s,
            min_result_s=j.min_result_s,
            max_ttl_s=j.max_ttl_s,
            allow_private_webhooks=j.allow_private_webhooks,
            allow_loopback_webhooks=j.allow_loopback_webhooks,
            webhook_attempts=j.webhook_attempts,
            webhook_backoff_s=j.webhook_backoff_s,
            sweep_interval_s=j.sweep_interval_s,
            max_active=j.max_active,
        ),
        observer=observer,
    )
    st = config.storage
    housekeeping = Housekeeping(
        store,
        interval_s=st.idempotency_purge_interval_s,
        sweeps=(billing.sweeper.sweep, jobs.sweep),
        clock=clock.now,
        sweep_interval_s=st.hold_sweep_interval_s,
        retention_s=st.retention_s,
        retention_interval_s=st.retention_interval_s,
    )
    r = config.responses
    responses = ResponseService(
        store, jobs, ResponseLimits(r.retention_s, r.sweep_interval_s), clock=clock.now
    )
    from bourse.storage.reports import SqlReports

    reports = SqlReports(store)
    shared_refusals = None
    if hub is not None:
        from bourse.coordination.refusals_redis import RedisRefusals

        shared_refusals = RedisRefusals(hub)
    feed = RequestFeed(service, store, shared=shared_refusals)
    observer.on_refused.append(feed.refused)  # the requests refused before the book, listed
    dashboard = Dashboard(
        sessions=Sessions(store, auth, store, clock=clock.now), reports=reports, admin=admin, jobs=jobs,
        tape=MarketTape(markets), feed=feed,
    )  # fmt: skip
    return Container(
        config, service, auth, admin, store, billing, jobs,
        housekeeping=housekeeping, engines=engines, generated_admin_key=generated, hub=hub,
        admin_key_hash=admin_hash, admin_key_source="BOURSE_ADMIN_KEY" if env.admin_key else str(key_file),
        reports=reports, dashboard=dashboard, observer=observer, responses=responses, prober=prober,
        worker_peers=observer.metrics.peers if observer.metrics is not None else None, desk=desk,
    )  # fmt: skip
