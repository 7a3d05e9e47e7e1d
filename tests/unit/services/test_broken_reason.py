"""Why a product cannot serve at all (:meth:`Market.broken_reason`, read for every
request): every engine broken, or every deployment unavailable (its probes fail, or its
engine is broken); None as soon as one deployment can serve."""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from bourse.coordination.book_local import LocalBook
from bourse.domain.book import Deployment, ProductBook
from bourse.domain.policy import PRESETS
from bourse.ports.engine import Engine
from bourse.services.market import Market


class _Engine:
    def __init__(self, broken: str | None) -> None:
        self.broken = broken


def _market(engines: dict[str, str | None], probes: dict[str, str | None]) -> Market:
    deployments = [Deployment(name, 0.1, 1) for name in probes]
    for d in deployments:
        d.availability.reason = probes[d.name]
    book = LocalBook(ProductBook("p", deployments or [Deployment("other", 0.1, 1)]))
    return Market(
        "p",
        book,
        cast(dict[str, Engine], {name: _Engine(b) for name, b in engines.items()}),
        PRESETS["default"],
        default_bid=None,
        context_length=4096,
        max_output_tokens=64,
        supports_tools=False,
        sim_overrides=False,
        stall_timeout_s=30.0,
        deployments=deployments,
    )


def _spelled(engines: dict[str, str | None], probes: dict[str, str | None]) -> str | None:
    """The rule, spelled out: every engine broken (their reasons), else every deployment
    unavailable (each one's reason: its probe's, else its engine's), else None."""
    reasons = list(engines.values())
    if reasons and all(reasons):
        return "; ".join(str(r) for r in reasons)
    out: list[Any] = []
    for name, probe in probes.items():
        why = probe or engines.get(name)
        if why is not None:
            out.append((name, why))
    if probes and len(out) == len(probes):
        return "; ".join(f"deployment {name} is unavailable: {why}" for name, why in out)
    return None


REASON = st.sampled_from([None, None, "", "model failed to load", "probe failed"])
NAMES = st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True, max_size=4)


@settings(max_examples=400, deadline=None)
@given(NAMES, NAMES, st.data())
def test_broken_reason_is_the_rule(engine_names: list[str], deployment_names: list[str], data: Any) -> None:
    engines = {n: data.draw(REASON) for n in engine_names}
    probes = {n: data.draw(REASON) for n in deployment_names}
    assert _market(engines, probes).broken_reason() == _spelled(engines, probes)


def test_one_deployment_that_can_serve_is_enough() -> None:
    assert _market({"a": "gone", "b": None}, {"a": None, "b": None}).broken_reason() is None
    assert _market({"a": "gone", "b": "gone"}, {"a": None, "b": None}).broken_reason() == "gone; gone"
    assert (
        _market({"a": None, "b": None}, {"a": "down", "b": "down"}).broken_reason()
        == "deployment a is unavailable: down; deployment b is unavailable: down"
    )
