"""Policies: presets differ from the default exactly as SPEC section 12 says."""

from __future__ import annotations

import pytest

from bourse.domain.policy import PRESETS, resolve_policy


def diff(name: str) -> dict[str, object]:
    base, p = PRESETS["default"], PRESETS[name]
    return {
        f: getattr(p, f) for f in p.__dataclass_fields__ if f != "name" and getattr(p, f) != getattr(base, f)
    }


def test_presets() -> None:
    assert diff("hips") == {
        "done_after_error": False,
        "error_finish_reason": False,
        "receipt_name": "hips",
        "receipt_quote_field": "quote",
        "receipt_ttft": False,
        "header_prefix": "x-hips-",
    }
    assert diff("openfill") == {"on_disconnect": "drain"}
    assert diff("aigrid") == {"usage_chunk": "always", "on_disconnect": "drain", "missing_usage": "reconcile"}
    assert diff("gopuram") == {
        "usage_chunk": "always",
        "charge_on_error": "generated",
        "reasoning_field": "reasoning",
    }


def test_overrides_and_errors() -> None:
    p = resolve_policy("hips", {"quiet_interval_s": 0.5, "max_requeues": 1})
    assert p.quiet_interval_s == 0.5 and p.max_requeues == 1 and p.receipt_name == "hips"
    with pytest.raises(ValueError, match="policy: expected one of"):
        resolve_policy("nope", {})
    with pytest.raises(ValueError, match="usage_chunk: expected one of opt_in, always"):
        resolve_policy("default", {"usage_chunk": "sometimes"})
    with pytest.raises(ValueError, match="not a policy knob"):
        resolve_policy("default", {"colour": "red"})
