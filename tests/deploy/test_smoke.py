"""The deployment smoke client (:mod:`tests.deploy.smoke`, run by scripts/test-deploy
against the container image and each compose replica) against a served gateway: it
passes on a working one, and fails, naming the step, where a step's answer is wrong."""

from __future__ import annotations

import pytest

from tests.deploy import smoke
from tests.support.gateway import ADMIN_KEY, running_gateway

CONFIG = """
[products.sim]
[[products.sim.deployments]]
engine = "sim"
slots = 2
floor = 0.1
tokens_per_s = 0
ttft_ms = 1
"""


def test_smoke_passes_on_a_served_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    with running_gateway(CONFIG) as gw:
        assert smoke.main([gw.url, ADMIN_KEY, "sim", "--account", "smoke-ok"]) == 0
        account = gw.admin("GET", "/admin/accounts/smoke-ok").json()
    out = capsys.readouterr().out
    assert "chat: " in out and "then [DONE]" in out
    assert account["spent_micros"] > 0  # two requests charged to the account it made


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["bk_admin_wrong", "sim"], "/admin/accounts: 403"),  # the admin step
        ([ADMIN_KEY, "no-such-product"], "/admin/keys: 400"),  # the key step
    ],
)
def test_smoke_fails_naming_the_step(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with running_gateway(CONFIG) as gw:
        assert smoke.main([gw.url, *args, "--account", "smoke-bad"]) == 1
    assert said in capsys.readouterr().err


def test_smoke_fails_on_a_stream_without_done() -> None:
    with pytest.raises(smoke.SmokeFailure, match=r"did not end with \[DONE\]"):
        smoke.check_stream(['{"choices": [{"delta": {"content": "hi"}}]}'])
