"""The composition root: builds engines, markets and services from a :class:`Config`.

The only module that imports adapters (``bourse.engines``, ``bourse.storage``).
Nothing is built at import time; :func:`build` is called by the CLI and the tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from starlette.applications import Starlette

from bourse.domain.book import Deployment, ProductBook
from bourse.domain.breaker import CircuitBreaker
from bourse.http.app import create_app
from bourse.ports.engine import Engine
from bourse.services.completion import CompletionService, Limits
from bourse.services.market import Market
from bourse.settings import Config, DeploymentConfig, deployment_name

log = logging.getLogger("bourse")


def build_engine(product: str, dep: DeploymentConfig) -> tuple[Engine, str]:
    """The engine of one deployment and the model name it expects in requests."""
    if dep.engine == "sim":
        from bourse.engines.sim import SimEngine, SimSettings

        return SimEngine(SimSettings.from_mapping(dep.sim_settings()), model_name=product), product
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


@dataclass
class Container:
    config: Config
    completions: CompletionService
    engines: dict[str, Engine] = field(default_factory=dict)

    @property
    def max_body_bytes(self) -> int:
        return self.config.server.max_body_bytes

    async def start(self) -> None:
        log.info("bourse serving %d products from %s", len(self.completions.markets), self.config.source)

    async def stop(self) -> None:
        for m in self.completions.markets.values():
            m.close()
        for engine in self.engines.values():
            await engine.aclose()

    def app(self) -> Starlette:
        return create_app(self)


def build(config: Config) -> Container:
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
            supports_tools=pconf.supports_tools,
            description=pconf.description,
        )
    limits = Limits(config.server.book_timeout_s, config.server.book_timeout_max_s)
    service = CompletionService(markets, limits, models)
    return Container(config, service, engines)
