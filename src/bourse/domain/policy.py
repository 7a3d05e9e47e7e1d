"""Per-product policies (SPEC section 12): the knobs, their allowed values and the named presets.

A :class:`Policy` is immutable; a product's policy is its preset with the
product's own overrides applied (:func:`resolve_policy`). This module is the one
place that names the knobs and their words: the allowed values of a word knob are
its ``Literal`` type, read back with :func:`typing.get_args`, and the config
(:mod:`bourse.settings`) takes the knob names from :data:`KNOBS`.

Besides the knobs, a policy carries the names a preset gives to what the client
sees (the receipt object and its quote field, the header prefix); presets set
them, the config does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args, get_origin, get_type_hints

UsageChunk = Literal["opt_in", "always"]
OnDisconnect = Literal["cancel", "drain"]
Charge = Literal["generated", "none"]
MissingUsage = Literal["estimate", "reconcile"]
ReasoningField = Literal["reasoning_content", "reasoning"]


@dataclass(frozen=True, slots=True)
class Policy:
    name: str = "default"
    usage_chunk: UsageChunk = "opt_in"
    done_after_error: bool = True
    error_finish_reason: bool = True
    on_disconnect: OnDisconnect = "cancel"
    charge_on_disconnect: Charge = "generated"
    charge_on_error: Charge = "none"
    missing_usage: MissingUsage = "estimate"
    quiet_interval_s: float = 2.0
    reasoning_field: ReasoningField = "reasoning_content"
    max_requeues: int = 3
    # -- names (set by presets, not knobs) --
    receipt_name: str = "receipt"
    """Name of the top-level receipt object (``hips`` for preset hips)."""
    receipt_quote_field: str = "quote_micros"
    """Name of the quote in the receipt (``quote`` for preset hips)."""
    receipt_ttft: bool = True
    """Whether the receipt carries ``ttft_ms`` (not in preset hips's receipt)."""
    header_prefix: str = "x-bourse-"
    """Prefix of the receipt headers (``x-hips-`` for preset hips)."""


PRESETS: dict[str, Policy] = {
    "default": Policy(),
    # 000: no [DONE] after an error frame, the error frame is the bare envelope,
    # the receipt object is named `hips` with `cost_micros`, `latency_ms`, `quote`.
    "hips": Policy(
        name="hips",
        done_after_error=False,
        error_finish_reason=False,
        receipt_name="hips",
        receipt_quote_field="quote",
        receipt_ttft=False,
        header_prefix="x-hips-",
    ),
    # 001: a disconnect while running drains the engine and is charged; a failure
    # after start is never charged.
    "openfill": Policy(
        name="openfill", on_disconnect="drain", charge_on_disconnect="generated", charge_on_error="none"
    ),
    # 002: usage chunk always; disconnect drains and settles; missing usage reconciles.
    "aigrid": Policy(name="aigrid", usage_chunk="always", on_disconnect="drain", missing_usage="reconcile"),
    # 004: usage chunk always; error frame with finish_reason "error" then [DONE];
    # disconnect cancels and charges generated; errors charge generated; `reasoning`.
    "gopuram": Policy(
        name="gopuram",
        usage_chunk="always",
        on_disconnect="cancel",
        charge_on_disconnect="generated",
        charge_on_error="generated",
        reasoning_field="reasoning",
    ),
}

_NAMES = frozenset({"name", "receipt_name", "receipt_quote_field", "receipt_ttft", "header_prefix"})
KNOBS: frozenset[str] = frozenset(f.name for f in fields(Policy)) - _NAMES
"""The keys an operator may set per product (SPEC section 12)."""

_TYPES: dict[str, Any] = get_type_hints(Policy)
CHOICES: dict[str, tuple[str, ...]] = {
    k: get_args(t) for k, t in _TYPES.items() if k in KNOBS and get_origin(t) is Literal
}
"""The allowed words of each word knob, from its ``Literal`` type."""
_RANGES: dict[str, tuple[float, float]] = {"quiet_interval_s": (0.05, 3600.0), "max_requeues": (0, 20)}


def check_knob(key: str, value: Any) -> Any:
    """``value`` as the knob ``key`` takes it; ValueError names the key and what it expects."""
    if key not in KNOBS:
        raise ValueError(f"{key}: not a policy knob (knobs: {', '.join(sorted(KNOBS))})")
    kind = _TYPES[key]
    if key in CHOICES:
        if value not in CHOICES[key]:
            raise ValueError(f"{key}: expected one of {', '.join(CHOICES[key])}, got {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {value!r}")
        return value
    low, high = _RANGES[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key}: expected an integer from {low:g} to {high:g}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{key}: expected a number of seconds from {low:g} to {high:g}, got {value!r}")
    return float(value)


def resolve_policy(preset: str, overrides: Mapping[str, Any]) -> Policy:
    """The preset named ``preset`` with ``overrides`` applied; ValueError names a bad key."""
    if preset not in PRESETS:
        raise ValueError(f"policy: expected one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    return replace(PRESETS[preset], **{k: check_knob(k, v) for k, v in overrides.items()})
