"""The market tape: sampling while watched, history kept, admissions taken once, and
the request feed's subscriptions."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, cast

import pytest

from bourse.ports.book import BookView, Clear, DeploymentView
from bourse.ports.observer import Caller
from bourse.ports.stores import UsageRecord
from bourse.services.market import Market
from bourse.services.request_feed import RequestFeed
from bourse.services.tape import MarketTape

pytestmark = pytest.mark.anyio


class FakeMarket:
    def __init__(self) -> None:
        self.admitted = 0
        self.recent: list[Clear] = []
        self.views = 0

    def admit(self, at: float, price: float) -> None:
        self.admitted += 1
        self.recent.insert(0, Clear(at, price, price + 1, "d0", 0.5))
        del self.recent[3:]  # the book keeps only its last few

    async def view(self) -> BookView:
        self.views += 1
        return BookView(
            1.0, self.views, None, self.admitted, [DeploymentView("d0", 1.0, 1, 0, True, "closed")],
            recent=list(self.recent),
        )  # fmt: skip


async def test_samples_while_watched_and_keeps_history() -> None:
    m = FakeMarket()
    tape = MarketTape({"p": cast(Market, m)}, interval_s=0.01, keep=5, linger_s=0.0)
    m.admit(1.0, 0.1)
    got = []
    async with aclosing(tape.watch("p")) as samples:
        async for s in samples:
            got.append(s.view.waiting)
            if len(got) == 3:
                m.admit(2.0, 0.2)
                m.admit(3.0, 0.3)
                m.admit(4.0, 0.4)
                m.admit(5.0, 0.5)  # four new, the book shows three
            if len(got) == 8:
                break
    assert got == sorted(got) and len(got) == 8
    samples_kept, clears = tape.history("p")
    assert len(samples_kept) == 5 and samples_kept[-1].view.waiting == got[-1]
    assert [c.at for c in clears] == [5.0, 4.0, 3.0, 1.0], "each admission once, newest first"
    await asyncio.sleep(0.05)  # nobody watches and linger is 0: sampling stops
    views = m.views
    await asyncio.sleep(0.05)
    assert m.views == views
    await tape.aclose()


async def test_a_failed_attempt_is_marked_on_the_admission_kept() -> None:
    """A shared book's view is new objects each time: the mark a later view carries
    (by order and attempt) goes to the admission the tape took before."""
    m = FakeMarket()
    tape = MarketTape({"p": cast(Market, m)}, interval_s=0.01, linger_s=0.0)
    clears = [Clear(float(i), 0.1, 0.2, "d0", None, f"o{i}", 0) for i in range(3)]

    def show(failed: set[str]) -> None:
        m.recent = [Clear(c.at, c.price, c.bid, c.deployment, None, c.order_id, c.attempt, c.order_id in failed)
                    for c in reversed(clears)]  # fmt: skip

    m.admitted = 3
    show(set())
    async with aclosing(tape.watch("p")) as samples:
        await anext(samples)
        show({"o1"})
        await anext(samples)
        await anext(samples)
    _, kept = tape.history("p")
    assert [(c.order_id, c.failed) for c in kept] == [("o2", False), ("o1", True), ("o0", False)]
    await tape.aclose()


async def test_unknown_product_raises() -> None:
    tape = MarketTape({})
    with pytest.raises(KeyError):
        await anext(tape.watch("nope"))


class FakeCompletions:
    def __init__(self) -> None:
        self.on_settled: list[Any] = []


async def test_request_feed_filters_and_bounds_each_queue() -> None:
    feed = RequestFeed(cast(Any, FakeCompletions()), cast(Any, None), queue_max=2)

    def rec(i: int, account: str) -> UsageRecord:
        return UsageRecord(f"r{i}", account, "p", float(i), "completed", 0, {})

    with feed.subscribe(lambda r: r.account_id == "a") as mine, feed.subscribe(lambda r: True) as every:
        for i, acc in enumerate(["a", "b", "a", "a"]):
            feed.publish(rec(i, acc))
        assert [mine.get_nowait().request_id for _ in range(mine.qsize())] == ["r2", "r3"]
        assert [every.get_nowait().request_id for _ in range(every.qsize())] == ["r2", "r3"]
    feed.publish(rec(9, "a"))  # no watcher left: nothing kept
    assert feed._watchers == []


async def test_request_feed_keeps_the_last_refusals_and_hands_them_on() -> None:
    feed = RequestFeed(cast(Any, FakeCompletions()), cast(Any, None), keep_refused=2)
    with feed.subscribe(lambda r: r.account_id == "a") as mine:
        for i, account in enumerate(["a", None, "a"]):
            caller = Caller(f"chat-{i}", "/v1/chat/completions", time.perf_counter(), key_id="key_1",
                            account_id=account)  # fmt: skip
            feed.refused(caller, 429 if account else 401, "rate_limited" if account else "invalid_api_key")
        assert [mine.get_nowait().request_id for _ in range(mine.qsize())] == ["chat-0", "chat-2"]
    kept = await feed.refusals(lambda r: True, 10)
    assert [(r.request_id, r.account_id, r.outcome, r.cost_micros) for r in kept] == [
        ("chat-2", "a", "refused", 0), ("chat-1", "", "refused", 0)
    ]  # fmt: skip
    assert kept[0].record["status"] == 429 and kept[0].record["error"] == {"code": "rate_limited"}
    assert abs(kept[0].created_at - time.time()) < 5
    assert await feed.refusals(lambda r: r.account_id == "a", 10) == kept[:1]


class FlakyMarket(FakeMarket):
    """A book whose every other view fails (unexpectedly, not as a GatewayError)."""

    calls = 0

    async def view(self) -> BookView:
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("boom")
        return await super().view()


async def test_a_failing_view_does_not_stop_the_samples(caplog: pytest.LogCaptureFixture) -> None:
    m = FlakyMarket()
    tape = MarketTape({"p": cast(Market, m)}, interval_s=0.01, linger_s=0.0)
    got = 0
    async with aclosing(tape.watch("p")) as samples:
        async for _ in samples:
            got += 1
            if got == 3:
                break
    assert m.calls >= 5 and m.views >= got
    assert caplog.text.count("sampling p failed") >= 2
    await tape.aclose()


async def test_a_product_added_again_live_is_sampled_from_its_new_market() -> None:
    old, new = FakeMarket(), FakeMarket()
    markets: dict[str, Market] = {"p": cast(Market, old)}
    tape = MarketTape(markets, interval_s=0.01, keep=50, linger_s=0.0)
    async with aclosing(tape.watch("p")) as samples:
        n = 0
        async for _ in samples:
            n += 1
            if n == 2:
                markets["p"] = cast(Market, new)  # removed and added again (bourse.market_desk)
            if n == 5:
                break
    assert new.views >= 2, "the tape kept sampling the market that was taken off"
    await tape.aclose()
