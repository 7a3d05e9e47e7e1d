"""The level and the market views (SPEC section 10, issue 4): GET /v1/models,
GET /v1/market and GET /v1/market/{product} show the floor as the level while a
slot is free and the best waiting bid while every slot is busy; slots busy/free,
orders waiting by price bucket, recent clears."""

from __future__ import annotations

import pytest

from tests.e2e.market.support import (
    holding_slot,
    market,
    market_list_entry,
    model_entry,
    order,
    wait_market,
    wait_waiting,
)
from tests.support.env import Env

FLOOR = 0.25


def _levels(env: Env) -> tuple[float, float, float]:
    """The level as /v1/market/view, /v1/market and /v1/models show it."""
    return (
        market(env, "view")["level"],
        market_list_entry(env, "view")["level"],
        model_entry(env, "view")["pricing"]["level"],
    )


def test_level_is_the_floor_with_a_free_slot_and_the_best_waiting_bid_when_busy(env: Env) -> None:
    # idle: a free slot, the level is the floor
    view = market(env, "view")
    assert view["floor"] == FLOOR and view["waiting"] == 0, view
    assert view["slots"] == {"busy": 0, "free": 1, "total": 1}, view
    assert view["book"] == [], view
    assert _levels(env) == (FLOOR, FLOOR, FLOOR)
    pricing = model_entry(env, "view")["pricing"]
    assert pricing["floor"] == FLOOR, pricing
    assert market_list_entry(env, "view")["floor"] == FLOOR
    admitted = view["admitted_total"]

    bids = [0.5, 1.27, 1.23]
    with holding_slot(env, "view", bid=3.0) as holder:
        busy = market(env, "view")
        assert busy["slots"] == {"busy": 1, "free": 0, "total": 1}, busy
        assert busy["deployments"][0]["busy"] == 1, busy
        waiting = []
        for i, bid in enumerate(bids):
            waiting.append(order(env, "view", bid, sim={"output_tokens": 2}))
            wait_waiting(env, "view", i + 1)
        # every slot busy, orders waiting: the level is the best waiting bid
        view = market(env, "view")
        assert view["level"] == 1.27 and view["best_bid"] == 1.27, view
        assert view["waiting"] == 3 and view["slots"]["free"] == 0, view
        # orders waiting by price bucket (two significant digits), best first; the
        # expected waits are a list of their own (``waits``), the buckets unchanged
        assert view["book"] == [{"price": 1.2, "orders": 2}, {"price": 0.5, "orders": 1}], view["book"]
        assert "waits" in view, view
        assert _levels(env) == (1.27, 1.27, 1.27)
        assert market_list_entry(env, "view")["waiting"] == 3
        # the waiting orders see the same level in their queue frames
        wait_market(env, "view", lambda v: len(waiting[0].queue_frames()) >= 1, what="a queue frame")
        assert any(level == 1.27 for level, _ in waiting[0].queue_frames()), waiting[0].kinds()
        holder.disconnect()
        for o in waiting:
            o.join()

    view = wait_market(env, "view", lambda v: v["slots"]["busy"] == 0 and v["waiting"] == 0)
    # drained: a free slot again, the level is back at the floor
    assert view["slots"] == {"busy": 0, "free": 1, "total": 1}, view
    assert view["book"] == [], view
    assert _levels(env) == (FLOOR, FLOOR, FLOOR)
    # recent clears, newest first: the holder at the floor, then the three by bid
    assert view["admitted_total"] == admitted + 4, view
    clears = list(reversed(view["recent_clears"][:4]))
    assert [c["bid"] for c in clears] == [3.0, 1.27, 1.23, 0.5], clears
    assert [c["price"] for c in clears] == pytest.approx([FLOOR, 1.23, 0.5, FLOOR]), clears
    assert {c["deployment"] for c in clears} == {"view-a"}
    assert all(c["ago_s"] >= 0 for c in clears), clears
    # and each order's receipt names the price it cleared at
    for o, price in zip(waiting, [FLOOR, 1.23, 0.5], strict=True):  # bids 0.5, 1.27, 1.23
        assert o.x_market()["cleared_price"] == pytest.approx(price), o.x_market()
