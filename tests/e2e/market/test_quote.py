"""The wait forecast and the quotes through a served gateway (issue 38, items 1 and 2),
over both books: GET /v1/market/{product}/quote with its bounds, the forecast's score
in the market view and in /metrics once orders waited, and the ``: queued`` frames'
predicted wait."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.market.support import QUEUED_LEVEL, market, order, wait_market
from tests.support.env import Env

FLOOR = 0.2
PRODUCT = "fcst"


def _quote(env: Env, query: str, product: str = PRODUCT) -> httpx.Response:
    return httpx.get(f"{env.url}/v1/market/{product}/quote{query}", timeout=30)  # no key: public


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("", "within_s"),
        ("?within_s=0", "within_s"),
        ("?within_s=-1", "within_s"),
        ("?within_s=nan", "within_s"),
        ("?within_s=inf", "within_s"),
        ("?within_s=soon", "within_s"),
        ("?within_s=86401", "within_s"),
        ("?within_s=5&tokens=0", "tokens"),
        ("?within_s=5&tokens=1.5", "tokens"),
        ("?within_s=5&tokens=100000001", "tokens"),
    ],
)
def test_a_bad_quote_parameter_is_a_400_naming_it(env: Env, query: str, param: str) -> None:
    r = _quote(env, query)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_request", param), err


def test_the_quote_of_an_unknown_product_is_a_404(env: Env) -> None:
    r = _quote(env, "?within_s=5", product="nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_quote_with_a_free_slot_is_the_floor_and_says_it_is_a_prediction(env: Env) -> None:
    r = _quote(env, "?within_s=5&tokens=2000")
    assert r.status_code == 200, r.text
    q = r.json()
    assert q["object"] == "bourse.quote" and q["product"] == PRODUCT and q["within_s"] == 5.0, q
    assert (q["bid"], q["wait_s"]) == (FLOOR, 0.0), q
    assert q["max_cost_usd"] == pytest.approx(FLOOR * 2000 / 1e6), q
    assert "prediction, not a promise" in q["note"], q
    assert set(q["forecast"]) >= {"orders", "median_abs_error_s", "within_2x", "median_wait_s", "window"}, q


def _gauge(env: Env, name: str) -> float | None:
    r = httpx.get(env.url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name == name and s.labels.get("product") == PRODUCT:
                return float(s.value)
    return None


def test_the_waits_are_predicted_scored_and_shown(env: Env) -> None:
    before = market(env, PRODUCT)["forecast"]["orders"]
    # a history of runs: three of 0.2 s, one after another
    for _ in range(3):
        order(env, PRODUCT, 1.0, sim={"output_tokens": 4, "tokens_per_s": 20}).join()
    # one runs 1.5 s; two wait behind it, then run 0.4 s each
    holder = order(env, PRODUCT, 5.0, sim={"output_tokens": 30, "tokens_per_s": 20})
    wait_market(env, PRODUCT, lambda v: v["slots"]["busy"] == 1, what="the holder running")
    waiters = [order(env, PRODUCT, 1.0, sim={"output_tokens": 8, "tokens_per_s": 20}) for _ in range(2)]
    wait_market(env, PRODUCT, lambda v: v["waiting"] == 2, what="two waiting")
    # while they wait: a quote to start at once needs a bid above theirs; later, the floor will do
    soon = _quote(env, "?within_s=0.05").json()
    later = _quote(env, "?within_s=60").json()
    assert soon["bid"] is None or soon["bid"] > 1.0, soon
    assert later["bid"] is not None and later["bid"] <= (soon["bid"] or later["bid"]), (soon, later)
    assert later["wait_at_level_s"] is not None and later["level"] == 1.0, later
    for w in (holder, *waiters):
        w.join()
    # the waiting orders' frames said a predicted wait (none in a frame of an order being
    # admitted at that instant: out of the book, shown at position 0)
    waits = [m.group(3) for w in waiters for c in w.comments() if (m := QUEUED_LEVEL.match(c))]
    assert any(x is not None for x in waits), [w.comments() for w in waiters]
    assert all(float(x) >= 0 for x in waits if x is not None), waits
    # both waiters scored: the market view and the gauges say so
    view = wait_market(env, PRODUCT, lambda v: v["forecast"]["orders"] >= before + 2, what="two more scored")
    f = view["forecast"]
    assert 0.0 <= f["within_2x"] <= 1.0 and f["median_abs_error_s"] >= 0.0 and f["median_wait_s"] > 0.0, f
    assert f["window"] == {"orders": 1000, "seconds": 600.0}, f
    assert _gauge(env, "bourse_wait_forecast_scored_orders") == f["orders"]
    assert _gauge(env, "bourse_wait_forecast_within_2x_ratio") == pytest.approx(f["within_2x"], abs=1e-4)
    assert _gauge(env, "bourse_wait_forecast_abs_error_seconds") is not None
    assert view["expected_wait_s"] == 0.0, view  # the slot is free again
