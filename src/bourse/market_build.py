"""Building one product's market, or one deployment of it, from its config: the
engine, the deployment's book state (floor, slots, breaker, availability), the probe
target and the :class:`~bourse.services.market.Market`.

:func:`build_engine` makes an engine; :class:`MarketBuilder` is what the composition
root (:func:`bourse.container.build`) and the live market (:mod:`bourse.market_desk`,
a product or deployment added while serving) both build with, so a product added
live is built as one read at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import assert_never

from bourse.domain.availability import Availability
from bourse.domain.book import Deployment
from bourse.domain.breaker import CircuitBreaker
from bourse.domain.policy import Policy
from bourse.ports.book import BookPort
from bourse.ports.engine import Engine, Probed
from bourse.ports.observer import Observer
from bourse.services.market import Market
from bourse.services.probes import START_RETRY_S, Prober, ProbeTarget
from bourse.settings import DeploymentConfig, ProductConfig, deployment_name

MakeBook = Callable[[str, list[Deployment], int], BookPort]
"""(product, its deployments, max_waiting) -> its book: in process, or the shared one."""


def build_engine(
    product: str,
    dep: DeploymentConfig,
    name: str | None = None,
    context_length: int = 8192,
    availability: Availability | None = None,
) -> tuple[Engine, str]:
    """The engine of one deployment (``name``: the deployment's, for its log lines;
    ``context_length``: the product's, which the sim engine enforces) and the model
    name it expects in requests."""
    match dep.engine:
        case "sim":
            from bourse.engines.sim import SimEngine, SimSettings

            settings = SimSettings.from_mapping({**dep.sim_settings(), "context_length": context_length})
            return SimEngine(settings, model_name=product), product
        case "llamacpp":
            from bourse.engines.llamacpp import LlamaCppEngine

            return LlamaCppEngine(
                dep.model_path, slots=dep.configured_slots(), n_ctx=dep.n_ctx, n_threads=dep.n_threads,
                chat_format=dep.chat_format, name=product,
            ), product  # fmt: skip
        case "openai":
            return _openai_engine(product, dep, name, availability)
        case _:  # the config admits no other kind; one that got past it is refused, named
            assert_never(dep.engine)


def _openai_engine(
    product: str, dep: DeploymentConfig, name: str | None, availability: Availability | None
) -> tuple[Engine, str]:
    from bourse.engines.openai_http import OpenAIHTTPEngine

    assert dep.base_url is not None and dep.model is not None
    tokens = None
    if dep.tokenizer is not None:
        from bourse.engines.upstream_tokens import GGUFTokens

        tokens = GGUFTokens(dep.tokenizer, n_ctx=dep.upstream_n_ctx(), chat_format=dep.upstream_chat_format(),
                            name=name or product)  # fmt: skip
    engine = OpenAIHTTPEngine(
        dep.base_url,
        dep.model,
        dep.api_key.get_secret_value() if dep.api_key is not None else None,
        connect_timeout_s=dep.connect_timeout_s,
        first_byte_timeout_s=dep.first_byte_timeout_s,
        read_timeout_s=dep.read_timeout_s,
        max_connections=dep.max_connections,
        unary=not dep.always_stream,
        name=name or product,
        api=dep.api,
        flavor=dep.flavor,
        availability=availability if dep.probe_interval_s > 0 else None,
        tokens=tokens,
    )
    return engine, dep.model


@dataclass(slots=True)
class Built:
    """One deployment built: its book state, its engine, its probe target (None: not probed)."""

    deployment: Deployment
    engine: Engine
    target: ProbeTarget | None


@dataclass(slots=True)
class MarketBuilder:
    observer: Observer
    prober: Prober
    make_book: MakeBook
    engines: dict[str, Engine]
    """Every engine of the gateway by deployment name (closed at stop): filled here."""
    models: dict[str, str]
    """Each deployment's model name, as its engine expects it: filled here."""

    def deployment(self, product: str, index: int, pconf: ProductConfig, dconf: DeploymentConfig) -> Built:
        name = deployment_name(product, index, dconf)
        availability = Availability(
            hold_s=max(5.0, 3 * (dconf.probe_interval_s or START_RETRY_S)),
            on_change=partial(self.prober.changed, product, name),
        )
        engine, model = build_engine(product, dconf, name, pconf.context_length, availability)
        self.engines[name] = engine
        self.models[name] = model
        deployment = Deployment(
            name,
            dconf.floor,
            dconf.configured_slots(),
            breaker=CircuitBreaker(
                threshold=dconf.breaker_threshold,
                cooldown_s=dconf.cooldown_s,
                on_change=partial(self.observer.breaker_changed, product, name),
            ),
            availability=availability,
        )
        target = None
        if isinstance(engine, Probed):
            target = ProbeTarget(product, deployment, engine, dconf.probe_interval_s, dconf.slots)
        return Built(deployment, engine, target)

    def market(self, product: str, pconf: ProductConfig, policy: Policy) -> tuple[Market, list[ProbeTarget]]:
        """The product's market (not started) and its deployments' probe targets."""
        built = [self.deployment(product, i, pconf, d) for i, d in enumerate(pconf.deployments)]
        deployments = [b.deployment for b in built]
        book = self.make_book(product, deployments, pconf.max_waiting)
        market = Market(
            product,
            book,
            {b.deployment.name: b.engine for b in built},
            policy,
            default_bid=pconf.default_bid,  # None: the lowest available floor, order by order
            context_length=pconf.context_length,
            max_output_tokens=pconf.max_output_tokens,
            supports_tools=supports_tools(pconf),
            description=pconf.description,
            breakers=[d.breaker for d in deployments],
            deployments=deployments,
            observer=self.observer,
            sim_overrides=pconf.takes_sim_overrides(),
            stall_timeout_s=pconf.stall_timeout_s,
        )
        return market, [b.target for b in built if b.target is not None]


def supports_tools(pconf: ProductConfig) -> bool:
    """``supports_tools`` as set, else whether no deployment runs on llamacpp."""
    if pconf.supports_tools is not None:
        return pconf.supports_tools
    return all(d.engine != "llamacpp" for d in pconf.deployments)
