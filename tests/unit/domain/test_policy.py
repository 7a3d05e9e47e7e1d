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
        "error_frame": "envelope",
        "receipt_name": "hips",
        "receipt_quote_field": "quote",
        "receipt_ttft": False,
        "header_prefix": "x-hips-",
        "waiting_comment": "keep-alive",
        "usage_before_error": False,
    }
    assert diff("openfill") == {"on_disconnect": "drain", "error_frame": "envelope"}
    assert diff("aigrid") == {
        "usage_chunk": "always",
        "on_disconnect": "drain",
        "missing_usage": "reconcile",
        "error_frame": "envelope_id",
        "request_id_header": "x-aigrid-invocation",
        "error_fields": ("code", "message"),
        "engine_error_code": "provider_failed",
        "usage_on_last_choice": True,
    }
    assert diff("gopuram") == {
        "usage_chunk": "always",
        "error_finish_reason": True,
        "charge_on_error": "generated",
        "reasoning_field": "reasoning",
        "request_id_header": "x-gopuram-request-id",
        "id_prefix": "gen-",
        "error_fields": ("message", "type", "code"),
        "engine_error_code": "provider_error",
        "engine_error_type": "api_error",
        "split_role_and_finish": True,
    }


def test_the_default_error_frame_has_no_choices() -> None:
    """The frame every client raises on (the AI SDK's openai provider reads a frame with
    ``choices`` as a chunk and drops its error): ``error_finish_reason`` is off by default."""
    default = PRESETS["default"]
    assert (default.error_frame, default.error_finish_reason) == ("chunk", False)


def test_request_ids_and_their_headers() -> None:
    gopuram, aigrid, default = PRESETS["gopuram"], PRESETS["aigrid"], PRESETS["default"]
    assert gopuram.request_id("chatcmpl-abc") == "gen-abc" == gopuram.request_id("gen-abc")
    assert default.request_id("chatcmpl-abc") == "chatcmpl-abc"
    assert gopuram.id_headers("gen-abc") == {"x-request-id": "gen-abc", "x-gopuram-request-id": "gen-abc"}
    assert aigrid.id_headers("r") == {"x-request-id": "r", "x-aigrid-invocation": "r"}
    assert default.id_headers("r") == {"x-request-id": "r"}


def test_engine_errors_by_their_sheet_names() -> None:
    assert PRESETS["aigrid"].engine_error("upstream_error", "upstream_error") == (
        "provider_failed",
        "upstream_error",
    )
    assert PRESETS["gopuram"].engine_error("upstream_error", "upstream_error") == (
        "provider_error",
        "api_error",
    )
    refusal = ("context_length_exceeded", "invalid_request_error")
    assert PRESETS["gopuram"].engine_error(*refusal) == refusal


def test_overrides_and_errors() -> None:
    p = resolve_policy("hips", {"quiet_interval_s": 0.5, "max_requeues": 1})
    assert p.quiet_interval_s == 0.5 and p.max_requeues == 1 and p.receipt_name == "hips"
    with pytest.raises(ValueError, match="policy: expected one of"):
        resolve_policy("nope", {})
    with pytest.raises(ValueError, match="usage_chunk: expected one of opt_in, always"):
        resolve_policy("default", {"usage_chunk": "sometimes"})
    with pytest.raises(ValueError, match="not a policy knob"):
        resolve_policy("default", {"colour": "red"})
