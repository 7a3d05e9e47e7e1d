"""Fail fast (issue 13 item 5), with a real ``bourse serve`` process in front of upstreams
that cannot serve:

- once every deployment of a product has an open circuit breaker, a request gets 503
  ``no_capacity`` at once, with ``retry-after`` the cool-down left, and no connection
  is attempted upstream;
- ``connect_timeout_s`` bounds a connect that gets no answer (well before
  ``first_byte_timeout_s``);
- connect errors and timeouts are logged at WARNING with the deployment's name and the
  failure's kind (one line each, the observer's).

Before the fix a request to a product whose breakers were open waited in the book for
the cool-down (then tried again, and waited again), and nothing was logged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.dead_upstream import DyingUpstream
from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_fail_fast_test"
USER = [{"role": "user", "content": "Tell me about the market."}]
COOLDOWN_S = 30
NO_WAIT_S = 0.5
"""The 503 is meant to come within 50 ms; the bound allows for a loaded machine."""


@pytest.fixture
def slamming() -> Iterator[DyingUpstream]:
    """Passes the start probe, then closes each request's connection at once."""
    with DyingUpstream("m") as up:
        yield up


@pytest.fixture
def unanswered() -> Iterator[DyingUpstream]:
    """Passes the start probe; silenced once the gateway serves."""
    with DyingUpstream("m") as up:
        yield up


def _config(slam_port: int, silent_port: int) -> str:
    return f"""
[server]
log_level = "info"

[products.dead]
[[products.dead.deployments]]
engine = "openai"
name = "dead-upstream"
base_url = "http://127.0.0.1:{slam_port}/v1"
model = "m"
breaker_threshold = 1
cooldown_s = {COOLDOWN_S}
probe_interval_s = 0  # probed at start only (it passes): the breaker is what is tested

[products.silent]
max_requeues = 0
[[products.silent.deployments]]
engine = "openai"
name = "silent-upstream"
base_url = "http://127.0.0.1:{silent_port}/v1"
model = "m"
breaker_threshold = 1000
connect_timeout_s = 0.5
probe_interval_s = 0
first_byte_timeout_s = 60
"""


def _key(url: str) -> dict[str, str]:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(url + "/admin/accounts", json={"id": "ff", "credit_usd": 1.0}, headers=admin, timeout=30)
    assert r.status_code == 201, r.text
    r = httpx.post(url + "/admin/keys", json={"account": "ff"}, headers=admin, timeout=30)
    assert r.status_code == 201, r.text
    return {"authorization": f"Bearer {r.json()['key']}"}


def _log(tmp: Path, name: str) -> str:
    return "".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.log")))


def test_open_breakers_answer_503_at_once_without_touching_the_upstream(
    tmp_path: Path, slamming: DyingUpstream, unanswered: DyingUpstream
) -> None:
    config = _config(slamming.port, unanswered.port)
    with serve_process(tmp_path, "ff", config, tmp_path / "data", ADMIN_KEY) as (url, _proc):
        unanswered.silence()
        auth = _key(url)
        body = {"model": "dead", "messages": USER, "max_tokens": 4}
        # the first request finds the upstream slamming its connection: the breaker opens
        t0 = time.monotonic()
        first = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert first.status_code == 503, first.text
        assert first.json()["error"]["code"] == "no_capacity", first.text
        assert time.monotonic() - t0 < COOLDOWN_S / 2  # no wait for the cool-down
        attempts = slamming.accepted
        assert attempts >= 1

        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(
                url + "/v1/chat/completions", json={**body, "stream": stream}, headers=auth, timeout=60
            )
            took = time.monotonic() - t0
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "no_capacity" and "cooling down" in err["message"], err
            assert 1 <= int(r.headers["retry-after"]) <= COOLDOWN_S, dict(r.headers)
            assert took < NO_WAIT_S, took
        assert slamming.accepted == attempts  # no connection tried while every breaker is open
        # nothing held, nothing charged
        view = httpx.get(url + "/v1/account", headers=auth, timeout=30).json()
        assert view["balance_micros"] == 1_000_000 and view["open_holds_micros"] == 0, view
        assert httpx.get(url + "/readyz", timeout=30).json()["products"]["dead"] is False

        # a connect that gets no answer ends at connect_timeout_s (0.5 s), not first_byte_timeout_s (60 s)
        t0 = time.monotonic()
        r = httpx.post(
            url + "/v1/chat/completions", json={**body, "model": "silent"}, headers=auth, timeout=60
        )
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
        assert time.monotonic() - t0 < 15, time.monotonic() - t0

    log = _log(tmp_path, "ff")
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    assert any("deployment dead-upstream (connect): upstream unreachable" in line for line in warnings), log
    assert any("deployment silent-upstream (timeout): upstream timed out" in line for line in warnings), log
