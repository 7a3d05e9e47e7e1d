"""The live market across two replicas (issue 37): a price, a slot count and a new
product changed through one replica's admin API are in force on the other within a
second (PostgreSQL keeps the version, Redis carries the note); fewer slots under
load admit nothing new until the slots in use fall under them, and cut nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.cluster import test_two_replicas
from tests.e2e.cluster.test_two_replicas import Cluster, Holder
from tests.support.bodies import USER

pytestmark = [pytest.mark.postgres, pytest.mark.redis]
cluster = test_two_replicas.cluster  # the fixture: two replicas, one PostgreSQL, one Redis


def _seen_within(check: Callable[[], bool], since: float, within_s: float = 1.0) -> float:
    """How long after ``since`` ``check()`` first held (fails after ``within_s``)."""
    while True:
        started = time.monotonic()
        if check():
            return started - since
        assert started - since < within_s, f"not in force {started - since:.2f} s on"
        time.sleep(0.01)


def _deployment(c: Cluster, replica: int) -> dict[str, Any]:
    doc: dict[str, Any] = c.market(replica)["deployments"][0]
    return doc


def _models(c: Cluster, replica: int) -> set[str]:
    r = httpx.get(c.urls[replica] + "/v1/models", headers={"authorization": f"Bearer {c.key}"}, timeout=10)
    return {m["id"] for m in r.json()["data"]}


def test_a_price_slots_and_a_new_product_made_on_one_replica_are_in_force_on_the_other_within_1s(
    cluster: Cluster,
) -> None:
    c = cluster
    assert _deployment(c, 1)["floor"] == 0.1
    r = c.admin("PATCH", "/admin/products/shared", 0, json={"deployments": {"shared/0": {"floor": 0.4}}})
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    assert r.json()["changes"] == ["shared/shared/0 floor: 0.1 -> 0.4"], r.json()
    took = [_seen_within(lambda: _deployment(c, 1)["floor"] == 0.4, t0)]
    answer = c.client(1).chat.completions.create(model="shared", messages=USER, max_tokens=2,
                                                 extra_body={"max_price": 5.0})  # fmt: skip
    assert answer.usage is not None and answer.usage.model_extra is not None
    assert answer.usage.model_extra["x_market"]["cleared_price"] == 0.4, answer

    r = c.admin("PATCH", "/admin/products/shared", 0, json={"deployments": {"shared/0": {"slots": 5}}})
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    took.append(_seen_within(lambda: _deployment(c, 1)["slots"] == 5, t0))

    assert "fresh" not in _models(c, 1)
    table = {"description": "added live", "deployments": [{"engine": "sim", "floor": 0.2, "slots": 3}]}
    r = c.admin("PUT", "/admin/products/fresh", 0, json={"product": table})
    assert r.status_code == 200 and r.json()["changes"] == ["product fresh added"], r.text
    t0 = time.monotonic()
    took.append(_seen_within(lambda: "fresh" in _models(c, 1), t0))
    fresh = c.client(1).chat.completions.create(model="fresh", messages=USER, max_tokens=3)
    assert fresh.choices[0].message.content and fresh.usage is not None
    assert fresh.usage.model_extra is not None and fresh.usage.model_extra["x_market"]["cleared_price"] == 0.2
    assert all(t < 1.0 for t in took), took

    r = c.admin("DELETE", "/admin/products/fresh", 1)
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    _seen_within(lambda: "fresh" not in _models(c, 0), t0)
    gone = httpx.post(c.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {c.key}"},
                      json={"model": "fresh", "messages": USER}, timeout=10)  # fmt: skip
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text

    market = c.admin("GET", "/admin/market", 1).json()
    assert (
        set(market["products"]) == {"shared"}
        and market["products"]["shared"]["deployments"][0]["floor"] == 0.4
    )
    audit = c.admin("GET", "/admin/audit", 1, params={"target": "fresh"}).json()["data"]
    assert [(e["action"], e["actor"]) for e in audit] == [
        ("market.product.delete", "admin"), ("market.product.put", "admin")
    ], audit  # fmt: skip


def test_fewer_slots_under_load_admit_nothing_new_until_busy_falls_under_them(cluster: Cluster) -> None:
    c = cluster
    holders = [Holder(c.urls[i], c.key) for i in (0, 1)]
    try:
        for h in holders:
            assert h.first.wait(20), "a holder got no output"
        assert _deployment(c, 0)["busy"] == 2
        r = c.admin("PATCH", "/admin/products/shared", 1, json={"deployments": {"shared/0": {"slots": 1}}})
        assert r.status_code == 200, r.text
        c.wait_market(lambda v: v["deployments"][0]["slots"] == 1, "slots = 1", replica=0, timeout=1.0)
        with httpx.Client(timeout=30) as client:
            body = {"model": "shared", "messages": USER, "stream": True, "max_price": 50.0,
                    "sim": {"output_tokens": 3}}  # fmt: skip
            req = client.build_request("POST", c.urls[0] + "/v1/chat/completions", json=body,
                                       headers={"authorization": f"Bearer {c.key}"})  # fmt: skip
            waiting = client.send(req, stream=True)
            c.wait_market(lambda v: v["waiting"] == 1, "the new order waiting", replica=1)
            holders[0].close()
            time.sleep(1.0)  # busy 1 of 1 slot: still nothing new
            view = c.market(1)
            assert view["waiting"] == 1 and view["deployments"][0]["busy"] == 1, view
            assert not holders[1].response.is_closed  # the other one streams on
            holders[1].close()
            c.wait_market(lambda v: v["waiting"] == 0, "the order admitted once busy fell under 1", replica=1)
            text = waiting.read().decode()
            assert "data: [DONE]" in text, text[-300:]
    finally:
        for h in holders:
            h.close()
