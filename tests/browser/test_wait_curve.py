"""Price against expected wait on the market page (issue 38, item 2), in headless
Chromium: while orders wait, the page lists (and charts) the wait a new order would
be predicted at each bid, cheaper bids waiting longer, and says how well the
predictions came true lately. Failed on the main branch before the curve was built
(no such table)."""

from __future__ import annotations

import threading
from typing import Any

from tests.browser.conftest import ADMIN_KEY, Floor
from tests.browser.test_dashboard import WAIT_MS, _open, _shot

CURVE = """() => [...document.querySelectorAll('#wait-curve tbody tr[data-price]')].map((tr) => [
  Number(tr.dataset.price), tr.querySelector("td[data-label='Expected wait']").textContent])"""


def _secs(text: str) -> float:
    assert text.endswith(" s"), text
    return float(text.removesuffix(" s"))


def test_the_market_page_draws_price_against_expected_wait(floor: Floor, page: Any) -> None:
    floor.complete("alice", "slow", max_tokens=2)  # a run seen: the forecast has a run length
    _open(page, floor, "market/slow", ADMIN_KEY)
    page.wait_for_selector("#market-live.on")
    page.wait_for_selector("#ladder-level")
    # both slots busy for ~3 s, and two orders waiting behind them at two bids
    busy = [threading.Thread(target=floor.complete, args=("alice", "slow"), kwargs={"max_tokens": 15})
            for _ in range(2)]  # fmt: skip
    for t in busy:
        t.start()
    page.wait_for_function("() => document.querySelector('#stat-slots').textContent.startsWith('2 /')",
                           timeout=WAIT_MS)  # fmt: skip
    waiting = [threading.Thread(target=floor.complete, args=("bob", "slow"), kwargs={"max_tokens": 2, "max_price": bid})
               for bid in (1.5, 3.0)]  # fmt: skip
    for t in waiting:
        t.start()
    try:
        page.wait_for_function(f"() => ({CURVE})().length >= 2", timeout=WAIT_MS)
        rows = page.evaluate(CURVE)
        waits = [_secs(w) for _, w in rows]
        prices = [p for p, _ in rows]
        # by wait, shortest first; each a cheaper bid than the one before (the cheapest
        # bid predicted for that wait: a bid behind the orders waiting waits longer)
        assert waits == sorted(waits) and len(set(waits)) == len(waits), rows
        assert prices == sorted(prices, reverse=True) and len(set(prices)) == len(prices), rows
        assert prices[-1] == 1.0, rows  # the floor: the cheapest bid, the longest wait
        assert page.query_selector("#chart-curve canvas") is not None
        score = page.inner_text("#forecast-score")
        assert score.startswith(("Lately ", "No order has been scored yet.")), score
        _shot(page, "market-wait-curve")
    finally:
        for t in (*busy, *waiting):
            t.join(timeout=60)
