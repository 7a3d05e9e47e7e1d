"""The composition root: builds engines, stores, markets and services from a
:class:`Config`.

The only module that imports adapters (``bourse.engines``, ``bourse.storage``), and
it imports them lazily, so an optional dependency is needed only when configured.
Nothing is built at import time; :func:`build` is called by the CLI and the tests.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from starlette.types import ASGIApp

from bourse.domain.book import Deployment, ProductBook
from bourse.domain.breaker import CircuitBreaker
from bourse.http.app import create_app
from bourse.ports.engine import Engine
from bourse.services.accounts import AdminService, admin_key_hash, bootstrap_demo
from bourse.services.auth import Authenticator
from bourse.services.billing import Billing
from bourse.services.completion import CompletionService, Limits
from bourse.services.jobs import JobLimits, JobService
from bourse.services.limits import MemoryRateLimiter
from bourse.services.market import Market
from bourse.settings import Config, DeploymentConfig, Environment, deployment_name
from bourse.storage.sql import SqlStore

log = logging.getLogger("bourse")


def build_engine(product: str, dep: DeploymentConfig) -> tuple[Engine, str]:
    """The engine of one deployment and the model name it expects in requests."""
    if dep.engine == "sim":
        from bourse.engines.sim import SimEngine, SimSettings

        return SimEngine(SimSettings.from_mapping(dep.sim_settings()), model_name=product), product
    if dep.engine == "llamacpp":
        from bourse.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(
            dep.model_path, slots=dep.slots, n_ctx=dep.n_ctx, n_threads=dep.n_threads,
            chat_format=dep.chat_format, name=product,
        ), product  # fmt: skip
    from bourse.engines.openai_http import OpenAIHTTPEngine

    assert dep.base_url is not None and dep.model is not None
    engine = OpenAIHTTPEngine(
        dep.base_url,
        dep.model,
        dep.api_key.get_secret_value() if dep.api_key is not None else None,
        connect_timeout_s=dep.connect_timeout_s,
        first_byte_timeout_s=dep.first_byte_timeout_s,
        read_timeout_s=dep.read_timeout_s,
        max_connections=dep.max_connections,
    )
    return engine, dep.model


def build_store(database: str | None, data_dir: Path) -> SqlStore:
    if database and database.startswith(("postgresql://", "postgres://")):
        from bourse.storage.postgres import PostgresStore

        return PostgresStore(database)
    from bourse.storage.sqlite import SqliteStore

    if database and database.startswith("sqlite:///"):
        return SqliteStore(database.removeprefix("sqlite:///"))
    if database:
        raise ValueError(
            f"database: expected postgresql://… or sqlite:///path, got {database.split(':', 1)[0]}:…"
        )
    return SqliteStore(data_dir / "bourse.db")


@dataclass
class Container:
    config: Config
    completions: CompletionService
    auth: Authenticator
    admin: AdminService
    store: SqlStore
    billing: Billing
    jobs: JobService
    engines: dict[str, Engine] = field(default_factory=dict)
    generated_admin_key: str | None = None
    demo_key: str | None = None
    announce: bool = True

    @property
    def max_body_bytes(self) -> int:
        return self.config.server.max_body_bytes

    @property
    def idempotency_ttl_s(self) -> float:
        return self.config.storage.idempotency_ttl_s

    async def start(self) -> None:
        for engine in self.engines.values():
            start = getattr(engine, "start", None)
            if start is not None:
                await start()
        await self.store.open()
        await self.billing.start()
        resumed = await self.jobs.start()
        if resumed:
            log.info("resumed %d jobs left queued or running by the previous run", resumed)
        self.demo_key = await bootstrap_demo(self.admin)
        if self.announce:
            if self.generated_admin_key:
                print(f"bourse: admin key (shown once, kept in the data folder): {self.generated_admin_key}",
                      file=sys.stderr, flush=True)  # fmt: skip
            if self.demo_key:
                print(f"bourse: demo account 'demo' with $5.00 of credit; its API key (shown once): {self.demo_key}",
                      file=sys.stderr, flush=True)  # fmt: skip
        log.info("bourse serving %d products from %s", len(self.completions.markets), self.config.source)

    async def stop(self) -> None:
        await self.jobs.stop()
        for m in self.completions.markets.values():
            m.close()
        pending = list(self.completions.background)
        if pending:
            await asyncio.wait(pending, timeout=10)
        await self.billing.stop()
        await self.jobs.sender.aclose()
        for engine in self.engines.values():
            await engine.aclose()
        await self.store.close()

    def app(self) -> ASGIApp:
        return create_app(self)


def build(
    config: Config, *, data_dir: str | Path, env: Environment | None = None, database: str | None = None
) -> Container:
    env = env or Environment()
    data = Path(data_dir)
    markets: dict[str, Market] = {}
    engines: dict[str, Engine] = {}
    models: dict[str, str] = {}
    for pname, pconf in config.products.items():
        deployments = []
        market_engines: dict[str, Engine] = {}
        for i, dconf in enumerate(pconf.deployments):
            name = deployment_name(pname, i, dconf)
            engine, model = build_engine(pname, dconf)
            engines[name] = market_engines[name] = engine
            models[name] = model
            deployments.append(
                Deployment(
                    name,
                    dconf.floor,
                    dconf.slots,
                    breaker=CircuitBreaker(threshold=dconf.breaker_threshold, cooldown_s=dconf.cooldown_s),
                )
            )
        book = ProductBook(pname, deployments, max_waiting=pconf.max_waiting)
        markets[pname] = Market(
            pname,
            book,
            market_engines,
            config.policy_for(pname),
            default_bid=pconf.default_bid if pconf.default_bid is not None else book.min_floor,
            context_length=pconf.context_length,
            max_output_tokens=pconf.max_output_tokens,
            supports_tools=pconf.supports_tools
            if pconf.supports_tools is not None
            else all(d.engine != "llamacpp" for d in pconf.deployments),
            description=pconf.description,
        )
    store = build_store(database or env.database or config.storage.database, data)
    admin_hash, generated = admin_key_hash(data, env.admin_key)
    auth = Authenticator(store, admin_hash)
    billing = Billing(store)
    limits = Limits(config.server.book_timeout_s, config.server.book_timeout_max_s)
    service = CompletionService(
        markets, limits, models, billing=billing, limiter=MemoryRateLimiter(), auth=auth
    )
    admin = AdminService(store, auth)
    from bourse.outbound.webhook_http import HttpWebhookSender

    j = config.jobs
    jobs = JobService(
        store,
        service,
        HttpWebhookSender(),
        JobLimits(
            ttl_s=j.ttl_s,
            max_ttl_s=j.max_ttl_s,
            allow_private_webhooks=j.allow_private_webhooks,
            allow_loopback_webhooks=j.allow_loopback_webhooks,
            webhook_attempts=j.webhook_attempts,
            webhook_backoff_s=j.webhook_backoff_s,
            sweep_interval_s=j.sweep_interval_s,
            max_active=j.max_active,
        ),
    )
    return Container(
        config, service, auth, admin, store, billing, jobs, engines, generated_admin_key=generated
    )
