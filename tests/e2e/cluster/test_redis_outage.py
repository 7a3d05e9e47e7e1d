"""The shared book's Redis goes away and comes back: requests get a clear 503 (never
a 500 or a stack trace) while it is down, and the gateway serves again once it is
back, without a restart.

Uses its own ``redis-server`` child process (so the test can stop it) on a free
port; the suite's shared Redis is not touched.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.bodies import USER
from tests.support.gateway import running_gateway
from tests.support.processes import REDIS_SERVER, free_port, redis_server

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        REDIS_SERVER is None,
        reason="needs the redis-server binary on PATH (Debian: apt-get install redis-server)",
    ),
]


def test_requests_get_503_while_redis_is_down_and_succeed_once_it_is_back(tmp_path: Path) -> None:
    port = free_port()
    config = f"""
[cluster]
redis_url = "redis://127.0.0.1:{port}/0"
lease_s = 1.0

[products.p]
sim_overrides = true
[[products.p.deployments]]
engine = "sim"
slots = 2
floor = 0.1
"""
    with redis_server(port, tmp_path) as first, running_gateway(config) as gw:
        client = gw.client(max_retries=0)
        r = client.chat.completions.create(model="p", messages=USER, extra_body={"sim": {"output_tokens": 3}})
        assert r.choices[0].message.content
        first.kill()
        first.wait()
        with pytest.raises(openai.APIStatusError) as exc:
            client.chat.completions.create(model="p", messages=USER)
        err = exc.value
        assert err.status_code == 503, err.response.text
        body = err.response.json()
        assert body["error"]["code"] == "no_capacity", body
        assert "unreachable" in body["error"]["message"], body
        assert "Traceback" not in err.response.text
        assert int(err.response.headers["retry-after"]) >= 1
        # the market view says the same, as an error envelope
        mv = httpx.get(gw.url + "/v1/market/p", timeout=10)
        assert mv.status_code == 503 and mv.json()["error"]["code"] == "no_capacity", mv.text
        # nothing was charged for the refused request, and nothing stays held
        led = gw.ledger()
        assert led["holds_micros"] == 0, led
        assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"]
        with redis_server(port, tmp_path):
            deadline = time.monotonic() + 15
            while True:
                try:
                    r = client.chat.completions.create(
                        model="p",
                        messages=USER,
                        extra_body={"sim": {"output_tokens": 3}},
                    )
                    break
                except openai.APIStatusError as again:
                    assert again.status_code == 503, again.response.text
                    assert time.monotonic() < deadline, "the gateway did not recover once Redis was back"
                    time.sleep(0.2)
            assert r.choices[0].message.content
            assert r.usage is not None and r.usage.completion_tokens == 3
