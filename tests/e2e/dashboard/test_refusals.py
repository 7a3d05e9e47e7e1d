"""Requests refused before the book, as the dashboard lists them: with the first page
of requests (``refused``: status, error code, key, account), by the session's scope
and the filters, one's detail, and the live stream; the ledger never sees them."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tests.e2e.dashboard.conftest import USER, World
from tests.e2e.dashboard.test_streams import named_events
from tests.support.gateway import ADMIN_KEY

BODY = {"model": "dash-fast", "messages": USER, "max_tokens": 5}


def _post(world: World, key: str, body: dict[str, Any] = BODY) -> httpx.Response:
    return httpx.post(world.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=30)  # fmt: skip


def test_refusals_are_listed_by_scope_and_filter_and_leave_the_ledger_alone(world: World) -> None:
    before = httpx.get(world.url + "/admin/ledger", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    r401 = _post(world, "bk_no_such_key")
    r404 = _post(world, world.keys["alice"], {**BODY, "model": "no-such-product"})
    r400 = _post(world, world.keys["bob"], {**BODY, "max_tokens": -1})
    assert (r401.status_code, r404.status_code, r400.status_code) == (401, 404, 400)
    ids = {r.headers["x-request-id"]: r for r in (r401, r404, r400)}

    with world.browser(ADMIN_KEY) as c:
        doc = c.get("/dashboard/api/requests").json()
        rows = {r["id"]: r for r in doc["refused"]}
        assert set(ids) <= set(rows)
        for rid, r in ids.items():
            row = rows[rid]
            assert (row["outcome"], row["status"], row["error"]) == (
                "refused",
                r.status_code,
                r.json()["error"]["code"],
            )
            assert row["cost_micros"] == 0 and row["deployment"] is None
        assert rows[r401.headers["x-request-id"]]["account"] is None  # no key: no account
        assert rows[r400.headers["x-request-id"]]["account"] == "bob"
        # the filters: an account, a product, the outcome; another outcome lists none
        only_bob = c.get("/dashboard/api/requests", params={"account": "bob"}).json()["refused"]
        assert {r["account"] for r in only_bob} == {"bob"}
        assert c.get("/dashboard/api/requests", params={"outcome": "completed"}).json()["refused"] == []
        refused = c.get("/dashboard/api/requests", params={"outcome": "refused"}).json()
        assert refused["data"] == [] and set(ids) <= {r["id"] for r in refused["refused"]}
        # not on an older page: the first page places them
        assert (
            "refused" not in c.get("/dashboard/api/requests", params={"after": doc["data"][-1]["id"]}).json()
        )
        # one's detail
        detail = c.get(f"/dashboard/api/requests/{r401.headers['x-request-id']}").json()
        assert detail["record"]["error"] == {"code": "invalid_api_key"} and detail["status"] == 401

    with world.browser(world.keys["bob"]) as c:  # a user: their own account's only
        mine = c.get("/dashboard/api/requests").json()["refused"]
        assert r400.headers["x-request-id"] in {r["id"] for r in mine}
        assert {r["account"] for r in mine} == {"bob"}
        r = c.get(f"/dashboard/api/requests/{r404.headers['x-request-id']}")
        assert r.status_code == 404  # alice's
    after = httpx.get(world.url + "/admin/ledger", headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert after == before and after["balanced"] is True


def test_a_refusal_arrives_on_the_requests_stream(world: World) -> None:
    with world.browser(ADMIN_KEY) as c, c.stream("GET", "/dashboard/api/requests/events") as resp:
        seen = named_events(resp)
        assert next(seen)[0] == "ready"
        sent: list[httpx.Response] = []
        t = threading.Thread(target=lambda: sent.append(_post(world, "bk_still_not_a_key")))
        t.start()
        name, row = next(seen)
        t.join()
        assert name == "request" and row["id"] == sent[0].headers["x-request-id"]
        assert (row["outcome"], row["status"], row["error"]) == ("refused", 401, "invalid_api_key")
