"""Price priority through the served gateway (SPEC section 10, issue 4): admission in
bid order behind a busy slot, the second-price clear in x_market and in the ledger,
an order below the level that waits its turn, and a requeued order that keeps its
arrival."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from tests.e2e.market.support import (
    QUEUED_BID,
    REQUEUED,
    BgOrder,
    holding_slot,
    market,
    order,
    wait_market,
    wait_waiting,
)
from tests.e2e.money.support import As, assert_ledger_balanced, expected_cost, new_caller
from tests.support.bodies import USER
from tests.support.env import Env
from tests.support.waiting import wait_until

SIX_FLOOR = 0.13
SIX_BIDS = [0.37, 1.3, 0.21, 0.9, 1.7, 0.55]  # arrival order, not bid order
SHORT = {"output_tokens": 4, "tokens_per_s": 20}  # about 150 ms in the slot


@dataclass
class SdkOrder:
    """One streamed order through the OpenAI SDK, read in its own thread."""

    bid: float
    sent_at: float = 0.0
    in_book_at: float = 0.0
    """when the market view first showed it waiting (just after its arrival)"""
    request_id: str | None = None
    first_content_at: float | None = None
    usage: dict[str, Any] | None = None
    receipt: dict[str, Any] | None = None
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def run(self, client: openai.OpenAI, product: str, sim: dict[str, Any]) -> None:
        try:
            stream = client.chat.completions.create(
                model=product,
                messages=USER,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"max_price": self.bid, "sim": sim},
            )
            self.request_id = stream.response.headers["x-request-id"]
            for chunk in stream:
                now = time.monotonic()
                if chunk.choices and chunk.choices[0].delta.content and self.first_content_at is None:
                    self.first_content_at = now
                if chunk.usage is not None:
                    self.usage = chunk.usage.model_dump()
                    self.receipt = (chunk.model_extra or {}).get("receipt")
        except BaseException as exc:
            self.error = exc

    def start(self, client: openai.OpenAI, product: str, sim: dict[str, Any]) -> SdkOrder:
        self.sent_at = time.monotonic()
        self.thread = threading.Thread(target=self.run, args=(client, product, sim), daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float = 20.0) -> None:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"order at {self.bid} still running"
        assert self.error is None, repr(self.error)


_n = 0


def caller(env: Env, name: str, credit_usd: float = 10.0) -> As:
    global _n
    _n += 1
    return new_caller(env.gateway, f"market-{name}-{_n}", credit_usd)


def check_charge(me: As, request_id: str, price: float) -> int:
    """The usage record charges its tokens at ``price``, rounded up once; its cost."""
    rec = me.usage(request_id)
    u = rec["usage"]
    assert rec["outcome"] == "completed", rec
    assert u["x_market"]["cleared_price"] == pytest.approx(price), u
    cost = expected_cost(int(u["prompt_tokens"]) + int(u["completion_tokens"]), price)
    assert u["cost_micros"] == cost, (u, cost)
    cost_micros: int = u["cost_micros"]
    return cost_micros


# -- 1. six bids behind one busy slot --------------------------------------------------------


def test_six_waiting_orders_are_admitted_in_bid_order_and_pay_the_second_price(env: Env) -> None:
    me = caller(env, "six")
    client = env.gateway.client(api_key=me.key)
    before = me.balance()
    base = market(env, "six")
    assert base["floor"] == SIX_FLOOR
    orders: list[SdkOrder] = []
    with holding_slot(env, "six") as holder:
        for i, bid in enumerate(SIX_BIDS):
            orders.append(SdkOrder(bid).start(client, "six", SHORT))
            wait_waiting(env, "six", i + 1)  # arrival order is known
            orders[-1].in_book_at = time.monotonic()
        view = market(env, "six")
        assert view["level"] == max(SIX_BIDS), view
        assert view["slots"]["free"] == 0, view
        holder.disconnect()  # the slot frees: the book clears six times
        for o in orders:
            o.join()
    client.close()

    by_bid = sorted(SIX_BIDS, reverse=True)
    # each pays the best bid still waiting when it was admitted (the floor for the last)
    expected_price = {b: (by_bid[k + 1] if k + 1 < len(by_bid) else SIX_FLOOR) for k, b in enumerate(by_bid)}

    # admission order: first content chunk (one slot: they run one after another) ...
    assert [o.bid for o in sorted(orders, key=lambda o: o.first_content_at or 0)] == by_bid
    # ... the gateway's own record of its clears (newest first) ...
    clears = list(reversed(market(env, "six")["recent_clears"][:6]))
    assert [c["bid"] for c in clears] == by_bid, clears
    assert [c["price"] for c in clears] == pytest.approx([expected_price[b] for b in by_bid]), clears
    assert {c["deployment"] for c in clears} == {"six-a"}
    # ... and the arrival time plus the reported queued_ms (admissions ~150 ms apart): an
    # order arrived after it was sent and before the market view showed it (that view is
    # polled, late by as much as the machine's load), so it was admitted within
    # [sent + queued, seen in the book + queued]; each was admitted before the next bid's
    # latest possible admission
    for o in orders:
        assert o.usage is not None, o
    admitted = {
        o.bid: (
            o.sent_at + o.usage["x_market"]["queued_ms"] / 1000,
            o.in_book_at + o.usage["x_market"]["queued_ms"] / 1000,
        )
        for o in orders
        if o.usage
    }
    for earlier, later in itertools.pairwise(by_bid):
        assert admitted[earlier][0] < admitted[later][1], (earlier, later, admitted)

    spent = 0
    for i, o in enumerate(orders):
        assert o.usage is not None and o.request_id is not None
        xm = o.usage["x_market"]
        assert xm["bid"] == o.bid, xm
        assert xm["cleared_price"] == pytest.approx(expected_price[o.bid]), (o.bid, xm)
        assert SIX_FLOOR <= xm["cleared_price"] <= o.bid, xm
        assert xm["position_at_entry"] == sum(1 for b in SIX_BIDS[:i] if b > o.bid), (o.bid, xm)
        assert xm["requeues"] == 0, xm
        assert xm["deployment"] == "six-a", xm
        assert xm["queued_ms"] > 0, xm
        assert xm["level"] >= SIX_FLOOR, xm
        # the receipt in the stream and the ledger's usage record agree
        cost = check_charge(me, o.request_id, expected_price[o.bid])
        assert o.usage["cost_micros"] == cost, o.usage
        assert o.receipt is not None and o.receipt["cost_micros"] == cost, o.receipt
        spent += cost
    assert me.wait_settled() == []
    assert before - me.balance() == spent
    assert_ledger_balanced(env.gateway)
    me.assert_books()


# -- 2. an order below the level -----------------------------------------------------------------


def _saw_position(o: BgOrder, position: int) -> bool:
    return any(p == position for _, p in o.queue_frames())


def test_an_order_below_the_level_waits_then_is_admitted_when_demand_falls(env: Env) -> None:
    me = caller(env, "low")
    before = me.balance()
    with holding_slot(env, "lvl") as holder:
        a = order(env, "lvl", 1.0, sim={"output_tokens": 6, "tokens_per_s": 20})  # ~250 ms in the slot
        wait_waiting(env, "lvl", 1)
        a2 = order(env, "lvl", 0.9, sim=SHORT)
        wait_waiting(env, "lvl", 2)
        # (50 ms to its first token: client threads see frames a few ms apart)
        low = order(env, "lvl", 0.2, key=me.key, sim={"output_tokens": 3, "ttft_ms": 50})
        wait_waiting(env, "lvl", 3)
        assert market(env, "lvl")["level"] == 1.0
        wait_until(lambda: _saw_position(low, 2), what="a queue frame at position 2")
        a2.disconnect()  # demand falls: one higher bidder leaves
        wait_waiting(env, "lvl", 2)
        wait_until(lambda: _saw_position(low, 1), what="a queue frame at position 1")
        t_release = time.monotonic()
        holder.disconnect()  # the slot frees: the 1.0 bidder runs, the low order is next
        a.join()
        low.join()

    kinds = low.kinds()
    assert low.status == 200, kinds
    assert QUEUED_BID.match(low.comments()[0]) and low.comments()[0] == "queued bid=0.2", kinds
    frames = low.queue_frames()
    positions = [p for _, p in frames]
    assert positions, kinds
    # its reported positions never increase, and went 2 -> 1 -> 0
    assert positions == sorted(positions, reverse=True), positions
    assert {2, 1, 0} <= set(positions), positions
    assert positions[0] == 2, positions
    # while the higher bidders waited, the level stood above its bid
    assert all(level == 1.0 for level, p in frames if p == 2), frames
    assert all(level > 0.2 for level, p in frames if p >= 1), frames
    # the higher bidder ran first; the low order only after it finished
    assert a.first_content_at() < low.first_content_at()
    assert max(a.content_times()) < low.first_content_at()
    assert low.first_content_at() > t_release

    xa = a.x_market()
    assert xa["cleared_price"] == pytest.approx(0.2), xa  # the 0.9 bidder had left: 0.2 was next
    xm = low.x_market()
    assert xm["bid"] == 0.2
    assert xm["cleared_price"] == pytest.approx(0.1), xm  # nobody left waiting: the floor
    assert xm["position_at_entry"] == 2, xm
    # in the book from before its first frame until after the slot was released
    assert xm["queued_ms"] >= (t_release - low.frames[0].t) * 1000, xm
    assert xm["deployment"] == "lvl-a"

    assert me.wait_settled() == []
    cost = check_charge(me, low.request_id, 0.1)
    assert before - me.balance() == cost
    # the one that left while queued was charged nothing
    rec = env.get(f"/v1/usage/{a2.request_id}").json()
    assert rec["usage"]["cost_micros"] == 0, rec
    assert_ledger_balanced(env.gateway)


# -- 7. a requeued order keeps its arrival ---------------------------------------------------------


def test_a_requeued_order_keeps_its_place_before_later_arrivals_of_equal_bid(env: Env) -> None:
    me = caller(env, "rq")
    before = me.balance()
    started = env.stats("rq-a")["started"]
    with holding_slot(env, "rq") as holder:
        first = order(
            env,
            "rq",
            0.5,
            key=me.key,
            sim={"fail_before_output": 1, "ttft_ms": 150, "output_tokens": 3, "tokens_per_s": 20},
        )
        wait_waiting(env, "rq", 1)
        later = []
        for n in (2, 3):  # two later arrivals at the same bid
            later.append(order(env, "rq", 0.5, sim={"output_tokens": 3, "ttft_ms": 50}))
            wait_waiting(env, "rq", n)
        holder.disconnect()
        first.join()
        for o in later:
            o.join()
    wait_market(env, "rq", lambda v: v["slots"]["busy"] == 0 and v["waiting"] == 0)

    kinds = first.kinds()
    assert "c:" + REQUEUED in kinds, kinds
    assert kinds[-1] == "DONE", kinds
    # re-admitted before the later orders of the same bid
    done_first = max(first.content_times())
    for o in later:
        assert o.first_content_at() > done_first, (kinds, o.kinds())
    assert later[0].first_content_at() < later[1].first_content_at()
    xm = first.x_market()
    assert xm["requeues"] == 1, xm
    assert xm["position_at_entry"] == 0, xm
    assert xm["cleared_price"] == pytest.approx(0.5), xm  # an equal bid was still waiting
    assert env.stats("rq-a")["started"] == started + 5  # holder, failed attempt, retry, 2 later
    # the failed attempt cost nothing: one charge, for the answer
    assert me.wait_settled() == []
    cost = check_charge(me, first.request_id, 0.5)
    assert before - me.balance() == cost
