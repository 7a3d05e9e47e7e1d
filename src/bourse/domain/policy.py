"""Per-product policies (SPEC section 12): the knobs and the named presets.

A :class:`Policy` is immutable; a product's policy is its preset with the
product's own overrides applied (:func:`resolve_policy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

UsageChunk = Literal["opt_in", "always"]
OnDisconnect = Literal["cancel", "drain"]
Charge = Literal["generated", "none"]
MissingUsage = Literal["estimate", "reconcile"]
ReasoningField = Literal["reasoning_content", "reasoning"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "usage_chunk": ("opt_in", "always"),
    "on_disconnect": ("cancel", "drain"),
    "charge_on_disconnect": ("generated", "none"),
    "charge_on_error": ("none", "generated"),
    "missing_usage": ("estimate", "reconcile"),
    "reasoning_field": ("reasoning_content", "reasoning"),
    "receipt_name": ("receipt", "hips"),
}


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
    receipt_name: str = "receipt"
    """Name of the top-level receipt object in the usage chunk (``hips`` for preset hips)."""
    header_prefix: str = "x-bourse-"
    """Prefix of the receipt headers (``x-hips-`` for preset hips)."""


PRESETS: dict[str, Policy] = {
    "default": Policy(),
    # 000: no [DONE] after an error frame, the error frame is the bare envelope,
    # the receipt object is named `hips`.
    "hips": Policy(
        name="hips",
        done_after_error=False,
        error_finish_reason=False,
        receipt_name="hips",
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

KNOBS: frozenset[str] = frozenset(f.name for f in fields(Policy)) - {"name", "receipt_name", "header_prefix"}


def resolve_policy(preset: str, overrides: Mapping[str, Any]) -> Policy:
    """The preset named ``preset`` with ``overrides`` applied; ValueError names a bad key."""
    if preset not in PRESETS:
        raise ValueError(f"policy: expected one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    base = PRESETS[preset]
    changes: dict[str, Any] = {}
    for key, value in overrides.items():
        if key not in KNOBS:
            raise ValueError(f"{key}: not a policy knob (knobs: {', '.join(sorted(KNOBS))})")
        if key in _CHOICES:
            if value not in _CHOICES[key]:
                raise ValueError(f"{key}: expected one of {', '.join(_CHOICES[key])}, got {value!r}")
        elif key in ("done_after_error", "error_finish_reason"):
            if not isinstance(value, bool):
                raise ValueError(f"{key}: expected true or false, got {value!r}")
        elif key == "quiet_interval_s":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.05 <= value <= 3600:
                raise ValueError(f"{key}: expected a number of seconds from 0.05 to 3600, got {value!r}")
            value = float(value)
        elif key == "max_requeues" and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20
        ):
            raise ValueError(f"{key}: expected an integer from 0 to 20, got {value!r}")
        changes[key] = value
    return replace(base, **changes)
