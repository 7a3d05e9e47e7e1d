"""CSV exports: ``GET /v1/usage?format=csv`` (a key's page, the JSON list's filters and
paging), ``GET /admin/usage.csv`` (every account over a time range) and the
dashboard's download. Each row says what the JSON record says."""

from __future__ import annotations

import time

import httpx

from tests.e2e.dashboard.conftest import World
from tests.support.gateway import ADMIN_KEY
from tests.support.usage_rows import assert_row_is_record, parse_csv


def _rows(r: httpx.Response) -> list[dict[str, str]]:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/csv; charset=utf-8"
    assert r.headers["content-disposition"].startswith("attachment;")
    return parse_csv(r.text)


def test_v1_usage_csv_pages_like_the_json(world: World) -> None:
    auth = {"authorization": f"Bearer {world.keys['alice']}"}
    everything = world.usage_json("alice", limit="100").json()["data"]
    assert len(everything) == 4
    after: str | None = None
    seen: list[dict[str, str]] = []
    while True:
        params = {"limit": "3", "format": "csv", **({"after": after} if after else {})}
        r = httpx.get(world.url + "/v1/usage", params=params, headers=auth)
        page = _rows(r)
        js = world.usage_json("alice", limit="3", **({"after": after} if after else {})).json()
        assert [row["request_id"] for row in page] == [d["id"] for d in js["data"]]
        assert r.headers["x-has-more"] == str(js["has_more"]).lower()
        seen += page
        if not js["has_more"]:
            assert "x-next-after" not in r.headers
            break
        assert r.headers["x-next-after"] == js["next_after"]
        after = js["next_after"]
    assert len(seen) == 4
    for row, rec in zip(seen, everything, strict=True):
        assert_row_is_record(row, rec, "alice")
    bad = httpx.get(world.url + "/v1/usage", params={"format": "xml"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"
    # the same time filters as the JSON list
    future = httpx.get(
        world.url + "/v1/usage", params={"format": "csv", "since": time.time() + 3600}, headers=auth
    )
    assert _rows(future) == []


def test_admin_usage_csv_has_every_account_in_a_range(world: World) -> None:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.get(world.url + "/admin/usage.csv", headers=admin)
    rows = _rows(r)
    by_account: dict[str, int] = {}
    for row in rows:
        by_account[row["account"]] = by_account.get(row["account"], 0) + 1
    assert by_account["alice"] == 4 and by_account["bob"] == 2
    created = [float(row["created"]) for row in rows]
    assert created == sorted(created, reverse=True), "newest first"
    now = time.time()
    assert _rows(httpx.get(world.url + "/admin/usage.csv", params={"since": now + 60}, headers=admin)) == []
    assert _rows(httpx.get(world.url + "/admin/usage.csv", params={"until": now - 600}, headers=admin)) == []
    window = {"since": now - 600, "until": now + 60}
    assert len(_rows(httpx.get(world.url + "/admin/usage.csv", params=window, headers=admin))) == len(rows)
    only = _rows(
        httpx.get(
            world.url + "/admin/usage.csv", params={"account": "bob", "product": "dash-fast"}, headers=admin
        )
    )
    assert len(only) == 2 and {row["account"] for row in only} == {"bob"}
    assert httpx.get(world.url + "/admin/usage.csv").status_code == 401
    user = {"authorization": f"Bearer {world.keys['alice']}"}
    assert httpx.get(world.url + "/admin/usage.csv", headers=user).status_code == 403
    bad = httpx.get(world.url + "/admin/usage.csv", params={"since": "10", "until": "5"}, headers=admin)
    assert bad.status_code == 400


def test_dashboard_download_is_the_sessions_records(world: World) -> None:
    with world.browser(world.keys["bob"]) as c:
        rows = _rows(c.get("/dashboard/api/usage.csv", params={"since": 0}))
        records = world.usage_json("bob", limit="100").json()["data"]
        assert [row["request_id"] for row in rows] == [d["id"] for d in records]
        for row, rec in zip(rows, records, strict=True):
            assert_row_is_record(row, rec, "bob")
        # a user asking for another account gets their own
        again = _rows(c.get("/dashboard/api/usage.csv", params={"since": 0, "account": "alice"}))
        assert {row["account"] for row in again} == {"bob"}
    with world.browser(ADMIN_KEY) as c:
        rows = _rows(c.get("/dashboard/api/usage.csv", params={"since": 0, "outcome": "completed"}))
        assert {"alice", "bob"} <= {row["account"] for row in rows}
