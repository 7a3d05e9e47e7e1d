"""A gateway's configuration described in Python and rendered as TOML.

:class:`Product` and :class:`Dep` describe products, their policy knobs and their
deployments (with sim settings); :func:`config_toml` renders them, with optional
``[server]`` and ``[cluster]`` tables, as the config file text that
:func:`bourse.settings.parse_config` reads; every product takes per-request ``sim``
settings (``sim_overrides = true``) unless its knobs say otherwise. How a deployment reaches its engine is
given by ``engine_keys`` (default: the in-process ``sim`` engine with the
deployment's sim settings).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Dep:
    """One deployment: its name, slots, floor, sim settings and other deployment keys."""

    name: str
    slots: int = 4
    floor: float = 0.0
    sim: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Product:
    """One product: its name, deployments and product keys (policy and its knobs)."""

    name: str
    deps: list[Dep]
    knobs: dict[str, Any] = field(default_factory=dict)


EngineKeys = Callable[[Dep], dict[str, Any]]
"""The engine keys of one deployment (``engine = …`` and what that engine needs)."""


def sim_keys(dep: Dep) -> dict[str, Any]:
    """The in-process ``sim`` engine with the deployment's sim settings."""
    return {"engine": "sim", **dep.sim}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"no TOML for {v!r}")


def _table(lines: list[str], header: str, values: dict[str, Any]) -> None:
    lines.append(header)
    for k, v in values.items():
        if v is None:
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    lines.append("")


def config_toml(
    products: list[Product],
    *,
    server: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
    engine_keys: EngineKeys = sim_keys,
) -> str:
    """The config file text of ``products`` (and the ``[server]`` / ``[cluster]`` keys)."""
    lines: list[str] = []
    _table(lines, "[server]", server or {})
    if cluster:
        _table(lines, "[cluster]", cluster)
    for p in products:
        _table(lines, f'[products."{p.name}"]', {"sim_overrides": True, **p.knobs})
        for d in p.deps:
            keys: dict[str, Any] = {"name": d.name, "slots": d.slots, "floor": d.floor}
            keys.update(engine_keys(d))
            keys.update(d.extra)
            _table(lines, f'[[products."{p.name}".deployments]]', keys)
    return "\n".join(lines)
