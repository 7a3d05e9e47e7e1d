"""A job's result is kept until ``expires_at`` (``ttl_s``), then the sweeper drops it
and the job reads ``expired``. A key sees only its own account's jobs: another
account gets 404 for GET and cancel; GET /v1/jobs lists the caller's jobs, newest
first, paged with ``after`` / ``next_after``."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.jobs.support import Jobs, caller, chat_body, slot_held
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[products.one]
sim_overrides = true
[[products.one.deployments]]
engine = "sim"
slots = 1
floor = 1.0

[jobs]
sweep_interval_s = 0.2
min_result_s = 1
"""
FINAL = ("succeeded", "failed", "canceled", "expired")


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


# -- expiry ------------------------------------------------------------------------------


def test_an_expired_job_reads_expired_and_its_result_is_gone(gw: Gateway) -> None:
    _me, jobs = caller(gw, "exp")
    keep = jobs.submit(chat_body("one", tokens=3))  # the default ttl (24 h)
    job = jobs.submit(chat_body("one", tokens=3), ttl_s=1)
    assert job["expires_at"] == pytest.approx(job["created_at"] + 1, abs=0.01), job
    done = jobs.wait_status(job["id"], *FINAL, timeout=5)
    assert done["status"] == "succeeded" and "result" in done, done
    t0 = time.monotonic()
    gone = jobs.wait_status(job["id"], "expired", timeout=10)
    assert time.time() >= job["expires_at"], "expired before expires_at"
    assert time.monotonic() - t0 < 5, "the sweeper (every 0.2 s) took too long"
    assert "result" not in gone and "error" not in gone, gone
    assert gone["id"] == job["id"] and gone["request_id"] == job["request_id"], gone
    listed = {j["id"]: j for j in jobs.list()["data"]}
    assert listed[job["id"]]["status"] == "expired" and "result" not in listed[job["id"]], listed
    # a job within its ttl keeps its result
    kept = jobs.get(keep["id"])
    assert kept["status"] == "succeeded" and kept["result"]["choices"], kept
    # cancelling an expired job changes nothing
    assert jobs.cancel(job["id"]) == gone
    # the money record is not the job's result: the receipt stays readable
    r = httpx.get(gw.url + f"/v1/usage/{job['request_id']}", headers=jobs.auth, timeout=10)
    assert r.status_code == 200, r.text


def test_a_canceled_job_expires_too(gw: Gateway) -> None:
    _me, jobs = caller(gw, "exp-c")
    with slot_held(gw, "one"):
        job = jobs.submit(chat_body("one", tokens=3), ttl_s=1)
        assert jobs.cancel(job["id"])["status"] == "canceled"
    gone = jobs.wait_status(job["id"], "expired", timeout=10)
    assert "result" not in gone and "error" not in gone, gone


# -- access --------------------------------------------------------------------------------


def test_another_accounts_key_gets_404(gw: Gateway) -> None:
    owner, mine = caller(gw, "own")
    _, theirs = caller(gw, "other")
    with slot_held(gw, "one"):
        job = mine.submit(chat_body("one", tokens=3))
        r = theirs.get_raw(job["id"])
        err = assert_error_envelope(r, 404, "not_found")
        assert job["id"] in err["message"], err
        assert_error_envelope(theirs.cancel_raw(job["id"]), 404, "not_found")
        # the foreign cancel did nothing
        assert mine.get(job["id"])["status"] == "queued"
        assert theirs.list()["data"] == []
        # a second key of the owner's account sees it
        same = Jobs(gw.url, gw.new_key(owner.account), owner.account)
        assert same.get(job["id"])["id"] == job["id"]
    assert mine.wait_status(job["id"], *FINAL)["status"] == "succeeded"
    assert_error_envelope(theirs.get_raw(job["id"]), 404, "not_found")
    assert_error_envelope(mine.get_raw("job_000000000000000000000000"), 404, "not_found")
    assert_error_envelope(mine.cancel_raw("job_000000000000000000000000"), 404, "not_found")


def test_list_is_the_callers_newest_first_and_paged(gw: Gateway) -> None:
    _, mine = caller(gw, "list")
    _, theirs = caller(gw, "list-other")
    ids = []
    for i in range(5):
        ids.append(mine.submit(chat_body("one", seed=i, tokens=2))["id"])
        if i == 2:
            theirs.submit(chat_body("one", tokens=2))
    newest_first = list(reversed(ids))
    whole = mine.list(limit=100)
    assert [j["id"] for j in whole["data"]] == newest_first, whole
    assert whole["has_more"] is False and whole["next_after"] is None, whole
    pages: list[list[str]] = []
    after = None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = mine.list(**params)
        pages.append([j["id"] for j in page["data"]])
        assert page["object"] == "list", page
        if not page["has_more"]:
            assert page["next_after"] is None, page
            break
        assert page["next_after"] == page["data"][-1]["id"], page
        after = page["next_after"]
        assert len(pages) < 10
    assert pages == [newest_first[0:2], newest_first[2:4], newest_first[4:5]], pages
    theirs_ids = {j["id"] for j in theirs.list()["data"]}
    assert len(theirs_ids) == 1 and not theirs_ids & set(ids), theirs_ids
    # a cursor from another account's job yields nothing of theirs
    assert theirs.list(after=ids[0])["data"] == []
    for bad in ("0", "101", "x"):
        r = httpx.get(gw.url + "/v1/jobs", params={"limit": bad}, headers=mine.auth, timeout=10)
        err = assert_error_envelope(r, 400)
        assert err["param"] == "limit", err
    for jid in ids:
        mine.wait_status(jid, *FINAL)
