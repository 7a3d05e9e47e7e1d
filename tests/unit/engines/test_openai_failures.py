"""The openai engine's failure mapping (:mod:`bourse.engines.openai_failures`): a
configuration error holds the deployment out for a while, then one request tries again;
the API key never shows in a message."""

from __future__ import annotations

import time

import pytest

from bourse.domain.availability import Availability
from bourse.engines import openai_failures
from bourse.engines.openai_failures import UpstreamFailures


def test_a_configuration_error_holds_for_its_while_then_lets_a_request_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    availability = Availability()
    failures = UpstreamFailures("d", "sk-secret", availability)
    assert failures.misrouted() is None
    failure = failures.status_failure(401, b'{"error": {"message": "bad key sk-secret"}}')
    assert failure.kind == "config" and failure.transient and "sk-secret" not in failure.message
    assert failures.misrouted() == failure.message == availability.reason
    now[0] += openai_failures._MISROUTE_HOLD_S - 0.1
    assert failures.misrouted() == failure.message
    now[0] += 0.2
    assert failures.misrouted() is None  # held long enough: the probes may pass again
    assert failures.misrouted() is None
