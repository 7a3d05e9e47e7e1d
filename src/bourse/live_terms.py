"""Live market terms: the floors, slots and default bids a running gateway takes from
an edited config file without a restart (``SIGHUP``, issue 37).

:func:`compare` reads two configs (the one in force and the file as it is now) and
returns a :class:`Reload`: the term changes this module applies in place, and every
other difference, named, which only a restart applies (a product or deployment added
or removed, an engine's URL, a policy, a ``[server]`` setting, ...). :func:`apply`
applies the changes to the live markets:

- a deployment's ``floor``: orders admitted after the change clear against it; an order
  already admitted keeps its price (its admission carries it);
- a deployment's ``slots``: more slots admit waiting orders at once; fewer admit nothing
  new until the slots in use fall under the new count, and nothing running is cut (the
  probes still cap a configured count to what the engine runs, as at start);
- a product's ``default_bid`` (unset: the lowest available floor, as at start).

A shared book (Redis) takes each replica's terms with each of its calls: every replica
must be given the same file (``systemctl reload`` each, or ``kill -HUP`` the gateway
with ``--workers``, which tells each worker).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from bourse.domain.values import immutable
from bourse.ports.stores import AuditStore
from bourse.services.market import Market
from bourse.services.probes import DEFAULT_SLOTS, Prober
from bourse.settings import Config, ConfigError, DeploymentConfig, ProductConfig, deployment_name, load_config

log = logging.getLogger("bourse")

ACTOR = "sighup"
"""The audit log's actor of a change a SIGHUP applied."""

Term = Literal["floor", "slots", "default_bid"]
LIVE_PRODUCT: frozenset[str] = frozenset({"default_bid", "deployments"})
"""A product's fields this module applies itself (``deployments`` is compared one by one)."""
LIVE_DEPLOYMENT: frozenset[str] = frozenset({"floor", "slots"})
"""A deployment's fields this module applies itself."""


@immutable
class Change:
    """One term changed: ``deployment`` None for a product's own term."""

    product: str
    deployment: str | None
    term: Term
    old: float | int | None
    new: float | int | None

    def line(self) -> str:
        where = self.product if self.deployment is None else f"{self.product}/{self.deployment}"
        return f"{where} {self.term}: {_shown(self.old)} -> {_shown(self.new)}"


@immutable
class Reload:
    """What an edited file changes: ``changes`` applied live, ``restart`` (one line each)
    only by a restart."""

    changes: tuple[Change, ...]
    restart: tuple[str, ...]


async def reload(
    live: Config, path: str | None, markets: Mapping[str, Market], prober: Prober, audit: AuditStore
) -> Config:
    """``SIGHUP``: the file at ``path`` read again and its live terms applied, each change
    logged (WARNING) and audited; what only a restart applies is named (WARNING). Returns
    the config in force. A file that cannot be used changes nothing (said at ERROR)."""
    if path is None:
        log.warning("SIGHUP: no config file to read again (serving the built-in defaults)")
        return live
    try:
        edited = load_config(path)
    except ConfigError as exc:
        for line in exc.lines():
            log.error("SIGHUP: %s", line)
        log.error("SIGHUP: nothing changed")
        return live
    found = compare(live, edited)
    apply(markets, prober, found.changes)
    for c in found.changes:
        log.warning("SIGHUP: %s", c.line())
        target = c.product if c.deployment is None else f"{c.product}/{c.deployment}"
        try:
            await audit.record(ACTOR, f"market.{c.term}", target, {"old": c.old, "new": c.new, "file": path})
        except Exception as exc:  # applied already: an audit the database refuses is said, not undone
            log.error("SIGHUP: the audit entry of %s was not written (%s)", c.line(), type(exc).__name__)
    for line in found.restart:
        log.warning("SIGHUP: %s: needs a restart, not applied", line)
    if not found.changes and not found.restart:
        log.info("SIGHUP: %s: nothing changed", path)
    return in_force(live, edited)


def compare(live: Config, edited: Config) -> Reload:
    """The differences between the config in force and the edited one."""
    changes: list[Change] = []
    restart: list[str] = []
    for section in sorted(set(type(live).model_fields) - {"products", "source"}):
        if _dump(getattr(live, section)) != _dump(getattr(edited, section)):
            restart.append(f"[{section}] changed")
    for name in sorted(set(live.products) ^ set(edited.products)):
        restart.append(f"product {name} {'added' if name in edited.products else 'removed'}")
    for name in sorted(set(live.products) & set(edited.products)):
        _compare_product(name, live.products[name], edited.products[name], changes, restart)
    return Reload(tuple(changes), tuple(restart))


def _compare_product(
    name: str, old: ProductConfig, new: ProductConfig, changes: list[Change], restart: list[str]
) -> None:
    if _dump(old, exclude=LIVE_PRODUCT) != _dump(new, exclude=LIVE_PRODUCT):
        restart.append(f"product {name}: {', '.join(_fields_changed(old, new, LIVE_PRODUCT))} changed")
    if old.default_bid != new.default_bid:
        changes.append(Change(name, None, "default_bid", old.default_bid, new.default_bid))
    before = _by_name(name, old.deployments)
    after = _by_name(name, new.deployments)
    for dep in sorted(set(before) ^ set(after)):
        restart.append(f"deployment {name}/{dep} {'added' if dep in after else 'removed'}")
    for dep in sorted(set(before) & set(after)):
        a, b = before[dep], after[dep]
        if _dump(a, exclude=LIVE_DEPLOYMENT) != _dump(b, exclude=LIVE_DEPLOYMENT):
            restart.append(
                f"deployment {name}/{dep}: {', '.join(_fields_changed(a, b, LIVE_DEPLOYMENT))} changed"
            )
        if a.floor != b.floor:
            changes.append(Change(name, dep, "floor", a.floor, b.floor))
        if a.slots != b.slots:
            changes.append(Change(name, dep, "slots", a.slots, b.slots))


def apply(markets: Mapping[str, Market], prober: Prober, changes: Iterable[Change]) -> None:
    """Apply ``changes`` (from :func:`compare`) to the live markets, each at once."""
    for c in changes:
        market = markets[c.product]
        if c.term == "default_bid":
            market.set_default_bid(None if c.new is None else float(c.new))
        elif c.term == "floor":
            assert c.deployment is not None and c.new is not None
            market.set_floor(c.deployment, float(c.new))
        else:
            assert c.deployment is not None
            slots = None if c.new is None else int(c.new)
            if not prober.configure(c.product, c.deployment, slots):
                market.set_slots(c.deployment, DEFAULT_SLOTS if slots is None else slots)


def in_force(live: Config, edited: Config) -> Config:
    """The config in force once :func:`apply` took ``edited``'s live terms: ``live``
    with them (what only a restart applies stays as it was, and is found again next time)."""
    products = dict(live.products)
    for name in set(live.products) & set(edited.products):
        old, new = live.products[name], edited.products[name]
        after = _by_name(name, new.deployments)
        deployments = [
            d.model_copy(update={t: getattr(after[n], t) for t in LIVE_DEPLOYMENT}) if n in after else d
            for n, d in _by_name(name, old.deployments).items()
        ]
        products[name] = old.model_copy(update={"default_bid": new.default_bid, "deployments": deployments})
    return live.model_copy(update={"products": products})


def _by_name(product: str, deployments: Iterable[DeploymentConfig]) -> dict[str, DeploymentConfig]:
    return {deployment_name(product, i, d): d for i, d in enumerate(deployments)}


def _dump(model: Any, exclude: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = model.model_dump(mode="json", exclude=set(exclude))
    return out


def _fields_changed(old: Any, new: Any, live: frozenset[str]) -> list[str]:
    a, b = _dump(old, exclude=live), _dump(new, exclude=live)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _shown(value: float | int | None) -> str:
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
