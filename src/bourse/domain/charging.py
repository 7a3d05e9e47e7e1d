"""What a run's hold becomes: the outcome x policy charging table (pure).

SPEC sections 7, 8 and 12. A run ends with one :data:`Outcome`; its hold is then
settled (charged), released (nothing charged) or kept ``reconciling`` for an
operator. :func:`decide` reads it from one table:

====================  ==================================  ==========================
outcome               charged (when something was made)   missing usage may reconcile
====================  ==================================  ==========================
``completed``         always                              yes
``disconnected``      policy ``charge_on_disconnect``     yes
``canceled``          policy ``charge_on_disconnect``     yes
``error``             policy ``charge_on_error``          yes
``timeout``           never                               no
====================  ==================================  ==========================

A run that produced nothing is never charged, whatever its outcome. "Missing usage
may reconcile": when the engine gave no usage (the gateway counted the tokens) and
the policy says ``missing_usage = "reconcile"``, the hold goes to ``reconciling``
instead of being settled on the gateway's count (or released): an engine that
stopped mid-answer without its usage block leaves the charge to the operator.
"""

from __future__ import annotations

from typing import Literal, assert_never

from bourse.domain.policy import Policy

Outcome = Literal["completed", "disconnected", "canceled", "error", "timeout"]
"""How a run ended."""
RecordedOutcome = Literal["completed", "disconnected", "canceled", "error", "timeout", "reconciling"]
"""The outcome on the receipt and the usage record: ``reconciling`` when the hold waits for an operator."""
Action = Literal["settle", "release", "reconcile"]
"""What happens to the hold."""
ChargedWhen = Literal["always", "never", "charge_on_disconnect", "charge_on_error"]

CHARGING: dict[Outcome, tuple[ChargedWhen, bool]] = {
    # outcome:        (charged when,            missing usage may reconcile)
    "completed": ("always", True),
    "disconnected": ("charge_on_disconnect", True),
    "canceled": ("charge_on_disconnect", True),
    "error": ("charge_on_error", True),
    "timeout": ("never", False),
}


def decide(outcome: Outcome, policy: Policy, *, produced: bool, usage_estimated: bool) -> Action:
    """What the hold of a run that ended with ``outcome`` becomes under ``policy``.

    ``produced``: the engine generated at least one token; ``usage_estimated``: the
    engine gave no usage and the gateway counted the tokens itself."""
    if not produced:
        return "release"
    charged_when, may_reconcile = CHARGING[outcome]
    if may_reconcile and usage_estimated and policy.missing_usage == "reconcile":
        return "reconcile"
    match charged_when:
        case "always":
            return "settle"
        case "never":
            return "release"
        case "charge_on_disconnect":
            knob = policy.charge_on_disconnect
        case "charge_on_error":
            knob = policy.charge_on_error
        case _:
            assert_never(charged_when)
    match knob:  # every word of ``Charge``: a new one is refused here, not charged as nothing
        case "generated":
            return "settle"
        case "none":
            return "release"
        case _:
            assert_never(knob)


def recorded(outcome: Outcome, action: Action) -> RecordedOutcome:
    """The outcome as the receipt and the usage record show it."""
    return "reconciling" if action == "reconcile" else outcome
