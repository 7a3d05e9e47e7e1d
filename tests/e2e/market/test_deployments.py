"""Several deployments per product (SPEC section 10, issue 4): an admitted order
goes to the cheapest eligible deployment with a free slot, ties broken by fewest
busy slots; an order whose bid is below a deployment's floor never runs there."""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest

from tests.e2e.market.support import (
    HOLD_FOREVER,
    BgOrder,
    busy_by_deployment,
    market,
    order,
    wait_market,
    wait_waiting,
)
from tests.support.env import Env

FLOORS = {"m-cheap": 0.1, "m-mid-a": 0.5, "m-mid-b": 0.5, "m-dear": 2.0}
MIDS = ("m-mid-a", "m-mid-b")


def _admit(env: Env, bid: float) -> tuple[BgOrder, str]:
    """Send a slot-holding order that is admitted at once; (order, its deployment)."""
    before = market(env, "multi")
    o = order(env, "multi", bid, sim=HOLD_FOREVER)
    after = wait_market(
        env, "multi", lambda v: v["admitted_total"] == before["admitted_total"] + 1, what="an admission"
    )
    b0, b1 = busy_by_deployment(before), busy_by_deployment(after)
    [dep] = [d for d in b1 if b1[d] == b0[d] + 1]
    assert sum(b1.values()) == sum(b0.values()) + 1, (b0, b1)
    return o, dep


def test_cheapest_eligible_free_deployment_ties_by_fewest_busy_never_below_floor(env: Env) -> None:
    dear_started = env.stats("m-dear")["started"]
    with ExitStack() as stack:
        placed: list[tuple[BgOrder, str]] = []

        def admit(bid: float) -> str:
            o, dep = _admit(env, bid)
            stack.callback(o.disconnect)
            placed.append((o, dep))
            return dep

        # all free: the cheapest floor, although the bid clears every floor
        assert admit(3.0) == "m-cheap"
        # the cheapest is full: the next floor (0.5), not the dearer 2.0
        first_mid = admit(3.0)
        assert first_mid in MIDS
        # a tie on floor: the mid deployment with fewer busy slots
        second_mid = admit(3.0)
        assert {first_mid, second_mid} == set(MIDS), placed
        assert admit(3.0) in MIDS
        fourth = admit(3.0)
        assert busy_by_deployment(market(env, "multi")) == {
            "m-dear": 0,
            "m-mid-a": 2,
            "m-mid-b": 2,
            "m-cheap": 1,
        }, (placed, fourth)

        # a bid of 1.0 while only 'm-dear' (floor 2.0) is free: it waits
        low = order(env, "multi", 1.0, sim={"output_tokens": 3})
        wait_waiting(env, "multi", 1)
        time.sleep(0.5)
        view = market(env, "multi")
        assert view["waiting"] == 1 and view["slots"]["free"] == 1, view
        assert busy_by_deployment(view)["m-dear"] == 0, view
        assert env.stats("m-dear")["started"] == dear_started
        assert view["level"] == 1.0, view  # the best bid waiting

        # a bid above 2.0 takes 'm-dear' at once, ahead of the waiting 1.0
        assert admit(2.5) == "m-dear"
        assert market(env, "multi")["waiting"] == 1

        # a mid slot frees: the 1.0 order runs there, at that floor
        holder, freed = next((o, d) for o, d in placed if d in MIDS)
        holder.disconnect()
        low.join()
        xm = low.x_market()
        assert xm["deployment"] == freed, (xm, freed)
        assert xm["cleared_price"] == pytest.approx(0.5), xm
        assert env.stats("m-dear")["started"] == dear_started + 1  # only the 2.5 bid ran there

    view = wait_market(env, "multi", lambda v: v["slots"]["busy"] == 0 and v["waiting"] == 0)
    # each holder's record names the deployment it ran on and that floor as its price
    # (the 2.5 bid cleared against a waiting 1.0: max(2.0, 1.0))
    for o, dep in placed:
        rec = env.get(f"/v1/usage/{o.request_id}").json()
        xm = rec["usage"]["x_market"]
        assert xm["deployment"] == dep, (xm, dep)
        assert xm["cleared_price"] == pytest.approx(FLOORS[dep]), (xm, dep)
        assert xm["cleared_price"] <= xm["bid"]
        assert rec["usage"]["cost_micros"] == 0, rec  # left before any output
    clears = view["recent_clears"]
    assert all(c["price"] >= FLOORS[c["deployment"]] and c["bid"] >= FLOORS[c["deployment"]] for c in clears)
