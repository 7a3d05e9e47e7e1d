"""A detached job's whole life through the served gateway: submit -> queued (with
position, bid and level, behind a held slot) -> running (tokens so far) -> succeeded
with a result equal to a direct non-streamed request of the same seed, carrying its
usage with cost and its receipt; the balance moves once, by that cost. The same via
``detached: true`` on /v1/chat/completions and on /v1/completions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.jobs.support import (
    Jobs,
    caller,
    chat_body,
    content_of,
    direct,
    slot_held,
    text_body,
    tokens_of,
    usage_records,
)
from tests.e2e.money.support import assert_ledger_balanced
from tests.support.gateway import Gateway, running_gateway

FLOOR = 0.5

CONFIG = f"""
[products.one]
sim_overrides = true
[[products.one.deployments]]
engine = "sim"
name = "one"
slots = 1
floor = {FLOOR}
tokens_per_s = 25
"""


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


def _assert_result_like_direct(job: dict[str, Any], ref: dict[str, Any], obj: str) -> None:
    res = job["result"]
    assert res["object"] == obj, res
    assert res["id"] == job["request_id"], (res["id"], job["request_id"])
    assert res["model"] == "one", res
    assert content_of(res) == content_of(ref), (res, ref)
    assert tokens_of(res) == tokens_of(ref), (res["usage"], ref["usage"])
    assert res["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]


def _assert_charged_once(gw: Gateway, jobs: Jobs, job: dict[str, Any], balance_before: int) -> int:
    res = job["result"]
    usage = res["usage"]
    cost = usage["cost_micros"]
    assert isinstance(cost, int) and cost > 0, usage
    assert usage["cost"] == pytest.approx(cost / 1e6, abs=1e-12), usage
    receipt = res["receipt"]
    assert receipt["cost_micros"] == cost, receipt
    assert receipt["outcome"] == "completed", receipt
    assert 0 < cost <= receipt["quote_micros"], receipt
    # settled by the time the job reads succeeded: the balance moved once, by the cost
    assert gw.balance(jobs.account) == balance_before - cost
    holds = gw.admin("GET", "/admin/holds", params={"account": jobs.account, "state": "open"}).json()["data"]
    assert holds == [], holds
    settled = gw.admin("GET", "/admin/holds", params={"account": jobs.account, "state": "settled"}).json()[
        "data"
    ]
    assert [(h["request_id"], h["charged_micros"]) for h in settled] == [(job["request_id"], cost)], settled
    # one usage record, the same receipt
    recs = [r for r in usage_records(gw.url, jobs.key) if r["id"] == job["request_id"]]
    assert len(recs) == 1, recs
    assert recs[0]["usage"]["cost_micros"] == cost, recs[0]
    assert recs[0]["receipt"]["outcome"] == "completed", recs[0]
    return int(cost)


def test_submit_queued_running_succeeded_equals_direct_request(gw: Gateway) -> None:
    me, jobs = caller(gw, "life")
    other, jobs2 = caller(gw, "life-2")
    before, before2 = me.balance(), other.balance()
    body = chat_body("one", seed=11, tokens=25, max_price=0.8)
    body2 = chat_body("one", seed=12, tokens=5, max_price=0.6)
    with slot_held(gw, "one"):
        job = jobs.submit(body)
        assert job["status"] == "queued", job
        assert job["id"].startswith("job_") and job["object"] == "bourse.job", job
        assert job["created_at"] < job["expires_at"], job
        assert job["request_id"], job
        job2 = jobs2.submit(body2)
        # the book: the higher bid is first, the other behind it
        got = jobs.get(job["id"])
        got2 = jobs2.get(job2["id"])
        assert got["status"] == "queued" and got2["status"] == "queued", (got, got2)
        assert got["queue"]["position"] == 0, got
        assert got["queue"]["bid"] == pytest.approx(0.8), got
        assert got2["queue"]["position"] == 1, got2
        assert got2["queue"]["bid"] == pytest.approx(0.6), got2
        # the level: what a new order must bid to be next (the best bid waiting)
        for g in (got, got2):
            assert g["queue"]["level"] == pytest.approx(0.8), g
        assert "result" not in got and "progress" not in got, got
        # while queued, the hold is placed
        view = me.account_view()
        assert view["open_holds_micros"] > 0, view
    # the slot frees: the job runs, with tokens so far
    running = jobs.wait(job["id"], lambda j: j["status"] == "running" and j["progress"]["tokens"] > 0,
                        what="running with tokens")  # fmt: skip
    assert 0 < running["progress"]["tokens"] <= 25, running
    assert running["progress"]["max_tokens"] == 25, running
    assert "queue" not in running and "result" not in running, running
    assert running["started_at"] is not None, running
    done = jobs.wait_status(job["id"], "succeeded", "failed", "canceled", "expired")
    assert done["status"] == "succeeded", done
    assert done["finished_at"] is not None and done["finished_at"] >= done["started_at"], done
    # second price: the job paid the next best bid still waiting (job2's 0.6), not its own 0.8
    assert done["result"]["usage"]["x_market"]["cleared_price"] == pytest.approx(0.6), done["result"]
    assert done["result"]["usage"]["x_market"]["bid"] == pytest.approx(0.8), done["result"]
    _assert_charged_once(gw, jobs, done, before)
    done2 = jobs2.wait_status(job2["id"], "succeeded", "failed", "canceled", "expired")
    assert done2["status"] == "succeeded", done2
    _assert_charged_once(gw, jobs2, done2, before2)

    ref = direct(gw.url, gw.api_key, body)
    _assert_result_like_direct(done, ref, "chat.completion")
    ref2 = direct(gw.url, gw.api_key, body2)
    _assert_result_like_direct(done2, ref2, "chat.completion")
    # a finished job reads the same again
    assert jobs.get(job["id"]) == done
    assert_ledger_balanced(gw)


@pytest.mark.parametrize(
    ("path", "make", "obj"),
    [
        ("/v1/chat/completions", chat_body, "chat.completion"),
        ("/v1/completions", text_body, "text_completion"),
    ],
    ids=["chat", "completions"],
)
def test_detached_true_on_the_endpoint_answers_202_with_a_job(
    gw: Gateway, path: str, make: Any, obj: str
) -> None:
    me, jobs = caller(gw, "detached")
    before = me.balance()
    body = make("one", seed=23, tokens=8)
    with slot_held(gw, "one"):
        r = httpx.post(gw.url + path, json={**body, "detached": True}, headers=jobs.auth, timeout=30)
        assert r.status_code == 202, (r.status_code, r.text)
        job = r.json()
        assert job["status"] == "queued" and job["id"].startswith("job_"), job
        assert job["endpoint"] == path, job
        assert r.headers.get("x-request-id") == job["request_id"], (dict(r.headers), job)
        got = jobs.get(job["id"])
        assert got["status"] == "queued" and got["queue"]["position"] == 0, got
        assert got["queue"]["bid"] == pytest.approx(FLOOR), got
    done = jobs.wait_status(job["id"], "succeeded", "failed", "canceled", "expired")
    assert done["status"] == "succeeded", done
    _assert_charged_once(gw, jobs, done, before)
    # the job appears in the caller's list
    listed = jobs.list()["data"]
    assert [j["id"] for j in listed] == [job["id"]], listed
    ref = direct(gw.url, gw.api_key, body, path)
    _assert_result_like_direct(done, ref, obj)
    assert_ledger_balanced(gw)


@pytest.mark.parametrize("via", ["jobs", "detached"])
def test_idempotency_key_on_submit_gives_one_job(gw: Gateway, via: str) -> None:
    """SPEC 2: ``Idempotency-Key`` on every POST. A retried submit (same key, same body)
    must not create (and charge) a second job; another body with the key is 409."""
    me, jobs = caller(gw, "idem")
    before = me.balance()
    body = chat_body("one", seed=5, tokens=3)
    headers = {**jobs.auth, "idempotency-key": "submit-once"}

    def post(b: dict[str, Any]) -> httpx.Response:
        if via == "jobs":
            return httpx.post(gw.url + "/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": b},
                              headers=headers, timeout=30)  # fmt: skip
        return httpx.post(
            gw.url + "/v1/chat/completions", json={**b, "detached": True}, headers=headers, timeout=30
        )

    first = post(body)
    assert first.status_code == 202, first.text
    jobs.wait_status(first.json()["id"], "succeeded")
    again = post(body)
    assert again.status_code == 202, again.text
    assert again.json()["id"] == first.json()["id"], (first.json(), again.json())
    other = post({**body, "seed": 6})
    assert other.status_code == 409, other.text
    listed = jobs.list()["data"]
    assert [j["id"] for j in listed] == [first.json()["id"]], listed
    cost = jobs.get(first.json()["id"])["result"]["usage"]["cost_micros"]
    assert me.balance() == before - cost
