"""A job's webhook: when the job ends, its ``webhook_url`` (a receiver on 127.0.0.1,
allowed by ``[jobs] allow_loopback_webhooks`` in this test config) gets one signed
POST of the final job; a first attempt answered 500 is retried after the backoff,
and once one attempt succeeds nothing more is sent. The signature
(``t=<unix>,v1=<hex HMAC-SHA256 of "t.body">``) verifies with the account's webhook
secret, as the admin API returned it."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.services.webhooks import verify
from tests.e2e.jobs.support import Jobs, chat_body, unique
from tests.support.gateway import Gateway, running_gateway
from tests.support.servers import serve_app_in_thread

CONFIG = """
[products.one]
sim_overrides = true
[[products.one.deployments]]
engine = "sim"
slots = 2
floor = 1.0

[jobs]
allow_loopback_webhooks = true
webhook_backoff_s = 0.2
webhook_attempts = 4
sweep_interval_s = 0.2
"""


@dataclass
class Delivery:
    at: float
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    """Answers each path's first POST with 500, later ones with 200; records all."""

    url: str = ""
    fail_first: int = 1
    seen: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def for_path(self, path: str) -> list[Delivery]:
        with self.lock:
            return [d for d in self.seen if d.path == path]

    def wait(self, path: str, n: int, timeout: float = 15.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.for_path(path)
            if len(got) >= n or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


def _receiver_app(rec: Receiver) -> Starlette:
    async def hook(request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        with rec.lock:
            earlier = sum(1 for d in rec.seen if d.path == path)
            status = 500 if earlier < rec.fail_first else 200
            rec.seen.append(Delivery(time.time(), path, dict(request.headers), body, status))
        return Response(b"nope" if status == 500 else b"ok", status_code=status)

    return Starlette(routes=[Route("/hook/{name}", hook, methods=["POST"])])


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    rec = Receiver()
    with serve_app_in_thread(_receiver_app(rec)) as url:
        assert url.startswith("http://127.0.0.1:"), url
        rec.url = url
        yield rec


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


def _account_with_secret(gw: Gateway) -> tuple[Jobs, str]:
    account = unique("hook")
    r = gw.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": 5.0})
    assert r.status_code == 201, r.text
    r = gw.admin("POST", "/admin/keys", json={"account": account})
    assert r.status_code == 201, r.text
    doc = r.json()
    secret = doc.get("webhook_secret")
    assert isinstance(secret, str) and len(secret) >= 16, doc
    return Jobs(gw.url, doc["key"], account), secret


def _recompute(secret: str, header: str, body: bytes) -> bool:
    parts = dict(p.split("=", 1) for p in header.split(","))
    mac = hmac.new(secret.encode(), parts["t"].encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(mac, parts["v1"])


def test_one_signed_delivery_after_a_500(gw: Gateway, receiver: Receiver) -> None:
    jobs, secret = _account_with_secret(gw)
    path = "/hook/" + jobs.account
    job = jobs.submit(chat_body("one", tokens=5), webhook_url=receiver.url + path)
    assert job["webhook_url"] == receiver.url + path, job
    final = jobs.wait_status(job["id"], "succeeded", "failed", "canceled", "expired")
    assert final["status"] == "succeeded", final
    got = receiver.wait(path, 2)
    assert [d.answered for d in got] == [500, 200], got
    first, second = got
    # retried after the backoff (0.2 s), not at once
    assert second.at - first.at >= 0.15, (first.at, second.at)
    # the successful delivery: signed, the final job
    sig = second.headers.get("x-bourse-signature")
    assert sig is not None, second.headers
    assert sig.startswith("t=") and ",v1=" in sig, sig
    t = int(sig.split(",")[0][2:])
    assert abs(t - time.time()) < 60, sig
    assert verify(secret, sig, second.body), (sig, second.body[:200])
    assert _recompute(secret, sig, second.body)
    assert not verify(secret, sig, second.body + b" "), "a changed body must not verify"
    assert not verify("not-the-secret", sig, second.body)
    assert second.headers.get("content-type", "").startswith("application/json"), second.headers
    doc: dict[str, Any] = json.loads(second.body)
    assert doc["id"] == job["id"] and doc["status"] == "succeeded", doc
    assert doc["request_id"] == job["request_id"], doc
    assert doc["result"] == final["result"], (doc, final)
    assert doc["result"]["usage"]["cost_micros"] > 0, doc
    # the failed attempt carried the same final job, signed too
    assert json.loads(first.body)["status"] == "succeeded"
    assert verify(secret, first.headers["x-bourse-signature"], first.body)
    # exactly one successful delivery: nothing more arrives (sweeps run every 0.2 s)
    time.sleep(1.5)
    after = receiver.for_path(path)
    assert len(after) == 2, [(d.answered, d.at) for d in after]


def test_a_canceled_job_is_delivered_too(gw: Gateway, receiver: Receiver) -> None:
    jobs, secret = _account_with_secret(gw)
    path = "/hook/" + jobs.account
    job = jobs.submit(chat_body("one", tokens=200, sim={"output_tokens": 200, "tokens_per_s": 20}),
                      webhook_url=receiver.url + path)  # fmt: skip
    jobs.wait(job["id"], lambda j: j["status"] == "running")
    jobs.cancel(job["id"])
    got = receiver.wait(path, 2)
    assert [d.answered for d in got] == [500, 200], got
    assert verify(secret, got[1].headers["x-bourse-signature"], got[1].body)
    doc = json.loads(got[1].body)
    assert doc["id"] == job["id"] and doc["status"] == "canceled", doc
    assert got[1].headers.get("x-bourse-event") == "job.canceled", got[1].headers
