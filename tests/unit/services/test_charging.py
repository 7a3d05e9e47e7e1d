"""The outcome x policy charging table (domain/charging.py), as a pure function."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest

from bourse.domain.charging import CHARGING, Action, Outcome, decide, recorded
from bourse.domain.policy import PRESETS, Policy

OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

# What the hold becomes when tokens were produced and the engine gave its usage,
# written out by hand from SPEC sections 7, 8 and 12.
EXPECTED: dict[str, dict[Outcome, Action]] = {
    "default": {"completed": "settle", "disconnected": "settle", "canceled": "settle",
                "error": "release", "timeout": "release"},
    "hips": {"completed": "settle", "disconnected": "settle", "canceled": "settle",
             "error": "release", "timeout": "release"},
    "openfill": {"completed": "settle", "disconnected": "settle", "canceled": "settle",
                 "error": "release", "timeout": "release"},
    "aigrid": {"completed": "settle", "disconnected": "settle", "canceled": "settle",
               "error": "release", "timeout": "release"},
    "gopuram": {"completed": "settle", "disconnected": "settle", "canceled": "settle",
                "error": "settle", "timeout": "release"},
}  # fmt: skip


def test_the_table_names_every_outcome_once() -> None:
    assert set(CHARGING) == set(OUTCOMES)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_each_preset_and_outcome(preset: str, outcome: Outcome) -> None:
    policy = PRESETS[preset]
    assert decide(outcome, policy, produced=True, usage_estimated=False) == EXPECTED[preset][outcome]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("estimated", [False, True])
def test_nothing_produced_is_never_charged(preset: str, outcome: Outcome, estimated: bool) -> None:
    assert decide(outcome, PRESETS[preset], produced=False, usage_estimated=estimated) == "release"


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_estimated_usage_reconciles_only_under_the_reconcile_policy(preset: str, outcome: Outcome) -> None:
    policy = PRESETS[preset]
    got = decide(outcome, policy, produced=True, usage_estimated=True)
    if policy.missing_usage == "reconcile" and outcome != "timeout":
        assert got == "reconcile"
    else:
        assert got == EXPECTED[preset][outcome]


def test_the_charge_knobs() -> None:
    base = Policy()
    no_disconnect = replace(base, charge_on_disconnect="none")
    assert decide("disconnected", no_disconnect, produced=True, usage_estimated=False) == "release"
    assert decide("canceled", no_disconnect, produced=True, usage_estimated=False) == "release"
    assert decide("completed", no_disconnect, produced=True, usage_estimated=False) == "settle"
    on_error = replace(base, charge_on_error="generated")
    assert decide("error", on_error, produced=True, usage_estimated=False) == "settle"
    # an engine that failed mid-answer without its usage leaves the charge to an operator
    # (sheet 002: "a provider that stops mid-answer retains its reservation as Reconciling")
    reconcile = replace(on_error, missing_usage="reconcile")
    assert decide("error", reconcile, produced=True, usage_estimated=True) == "reconcile"
    assert decide("error", replace(base, missing_usage="reconcile"), produced=True, usage_estimated=True) == (
        "reconcile"
    )
    # a reconciling disconnect under charge_on_disconnect = none still waits for an operator
    assert (
        decide(
            "disconnected",
            replace(reconcile, charge_on_disconnect="none"),
            produced=True,
            usage_estimated=True,
        )
        == "reconcile"
    )


def test_recorded_outcome() -> None:
    assert recorded("completed", "reconcile") == "reconciling"
    assert recorded("disconnected", "settle") == "disconnected"
    assert recorded("error", "release") == "error"
