"""An operator changes the live market from the dashboard (issue 37): each product
route is the admin route's change under a session, audited with the session's actor,
in force at once (``GET /v1/market/{product}``); a dry run answers the lines and
changes nothing; a viewer reads the market's tables and changes nothing; a user
session takes none of it; every write needs the CSRF token and the same origin; a bad
change is 400 ``invalid_config`` and an unknown product 404, changing nothing."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest

from bourse.http.dashboard.roles import BY_NAME
from tests.e2e.dashboard.conftest import World
from tests.support.gateway import ADMIN_KEY

_n = itertools.count()
WRITES = ("market.product.put", "market.product.edit", "market.product.delete")


def _table(product: str, floor: float = 1.0, slots: int = 2) -> dict[str, Any]:
    """A product's table: one sim deployment, ``{product}-a`` (names are unique across products)."""
    return {"deployments": [{"engine": "sim", "name": f"{product}-a", "floor": floor, "slots": slots,
                             "tokens_per_s": 0, "ttft_ms": 0}]}  # fmt: skip


def _product(world: World) -> str:
    """A fresh product (its deployment ``{product}-a``: floor 1, 2 slots), put with the admin key."""
    name = f"cfg-{next(_n)}"
    r = world.gw.admin("PUT", f"/admin/products/{name}", json={"product": _table(name)})
    assert r.status_code == 200 and r.json()["applied"], r.text
    return name


def _version(world: World) -> int:
    version: int = world.gw.admin("GET", "/admin/market").json()["version"]
    return version


def _live(world: World, product: str) -> dict[str, Any] | None:
    r = httpx.get(f"{world.url}/v1/market/{product}", timeout=10)
    if r.status_code == 404:
        return None
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def _audit(world: World, target: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = world.gw.admin("GET", "/admin/audit", params={"target": target}).json()[
        "data"
    ]
    return [e for e in data if e["action"].startswith("market.product.")]


def _request(name: str, product: str) -> tuple[str, str, dict[str, Any] | None]:
    """The action's method, path and a body that changes ``product`` (a fresh one)."""
    action = BY_NAME[name]
    path = action.path.format(product=product)
    bodies: dict[str, dict[str, Any] | None] = {
        "market.product.put": {"product": _table(product, floor=3.0, slots=5)},
        "market.product.edit": {
            "set": {"default_bid": 4.0},
            "deployments": {f"{product}-a": {"floor": 2.0, "slots": 3}},
        },
        "market.product.delete": None,
    }
    return action.method, path, bodies[name]


EXPECTED = {
    "market.product.put": ["{p}/{p}-a floor: 1 -> 3", "{p}/{p}-a slots: 2 -> 5"],
    "market.product.edit": [
        "{p} default_bid: unset -> 4",
        "{p}/{p}-a floor: 1 -> 2",
        "{p}/{p}-a slots: 2 -> 3",
    ],
    "market.product.delete": ["product {p} removed"],
}


def _check_live(world: World, name: str, product: str) -> None:
    doc = _live(world, product)
    if name == "market.product.delete":
        assert doc is None
        return
    assert doc is not None
    dep = doc["deployments"][0]
    want = {"market.product.put": (3.0, 5), "market.product.edit": (2.0, 3)}[name]
    assert (dep["floor"], dep["slots"]) == want, dep
    if name == "market.product.edit":
        assert doc["default_bid"] == 4.0


@pytest.mark.parametrize("name", WRITES)
def test_each_write_is_the_admin_change_audited_with_the_session(world: World, name: str) -> None:
    product = _product(world)
    method, path, body = _request(name, product)
    before, version, audited = _live(world, product), _version(world), _audit(world, product)
    want = [line.format(p=product) for line in EXPECTED[name]]
    with world.browser(ADMIN_KEY) as c:
        if body is not None:  # the dry run: the lines, nothing written
            r = c.request(method, path, json={**body, "dry_run": True})
            assert r.status_code == 200, r.text
            assert r.json() == {
                "object": "market.change",
                "version": version,
                "changes": want,
                "applied": False,
            }
            assert _same_terms(_live(world, product), before)
            assert _version(world) == version and _audit(world, product) == audited
        r = c.request(method, path, json=body)
        assert r.status_code == 200, r.text
        assert r.json() == {
            "object": "market.change",
            "version": version + 1,
            "changes": want,
            "applied": True,
        }
    _check_live(world, name, product)
    entries = [e for e in _audit(world, product) if e not in audited]
    assert [(e["action"], e["actor"], e["detail"]["changes"]) for e in entries] == [
        (name, "admin:dashboard", want)
    ]


def _same_terms(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """The same floor, slots and default bid (the book's own numbers may move)."""
    assert a is not None and b is not None
    terms = [(d["name"], d["floor"], d["slots"]) for d in a["deployments"]], a["default_bid"]
    return terms == ([(d["name"], d["floor"], d["slots"]) for d in b["deployments"]], b["default_bid"])


def test_an_operator_session_reads_the_market_and_its_change_names_the_operator(world: World) -> None:
    product = _product(world)
    r = world.gw.admin("POST", "/admin/operators", json={"name": "mkt-ada", "role": "admin"})
    assert r.status_code == 201, r.text
    with world.browser(r.json()["key"]) as c:
        actions = c.get("/dashboard/api/session").json()["actions"]
        assert {"market.read", *WRITES} <= set(actions)
        doc = c.get("/dashboard/api/market").json()
        assert doc["object"] == "market" and doc["version"] == _version(world)
        assert doc["products"][product] == _table(product) and {"dash-fast", "dash-other"} <= set(
            doc["products"]
        )
        r = c.patch(
            f"/dashboard/api/products/{product}", json={"deployments": {f"{product}-a": {"floor": 1.5}}}
        )
        assert r.status_code == 200 and r.json()["changes"] == [f"{product}/{product}-a floor: 1 -> 1.5"], (
            r.text
        )
    assert [e["actor"] for e in _audit(world, product) if e["action"] == "market.product.edit"] == [
        "operator:mkt-ada"
    ]


def test_a_viewer_reads_the_market_and_changes_nothing(world: World) -> None:
    product = _product(world)
    r = world.gw.admin("POST", "/admin/operators", json={"name": "mkt-vera", "role": "viewer"})
    assert r.status_code == 201, r.text
    version, before = _version(world), _live(world, product)
    with world.browser(r.json()["key"]) as c:
        actions = c.get("/dashboard/api/session").json()["actions"]
        assert "market.read" in actions and not set(WRITES) & set(actions)
        r = c.get("/dashboard/api/market")
        assert r.status_code == 200 and product in r.json()["products"], r.text
        for name in WRITES:
            method, path, body = _request(name, product)
            r = c.request(method, path, json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_role", (name, r.text)
            assert "'admin'" in r.json()["error"]["message"]
    assert _version(world) == version and _same_terms(_live(world, product), before)
    assert [e["action"] for e in _audit(world, product)] == ["market.product.put"]


def test_a_user_session_neither_reads_nor_changes_the_market(world: World) -> None:
    product = _product(world)
    version = _version(world)
    with world.browser(world.keys["alice"]) as c:
        assert not {"market.read", *WRITES} & set(c.get("/dashboard/api/session").json()["actions"])
        r = c.get("/dashboard/api/market")
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", r.text
        for name in WRITES:
            method, path, body = _request(name, product)
            r = c.request(method, path, json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only", (name, r.text)
    assert _version(world) == version and _live(world, product) is not None


@pytest.mark.parametrize("name", WRITES)
def test_a_write_needs_the_csrf_token_and_the_same_origin(world: World, name: str) -> None:
    product = _product(world)
    method, path, body = _request(name, product)
    version = _version(world)
    with world.browser(ADMIN_KEY) as c:
        token = c.headers.pop("x-csrf-token")
        r = c.request(method, path, json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", r.text
        r = c.request(
            method, path, json=body, headers={"x-csrf-token": token, "origin": "http://evil.example"}
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site", r.text
    with world.browser() as c:  # no session
        assert c.request(method, path, json=body).status_code == 401
        assert c.get("/dashboard/api/market").status_code == 401
    assert _version(world) == version and _live(world, product) is not None
    assert [e["action"] for e in _audit(world, product)] == ["market.product.put"]


BAD_CONFIG: list[tuple[str, dict[str, Any], str]] = [
    ("PATCH", {"deployments": {"A": {"floor": -1}}}, "floor"),
    ("PATCH", {"deployments": {"A": {"slots": 0}}}, "slots"),
    ("PATCH", {"set": {"default_bid": "cheap"}}, "default_bid"),
    ("PATCH", {"set": {"no_such_term": 1}}, "no_such_term"),
    ("PUT", {"product": {"deployments": [{"engine": "warp-drive"}]}}, "engine"),
    ("PUT", {"product": {"deployments": [{"engine": "sim", "floor": "free"}]}, "dry_run": True}, "floor"),
]
"""Changes the market refuses (400 ``invalid_config``, naming the key; ``"A"``: the
product's deployment)."""

BAD_BODY: list[tuple[str, Any]] = [
    ("PATCH", {"sets": {}}),
    ("PATCH", {"set": {"deployments": []}}),
    ("PATCH", {"dry_run": "yes"}),
    ("PUT", {}),
    ("PUT", {"product": []}),
    ("PUT", [1]),
]
"""Bodies the admin route's model refuses (400 ``invalid_request``)."""


def test_a_bad_change_is_a_400_and_changes_nothing(world: World) -> None:
    product = _product(world)
    version, before = _version(world), _live(world, product)
    with world.browser(ADMIN_KEY) as c:
        for method, body, key in BAD_CONFIG:
            if "A" in body.get("deployments", {}):
                body = {"deployments": {f"{product}-a": body["deployments"]["A"]}}
            r = c.request(method, f"/dashboard/api/products/{product}", json=body)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_config" and key in err["message"], (body, err)
        for method, raw in BAD_BODY:
            r = c.request(method, f"/dashboard/api/products/{product}", json=raw)
            assert r.status_code == 400, (raw, r.text)
            assert r.json()["error"]["code"] in ("invalid_request", "invalid_request_error"), r.text
        for raw in (b"not json", b"[" * 100 + b"]" * 100):
            r = c.patch(f"/dashboard/api/products/{product}", content=raw,
                        headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 400, r.text
    assert _version(world) == version and _same_terms(_live(world, product), before)
    assert [e["action"] for e in _audit(world, product)] == ["market.product.put"]


def test_an_unknown_product_or_deployment_is_a_404(world: World) -> None:
    product = _product(world)
    version = _version(world)
    with world.browser(ADMIN_KEY) as c:
        for method, path, body, says in (
            ("PATCH", "/dashboard/api/products/nope", {"deployments": {f"{product}-a": {"floor": 2}}},
             "No product 'nope'"),
            ("PATCH", "/dashboard/api/products/nope", {"set": {"default_bid": 2}, "dry_run": True},
             "No product 'nope'"),
            ("DELETE", "/dashboard/api/products/nope", None, "No product 'nope'"),
            ("PATCH", f"/dashboard/api/products/{product}", {"deployments": {"b": {"floor": 2}}},
             f"'{product}' has no deployment 'b' (it has: {product}-a)"),
        ):  # fmt: skip
            r = c.request(method, path, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
            assert says in r.json()["error"]["message"], r.text
    assert _version(world) == version
