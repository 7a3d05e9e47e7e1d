"""Dashboard sessions over HTTP: sign-in by form or script, the cookie's attributes,
sign-out, the origin check and the CSRF token on every action."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.dashboard.conftest import World
from tests.support.gateway import ADMIN_KEY


def _cookie_header(r: httpx.Response) -> str:
    cookies = [v for k, v in r.headers.multi_items() if k == "set-cookie"]
    assert len(cookies) == 1, cookies
    return cookies[0]


def test_script_sign_in_sets_an_http_only_strict_cookie(world: World) -> None:
    with world.browser() as c:
        r = c.post("/dashboard/api/session", json={"key": ADMIN_KEY})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert (
            doc["signed_in"] is True
            and doc["role"] == "owner"
            and doc["operator"] is None
            and doc["account"] is None
        )
        assert set(doc["products"]) == {"dash-fast", "dash-other"}
        cookie = _cookie_header(r)
        attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite", "path", "max-age"} <= attrs, cookie
        assert "samesite=strict" in cookie.lower() and "path=/dashboard" in cookie.lower()
        assert ADMIN_KEY not in cookie and ADMIN_KEY not in r.text
        assert r.headers["cache-control"] == "no-store"
        me = c.get("/dashboard/api/session").json()
        assert me["role"] == "owner" and me["csrf"] == doc["csrf"]


def test_form_sign_in_redirects_and_a_bad_key_sets_nothing(world: World) -> None:
    with world.browser() as c:
        r = c.post("/dashboard/api/session", data={"key": world.keys["alice"]})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard"
        assert "bourse_session" in _cookie_header(r)
        assert c.get("/dashboard/api/session").json()["account"] == "alice"
    with world.browser() as c:
        r = c.post("/dashboard/api/session", data={"key": "bk_nobody"})
        assert r.status_code == 303 and r.headers["location"] == "/dashboard#signin-failed"
        assert "set-cookie" not in r.headers
        r = c.post("/dashboard/api/session", json={"key": "bk_nobody"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "set-cookie" not in r.headers
        for bad in (b"not json", b'{"key": 5}', b"[]"):
            r = c.post("/dashboard/api/session", content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 400, (bad, r.text)


def test_without_a_session_nothing_is_shown(world: World) -> None:
    with world.browser() as c:
        assert c.get("/dashboard/api/session").json() == {"signed_in": False}
        for path in ("accounts", "holds", "requests", "jobs", "spend", "markets", "usage.csv",
                     "markets/dash-fast/events", "requests/events"):  # fmt: skip
            r = c.get(f"/dashboard/api/{path}")
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "not_signed_in"
        c.cookies.set("bourse_session", "v1.e30.forged", domain="127.0.0.1", path="/dashboard")
        assert c.get("/dashboard/api/accounts").status_code == 401


def test_an_api_bearer_key_is_not_a_session(world: World) -> None:
    r = httpx.get(world.url + "/dashboard/api/accounts", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 401


def test_actions_need_the_csrf_token_and_the_same_origin(world: World) -> None:
    hold = world.holds["bob"]
    path = f"/dashboard/api/holds/{hold}/release"
    with world.browser(ADMIN_KEY) as c:
        token = c.headers.pop("x-csrf-token")
        r = c.post(path, json={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
        r = c.post(path, json={}, headers={"x-csrf-token": token[:-2] + "xx"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
        r = c.post(path, json={}, headers={"x-csrf-token": token, "origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site"
        r = c.post(path, json={}, headers={"x-csrf-token": token, "sec-fetch-site": "cross-site"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site"
        # another session's token is not this session's
        with world.browser(ADMIN_KEY) as other:
            r = c.post(path, json={}, headers={"x-csrf-token": other.headers["x-csrf-token"]})
            assert r.status_code == 403
        holds = c.get("/dashboard/api/holds", params={"state": "reconciling"}).json()["data"]
        assert hold in {h["id"] for h in holds}, "a refused action changed nothing"
        # a cross-site sign-in (login CSRF) is refused too
        r = c.post(
            "/dashboard/api/session", data={"key": ADMIN_KEY}, headers={"origin": "http://evil.example"}
        )
        assert r.status_code == 403


def test_sign_out_ends_the_session(world: World) -> None:
    with world.browser(world.keys["alice"]) as c:
        old = c.cookies.get("bourse_session")
        assert old
        r = c.post("/dashboard/api/session/end", json={})
        assert r.status_code == 200 and r.json() == {"signed_in": False}
        assert "bourse_session=" in _cookie_header(r) and "max-age=0" in _cookie_header(r).lower()
        assert c.get("/dashboard/api/session").json() == {"signed_in": False}
    with world.browser() as again:  # the old cookie value, replayed, is refused
        again.cookies.set("bourse_session", old, domain="127.0.0.1", path="/dashboard")
        assert again.get("/dashboard/api/accounts").status_code == 401


@pytest.mark.parametrize(
    "path", ["/dashboard", "/dashboard/", "/dashboard/static/js/app.js", "/dashboard/static/app.css"]
)
def test_pages_and_files_carry_a_strict_csp(world: World, path: str) -> None:
    r = httpx.get(world.url + path)
    assert r.status_code == 200
    csp = r.headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
                      "frame-ancestors 'none'", "require-trusted-types-for 'script'"):  # fmt: skip
        assert directive in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    again = httpx.get(world.url + path, headers={"if-none-match": r.headers["etag"]})
    assert again.status_code == 304


@pytest.mark.parametrize(
    "path", ["/dashboard/static/nope.js", "/dashboard/static/../../settings.py", "/dashboard/static/%2e%2e/guard.py",
             "/dashboard/static/", "/dashboard/static/vendor"],
)  # fmt: skip
def test_only_the_dashboards_files_are_served(world: World, path: str) -> None:
    r = httpx.get(world.url + path)
    assert r.status_code == 404, r.text


def test_behind_a_tls_proxy_the_cookie_is_secure(world: World) -> None:
    host = world.url.removeprefix("http://")
    with world.browser() as c:
        r = c.post("/dashboard/api/session", json={"key": ADMIN_KEY}, headers={"origin": f"https://{host}"})
        assert r.status_code == 200, r.text
        assert "secure" in [a.strip().lower() for a in _cookie_header(r).split(";")]
        r = c.post(
            "/dashboard/api/session", json={"key": ADMIN_KEY}, headers={"origin": "https://elsewhere:1"}
        )
        assert r.status_code == 403
