"""Requests refused before the book on one replica are listed by every replica's
dashboard (issue 38: the floor lists refusals): they are kept in Redis, shared by the
replicas, not in the memory of the one that answered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.e2e.cluster.test_two_replicas import ADMIN_KEY, Cluster, cluster  # noqa: F401  (the fixture)
from tests.support.bodies import USER


@contextmanager
def _signed_in(url: str) -> Iterator[httpx.Client]:
    """A dashboard session on ``url``, signed in as the operator."""
    with httpx.Client(base_url=url, timeout=30, headers={"origin": url}) as c:
        r = c.post("/dashboard/api/session", json={"key": ADMIN_KEY})
        assert r.status_code == 200, r.text
        c.headers["x-csrf-token"] = r.json()["csrf"]
        yield c


def test_a_refusal_on_one_replica_is_listed_by_the_other(cluster: Cluster) -> None:  # noqa: F811
    body = {"model": "shared", "messages": USER, "max_tokens": 5}
    r401 = httpx.post(cluster.urls[1] + "/v1/chat/completions", json=body,
                      headers={"authorization": "Bearer bk_no_such_key"}, timeout=30)  # fmt: skip
    r404 = httpx.post(cluster.urls[1] + "/v1/chat/completions", json={**body, "model": "nope"},
                      headers={"authorization": f"Bearer {cluster.key}"}, timeout=30)  # fmt: skip
    assert (r401.status_code, r404.status_code) == (401, 404)
    want = {r401.headers["x-request-id"]: 401, r404.headers["x-request-id"]: 404}
    with _signed_in(cluster.urls[0]) as c:
        deadline = time.monotonic() + 5
        while True:
            rows = {r["id"]: r for r in c.get("/dashboard/api/requests").json()["refused"]}
            if set(want) <= set(rows) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert {rid: rows[rid]["status"] for rid in want if rid in rows} == want
        assert rows[r404.headers["x-request-id"]]["account"] == "acme"
        assert rows[r401.headers["x-request-id"]]["error"] == "invalid_api_key"
        # one's detail, asked of the replica that did not answer it
        detail = c.get(f"/dashboard/api/requests/{r404.headers['x-request-id']}").json()
        assert detail["status"] == 404 and detail["record"]["error"]["code"] == "model_not_found"
        # by filter: another account's refusals are not acme's
        only = c.get("/dashboard/api/requests", params={"account": "acme"}).json()["refused"]
        assert r404.headers["x-request-id"] in {r["id"] for r in only}
        assert r401.headers["x-request-id"] not in {r["id"] for r in only}
    with _signed_in(cluster.urls[1]) as c:  # the replica that answered lists each once
        ids = [r["id"] for r in c.get("/dashboard/api/requests").json()["refused"]]
        assert sorted(i for i in ids if i in want) == sorted(want)
