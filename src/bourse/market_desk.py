"""The live market configuration (issue 37): the products, deployments, floors, slots,
default bids and policies in force, kept in the database and applied on every replica
without a restart.

The database holds versions (:class:`~bourse.ports.market.MarketVersion`): the newest
is in force. :class:`MarketDesk`, one per replica:

- at start, seeds the first version from the config file, or writes the file as a new
  version when it was edited since it was last applied (its digest differs), or else
  takes the database's version (a price set live survives a restart);
- :meth:`MarketDesk.change` writes the next version (an admin route, ``bourse admin
  config apply``, SIGHUP), with its audit entry in the same transaction, applies it
  here and tells the other replicas (Redis, :class:`~bourse.ports.market.MarketNotes`);
- every replica applies a newer version when told, and checks for one every
  :data:`POLL_S` (a replica that missed the note catches up there).

Applying a version (:func:`plan`, then :meth:`MarketDesk._apply`): a floor, slots or
default bid changes in place (:mod:`bourse.live_terms`: a price applies to orders
admitted after it, fewer slots admit nothing new until the slots in use fall under
them); a product's other terms (policy, limits, description) are retuned in place; a
deployment added is built, started and probed before it takes an order; one removed
or changed takes no new order, and its engine is closed once nothing runs on it here
(:data:`RETIRE_MAX_S` at most); a product added is built and started; one removed
answers ``model_not_found`` to new requests while its running ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from bourse import live_terms
from bourse.domain.errors import GatewayError
from bourse.market_build import MarketBuilder, supports_tools
from bourse.ports.engine import Engine
from bourse.ports.market import Edit, MarketConflict, MarketNotes, MarketStore, MarketVersion, Outcome
from bourse.ports.stores import audit_entry
from bourse.services.market import Market
from bourse.services.probes import Prober
from bourse.settings import (
    Config,
    ConfigError,
    DeploymentConfig,
    ProductConfig,
    deployment_name,
    load_config,
    parse_config,
)

log = logging.getLogger("bourse.market")

SIGHUP = "sighup"
"""The audit log's actor of a change a SIGHUP applied."""
POLL_S = 1.0
"""How often a replica checks the database for a newer version (the heartbeat)."""
RETIRE_MAX_S = 3600.0
"""The longest a retired engine or product is kept open for what still runs there."""
MAX_PRODUCTS = 1000
ATTEMPTS = 5
"""Writes tried when other replicas write versions at the same time."""

Products = dict[str, ProductConfig]


# -- the products' tables ------------------------------------------------------------------


def product_table(p: ProductConfig) -> dict[str, Any]:
    """A product as the config file writes it (JSON types; only what was set; no secret)."""
    out: dict[str, Any] = p.model_dump(
        mode="json", exclude_unset=True, exclude={"policy_overrides", "deployments"}
    )
    out.update(p.policy_overrides)
    out["deployments"] = [d.model_dump(mode="json", exclude_unset=True) for d in p.deployments]
    return out


def products_doc(products: Mapping[str, ProductConfig]) -> dict[str, Any]:
    return {name: product_table(p) for name, p in products.items()}


def digest(doc: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()


def parse_products(doc: Any, source: str, secrets: Products | None = None) -> Products:
    """The products of a document (its ``api_key_env`` read from this process's
    environment); ConfigError naming each problem. A deployment's literal ``api_key``
    is never stored: it is taken from ``secrets`` (the config file's) by name."""
    if not isinstance(doc, dict):
        raise ConfigError(source, ["products: expected a table of products"])
    if len(doc) > MAX_PRODUCTS:
        raise ConfigError(source, [f"products: at most {MAX_PRODUCTS}"])
    products = dict(parse_config({"products": doc}, source).products)
    if secrets:
        keys = {
            deployment_name(n, i, d): d.api_key
            for n, p in secrets.items()
            for i, d in enumerate(p.deployments)
            if d.api_key is not None and d.api_key_env is None
        }
        for name, p in products.items():
            deps = [
                d.model_copy(update={"api_key": keys[k]})
                if d.api_key is None and (k := deployment_name(name, i, d)) in keys
                else d
                for i, d in enumerate(p.deployments)
            ]
            products[name] = p.model_copy(update={"deployments": deps})
    return products


# -- what a new version changes --------------------------------------------------------------


@dataclass
class ProductPlan:
    terms: list[live_terms.Change] = field(default_factory=list)
    retune: list[str] = field(default_factory=list)
    """The product's other terms changed (their names)."""
    added: list[int] = field(default_factory=list)
    """Indexes in the new product's deployments."""
    removed: list[str] = field(default_factory=list)
    rebuilt: dict[str, list[str]] = field(default_factory=dict)
    """Deployment -> what changed that needs it built again (an engine's settings)."""

    def __bool__(self) -> bool:
        return bool(self.terms or self.retune or self.added or self.removed or self.rebuilt)


@dataclass
class Plan:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, ProductPlan] = field(default_factory=dict)

    def lines(self, new: Products) -> list[str]:
        out = [f"product {n} added" for n in self.added] + [f"product {n} removed" for n in self.removed]
        for name, pp in self.changed.items():
            if pp.retune:
                out.append(f"product {name}: {', '.join(pp.retune)} changed")
            out += [c.line() for c in pp.terms]
            deps = new[name].deployments
            out += [f"deployment {name}/{deployment_name(name, i, deps[i])} added" for i in pp.added]
            out += [f"deployment {name}/{d} removed" for d in pp.removed]
            out += [f"deployment {name}/{d}: {', '.join(w)} changed" for d, w in pp.rebuilt.items()]
        return out


def plan(old: Products, new: Products) -> Plan:
    """What turns the products ``old`` into ``new``."""
    out = Plan(sorted(set(new) - set(old)), sorted(set(old) - set(new)))
    for name in sorted(set(old) & set(new)):
        a, b = old[name], new[name]
        pp = ProductPlan()
        live = live_terms.LIVE_PRODUCT | {"policy_overrides"}
        pp.retune = live_terms.fields_changed(a, b, live)
        if a.policy_overrides != b.policy_overrides:
            pp.retune.append("policy knobs")
        if a.default_bid != b.default_bid:
            pp.terms.append(live_terms.Change(name, None, "default_bid", a.default_bid, b.default_bid))
        before = live_terms.by_name(name, a.deployments)
        after = {deployment_name(name, i, d): (i, d) for i, d in enumerate(b.deployments)}
        pp.removed = sorted(set(before) - set(after))
        pp.added = sorted(i for n, (i, _) in after.items() if n not in before)
        sim_context = a.context_length != b.context_length
        for dep in sorted(set(before) & set(after)):
            x, y = before[dep], after[dep][1]
            what = live_terms.fields_changed(x, y, live_terms.LIVE_DEPLOYMENT)
            if sim_context and y.engine == "sim":
                what.append("context_length")  # the sim engine enforces the product's
            if what:
                pp.rebuilt[dep] = what
                continue
            if x.floor != y.floor:
                pp.terms.append(live_terms.Change(name, dep, "floor", x.floor, y.floor))
            if x.slots != y.slots:
                pp.terms.append(live_terms.Change(name, dep, "slots", x.slots, y.slots))
        if pp:
            out.changed[name] = pp
    return out


# -- the desk --------------------------------------------------------------------------------


class MarketDesk:
    def __init__(
        self,
        config: Config,
        markets: dict[str, Market],
        builder: MarketBuilder,
        prober: Prober,
        store: MarketStore,
        notes: MarketNotes | None = None,
        *,
        clock: Callable[[], float] = time.time,
        poll_s: float = POLL_S,
    ) -> None:
        self.config = config
        """The config in force: the file's settings with the database's products."""
        self._file = config.products
        self._markets = markets
        self._builder = builder
        self._prober = prober
        self._store = store
        self._notes = notes
        self._clock = clock
        self._poll_s = poll_s
        self.version = 0
        """The version in force here."""
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loops: list[asyncio.Task[None]] = []

    # -- start and stop --------------------------------------------------------------------

    async def start(self, source: str) -> None:
        """Seed, or take the file as a new version, or take the database's (see the module)."""
        doc = products_doc(self._file)
        seed = digest(doc)
        for _ in range(ATTEMPTS):
            latest = await self._store.latest_market()
            if latest is None:
                try:
                    await self._store.put_market(
                        MarketVersion(1, doc, seed, f"config-file:{source}", self._clock()),
                        audit=audit_entry(f"config-file:{source}", "market.seed", "market", {"version": 1}),
                    )
                except MarketConflict:
                    continue
                self.version = 1
                break
            if await self._store.last_file_digest() != seed:
                out = await self.change(lambda _: doc, f"config-file:{source}", file_digest=seed, sync=False)
                await self.sync()
                for line in out.changes:
                    log.warning(
                        "market: the config file %s changed since it was last applied: %s", source, line
                    )
                break
            await self.sync()
            break
        else:
            raise RuntimeError("market: the first version could not be written")
        self._loops.append(asyncio.create_task(self._poll(), name="bourse-market-poll"))
        if self._notes is not None:
            self._loops.append(
                asyncio.create_task(self._notes.listen(self._heard), name="bourse-market-notes")
            )

    async def stop(self) -> None:
        for task in [*self._loops, *self._tasks]:
            task.cancel()
        for task in [*self._loops, *self._tasks]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._loops.clear()
        self._tasks.clear()

    async def _heard(self, version: int) -> None:
        if version > self.version:
            await self.sync()

    async def _poll(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._poll_s)
            try:
                if await self._store.market_version() > self.version:
                    await self.sync()
                failing = False
            except Exception as exc:  # the database is away: the next beat tries again
                if not failing:
                    log.warning("market: the newest version could not be read (%s)", type(exc).__name__)
                failing = True

    # -- reading and changing ---------------------------------------------------------------

    async def current(self) -> MarketVersion:
        latest = await self._store.latest_market()
        if latest is None:
            raise GatewayError(503, "unavailable", "The market has no version yet.")
        return latest

    async def change(
        self,
        edit: Edit,
        actor: str,
        *,
        action: str = "market.change",
        target: str = "market",
        dry_run: bool = False,
        file_digest: str | None = None,
        sync: bool = True,
    ) -> Outcome:
        """Write the version ``edit`` makes of the newest one's products, apply it here
        and tell the other replicas. 400 ``invalid_config`` naming each problem."""
        for _ in range(ATTEMPTS):
            latest = await self.current()
            doc = edit(copy.deepcopy(dict(latest.products)))
            try:
                new = parse_products(doc, "the new market", self._file)
                old = parse_products(latest.products, "the market in force", self._file)
            except ConfigError as exc:
                raise GatewayError(400, "invalid_config", "; ".join(exc.problems)) from None
            lines = plan(old, new).lines(new)
            if dry_run:
                return Outcome(latest.version, lines, applied=False)
            if not lines and (file_digest is None or await self._store.last_file_digest() == file_digest):
                return Outcome(latest.version, lines, applied=False)
            version = MarketVersion(latest.version + 1, products_doc(new), file_digest, actor, self._clock())
            detail = {"version": version.version, "changes": lines[:200]}
            try:
                await self._store.put_market(version, audit=audit_entry(actor, action, target, detail))
            except MarketConflict:
                continue
            for line in lines:
                log.warning("market v%d (%s): %s", version.version, actor, line)
            if sync:
                await self.sync()
            if self._notes is not None:
                try:
                    await self._notes.publish(version.version)
                except Exception as exc:  # the others catch up on their next beat
                    log.warning(
                        "market: the note of v%d was not sent (%s)", version.version, type(exc).__name__
                    )
            return Outcome(version.version, lines, applied=True)
        raise GatewayError(409, "conflict", "The market was changed by others meanwhile; try again.")

    async def sync(self) -> None:
        """Apply the newest version if it is newer than the one in force here."""
        async with self._lock:
            latest = await self._store.latest_market()
            if latest is None or latest.version <= self.version:
                return
            try:
                new = parse_products(latest.products, f"market v{latest.version}", self._file)
            except ConfigError as exc:  # e.g. an api_key_env missing on this replica
                log.error("market v%d cannot be applied here: %s", latest.version, "; ".join(exc.problems))
                self.version = latest.version
                return
            old = dict(self.config.products)
            await self._apply(old, new)
            self.config = self.config.model_copy(update={"products": new})
            self.version = latest.version

    async def reload_file(self, path: str | None) -> None:
        """``SIGHUP``: the config file read again; its products written as the next
        version (each change logged and audited, actor ``sighup``), what else changed
        named as needing a restart. A file that cannot be used changes nothing."""
        if path is None:
            log.warning("SIGHUP: no config file to read again (serving the built-in defaults)")
            return
        try:
            edited = load_config(path)
        except ConfigError as exc:
            for line in exc.lines():
                log.error("SIGHUP: %s", line)
            log.error("SIGHUP: nothing changed")
            return
        self._file = edited.products
        doc = products_doc(edited.products)
        try:
            out = await self.change(lambda _: doc, SIGHUP, file_digest=digest(doc))
        except GatewayError as exc:
            log.error("SIGHUP: %s; nothing changed", exc.message)
            return
        for line in out.changes:
            log.warning("SIGHUP: %s", line)
        restart = live_terms.sections_changed(self.config, edited)
        for line in restart:
            log.warning("SIGHUP: %s: needs a restart, not applied", line)
        if not out.changes and not restart:
            log.info("SIGHUP: %s: nothing changed", path)

    # -- applying -----------------------------------------------------------------------------

    async def _apply(self, old: Products, new: Products) -> None:
        p = plan(old, new)
        config = self.config.model_copy(update={"products": new})
        for name in p.added:
            await self._add_product(name, new[name], config)
        for name, pp in p.changed.items():
            await self._change_product(name, old[name], new[name], pp, config)
        for name in p.removed:
            self._remove_product(name)

    async def _add_product(self, name: str, pconf: ProductConfig, config: Config) -> None:
        market, targets = self._builder.market(name, pconf, config.policy_for(name))
        for engine in market.engines.values():
            await engine.start()
        await market.book.start()
        await self._prober.add_live(targets)
        self._markets[name] = market
        log.warning("market: product %s added (%d deployments)", name, len(pconf.deployments))

    def _remove_product(self, name: str) -> None:
        market = self._markets.pop(name, None)
        if market is None:
            return
        self._prober.remove(name)
        log.warning("market: product %s removed; what runs there finishes", name)
        self._spawn(self._close_market(market))

    async def _change_product(
        self, name: str, old: ProductConfig, new: ProductConfig, pp: ProductPlan, config: Config
    ) -> None:
        market = self._markets[name]
        deps = {deployment_name(name, i, d): (i, d) for i, d in enumerate(new.deployments)}
        for i in pp.added:
            await self._add_deployment(market, name, i, new, new.deployments[i])
        for dep in pp.rebuilt:
            await self._add_deployment(market, name, deps[dep][0], new, deps[dep][1], replacing=True)
        for dep in pp.removed:
            self._prober.remove(name, dep)
            self._retire(market, dep, market.retire_deployment(dep))
        live_terms.apply({name: market}, self._prober, pp.terms)
        market.retune(
            config.policy_for(name),
            context_length=new.context_length,
            max_output_tokens=new.max_output_tokens,
            supports_tools=supports_tools(new),
            sim_overrides=new.takes_sim_overrides(),
            stall_timeout_s=new.stall_timeout_s,
            max_waiting=new.max_waiting,
            description=new.description,
        )

    async def _add_deployment(
        self, market: Market, product: str, index: int, pconf: ProductConfig, dconf: DeploymentConfig,
        *, replacing: bool = False,
    ) -> None:  # fmt: skip
        built = self._builder.deployment(product, index, pconf, dconf)
        await built.engine.start()
        if built.target is not None:  # probed before it takes an order
            if replacing:
                self._prober.remove(product, built.deployment.name)
            await self._prober.add_live([built.target])
        if replacing:
            old = market.replace_deployment(built.deployment, built.engine)
            self._retire(market, built.deployment.name, old)
        else:
            market.add_deployment(built.deployment, built.engine)

    def _retire(self, market: Market, deployment: str, engine: Engine) -> None:
        self._spawn(self._close_engine(market, deployment, engine))

    async def _close_engine(self, market: Market, deployment: str, engine: Engine) -> None:
        """Close ``engine`` once nothing runs on ``deployment`` here (at most RETIRE_MAX_S)."""
        await _idle(lambda: market.held_on(deployment) == 0)
        try:
            await engine.aclose()
        finally:
            market.closed_engine(deployment, engine)

    async def _close_market(self, market: Market) -> None:
        def idle() -> bool:
            return not market.book.waiting_here() and not any(
                market.held_on(d) for d in market.deployment_names
            )

        await _idle(idle)
        await market.aclose()
        for engine in [*market.engines.values(), *market.retired_engines.values()]:
            await engine.aclose()

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _idle(idle: Callable[[], bool]) -> None:
    """Once ``idle()`` (checked each second), or after RETIRE_MAX_S."""
    for _ in range(int(RETIRE_MAX_S)):
        if idle():
            return
        await asyncio.sleep(1.0)
