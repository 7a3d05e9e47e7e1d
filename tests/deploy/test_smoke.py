"""The deployment smoke client (:mod:`tests.deploy.smoke`, run by scripts/test-deploy
against the container image and each compose replica) against a served gateway: it
passes on a working one, and fails, naming the step, where a step's answer is wrong."""

from __future__ import annotations

import http.server
import json
import threading

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


class _Busy(http.server.BaseHTTPRequestHandler):
    """A gateway's chat route for a moment unable to serve: 503 with ``retry-after``
    ``busy`` times, then a chat answer."""

    busy = 2
    asked = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        type(self).asked += 1
        if type(self).asked <= type(self).busy:
            self._answer(503, {"error": {"code": "no_capacity"}}, {"retry-after": "0"})
        else:
            message = {"content": "hi", "role": "assistant"}
            self._answer(
                200, {"choices": [{"message": message, "finish_reason": "stop"}], "usage": {"cost_micros": 1}}
            )

    def _answer(self, status: int, body: dict[str, object], headers: dict[str, str] | None = None) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {
            "content-type": "application/json",
            "content-length": str(len(raw)),
            **(headers or {}),
        }.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("busy", "passes"), [(smoke.RETRIES, True), (smoke.RETRIES + 1, False)])
def test_a_503_with_retry_after_is_asked_again_up_to_retries_times(busy: int, passes: bool) -> None:
    _Busy.busy, _Busy.asked = busy, 0
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Busy) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            if passes:
                assert smoke.chat(base, "bk_x", "sim") == "2 characters, 1 micro-USD"
            else:
                with pytest.raises(smoke.SmokeFailure, match="503"):
                    smoke.chat(base, "bk_x", "sim")
        finally:
            server.shutdown()
    assert _Busy.asked == smoke.RETRIES + 1  # the first ask and RETRIES more
