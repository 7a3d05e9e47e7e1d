"""Live market terms: the floors, slots and default bids that change in place on a
serving gateway (issue 37), and the comparison helpers :mod:`bourse.market_desk`
plans a new market version with.

:func:`apply` applies term changes to the live markets:

- a deployment's ``floor``: orders admitted after the change clear against it; an order
  already admitted keeps its price (its admission carries it);
- a deployment's ``slots``: more slots admit waiting orders at once; fewer admit nothing
  new until the slots in use fall under the new count, and nothing running is cut (the
  probes still cap a configured count to what the engine runs, as at start);
- a product's ``default_bid`` (unset: the lowest available floor, as at start).

:func:`sections_changed` names what only a restart applies (a ``[server]`` setting, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from bourse.domain.values import immutable
from bourse.services.market import Market
from bourse.services.probes import DEFAULT_SLOTS, Prober
from bourse.settings import Config, DeploymentConfig, deployment_name

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


def sections_changed(live: Config, edited: Config) -> list[str]:
    """The sections other than ``[products]`` that differ (only a restart applies them)."""
    return [
        f"[{section}] changed"
        for section in sorted(set(type(live).model_fields) - {"products", "source"})
        if _dump(getattr(live, section)) != _dump(getattr(edited, section))
    ]


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


def by_name(product: str, deployments: Iterable[DeploymentConfig]) -> dict[str, DeploymentConfig]:
    return {deployment_name(product, i, d): d for i, d in enumerate(deployments)}


def _dump(model: Any, exclude: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = model.model_dump(mode="json", exclude=set(exclude))
    return out


def fields_changed(old: Any, new: Any, live: frozenset[str]) -> list[str]:
    a, b = _dump(old, exclude=live), _dump(new, exclude=live)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _shown(value: float | int | None) -> str:
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
