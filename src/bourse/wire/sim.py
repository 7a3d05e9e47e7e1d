"""The ``sim`` engine's knobs: their types, their limits, and the body's ``sim`` object.

A request may set the simulator's knobs for itself (``{"sim": {"ttft_ms": 50}}``) when
its product takes per-request sim settings (the product's ``sim_overrides``). This
module holds the one table of knobs (:data:`SIM_KNOBS`): the edge checks the body's
object with it before any hold or order (:func:`parse_sim`, ``bounded=True``, from
:func:`bourse.wire.requests.validate`) and the ``sim`` engine reads both its
deployment's settings (unbounded: the operator's) and each request's object
(bounded) through it.

The per-request bounds keep a request from holding a slot long without producing:
at most :data:`SIM_WAIT_MAX_MS` before its first token and :data:`SIM_STALL_MAX_S` in
one stall, at least :data:`SIM_RATE_MIN` tokens a second once it streams, and at most
:data:`SIM_TOKENS_MAX` tokens; scripted failures at most :data:`SIM_FAILURES_MAX`
attempts. (Whatever a request asks, the product's ``stall_timeout_s`` ends a
generation that goes quiet, on every engine.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from bourse.domain.values import immutable

SIM_WAIT_MAX_MS = 30_000.0
"""The longest ``ttft_ms`` a request may ask for (30 s)."""
SIM_STALL_MAX_S = 30.0
"""The longest ``stall_s`` a request may ask for."""
SIM_RATE_MIN = 1.0
"""The slowest pace a request may ask for: ``tokens_per_s`` is 0 (no pacing) or at least this."""
SIM_RATE_MAX = 1_000_000.0
SIM_TOKENS_MAX = 100_000
"""The most tokens a request may ask of the sim (``output_tokens``, ``max_output_tokens``, and
the positions of ``fail_after_tokens`` and ``stall_after_tokens``)."""
SIM_FAILURES_MAX = 100
"""The most attempts ``fail_before_output`` may fail (-1: every attempt)."""

SIM_CONTEXT_MAX = 10_000_000
"""The largest ``context_length`` a request may give the sim (the window it refuses prompts by)."""

KnobKind = Literal["number", "rate", "int", "int?", "bool"]


@immutable
class Knob:
    """One knob: its kind (``number``: a finite float; ``rate``: 0 or a number from
    :data:`SIM_RATE_MIN`; ``int?``: an integer or null; ``bool``), its least value and
    the most a request may ask for (a deployment's own settings are not capped)."""

    kind: KnobKind
    minimum: float = 0
    request_max: float = 0


SIM_KNOBS: dict[str, Knob] = {
    "ttft_ms": Knob("number", 0, SIM_WAIT_MAX_MS),
    "tokens_per_s": Knob("rate", 0, SIM_RATE_MAX),
    "max_output_tokens": Knob("int", 1, SIM_TOKENS_MAX),
    "fail_before_output": Knob("int", -1, SIM_FAILURES_MAX),
    "fail_after_tokens": Knob("int?", 0, SIM_TOKENS_MAX),
    "stall_after_tokens": Knob("int?", 0, SIM_TOKENS_MAX),
    "stall_s": Knob("number", 0, SIM_STALL_MAX_S),
    "omit_usage": Knob("bool"),
    "tool_call": Knob("bool"),
    "reasoning": Knob("bool"),
    "output_tokens": Knob("int?", 1, SIM_TOKENS_MAX),
    "context_length": Knob("int", 1, SIM_CONTEXT_MAX),
}
"""Every knob of the ``sim`` engine, by the name a config or a request gives it."""


class SimKnobError(ValueError):
    """A bad ``sim`` object; ``param`` is the knob's path (``sim.ttft_ms``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _range(knob: Knob, bounded: bool, low: float | None = None) -> str:
    low = knob.minimum if low is None else low
    return f"from {low:g} to {knob.request_max:g}" if bounded else f">= {low:g}"


def _number(key: str, knob: Knob, value: object, bounded: bool) -> float:
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        number = float(value)
    low = SIM_RATE_MIN if knob.kind == "rate" and bounded else knob.minimum
    if number >= low and (not bounded or number <= knob.request_max):
        return number
    if knob.kind == "rate" and number == 0:
        return number
    zero = "0 (no pacing) or " if knob.kind == "rate" and bounded else ""
    raise SimKnobError(
        f"sim.{key}", f"expected {zero}a number {_range(knob, bounded, low)}, got {_show(value)}"
    )


def _integer(key: str, knob: Knob, value: object, bounded: bool) -> int | None:
    if value is None and knob.kind == "int?":
        return None
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= knob.minimum
        and (not bounded or value <= knob.request_max)
    ):
        return value
    nullable = " or null" if knob.kind == "int?" else ""
    raise SimKnobError(
        f"sim.{key}", f"expected an integer {_range(knob, bounded)}{nullable}, got {_show(value)}"
    )


def parse_sim(overrides: object, *, bounded: bool) -> dict[str, Any]:
    """The knobs of a ``sim`` object (or a deployment's sim settings), typed: numbers as
    floats. ``bounded``: a request's object, held to each knob's ``request_max``.
    :class:`SimKnobError` names the first bad knob."""
    if not isinstance(overrides, Mapping):
        raise SimKnobError("sim", f"expected an object, got {type(overrides).__name__}")
    parsed: dict[str, Any] = {}
    for key, value in overrides.items():
        knob = SIM_KNOBS.get(key) if isinstance(key, str) else None
        if knob is None:
            known = ", ".join(SIM_KNOBS)
            raise SimKnobError(f"sim.{key}", f"expected one of the settings ({known}), got an unknown key")
        if knob.kind == "bool":
            if not isinstance(value, bool):
                raise SimKnobError(f"sim.{key}", f"expected true or false, got {_show(value)}")
            parsed[key] = value
        elif knob.kind in ("number", "rate"):
            parsed[key] = _number(key, knob, value, bounded)
        else:
            parsed[key] = _integer(key, knob, value, bounded)
    return parsed
