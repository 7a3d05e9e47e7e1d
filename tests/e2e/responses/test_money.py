"""Money is conserved across a mix of chat completions and responses (not streamed,
streamed, disconnected, failed, background, cancelled queued and running, chained),
run at once, over SQLite and PostgreSQL: every hold is closed, the account's books
hold (credited = balance + holds + spent), what it spent is the sum of its receipts,
and the ledger balances (credits = balances + holds + revenue)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.jobs.support import Jobs, slot_held, unique, usage_records
from tests.e2e.money.support import As, assert_ledger_balanced, new_caller
from tests.e2e.responses.support import PRODUCTS, SERVER, Caller
from tests.support.bodies import USER
from tests.support.config import config_toml
from tests.support.databases import fresh_postgres_database
from tests.support.gateway import Gateway, running_gateway


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gw(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    text = config_toml(PRODUCTS, server=SERVER)
    if request.param == "sqlite":
        with running_gateway(text) as g:
            yield g
        return
    with fresh_postgres_database() as dsn, running_gateway(text, database=dsn) as g:
        yield g


def _disconnect(me: Caller) -> None:
    with me.open_stream({"model": "slow", "input": "Talk."}) as s:
        s.until(lambda f: f.event == "response.output_text.delta")


def _cancel_running(me: Caller, jobs: Jobs) -> None:
    created = me.create({"model": "slow", "input": "Talk.", "background": True})
    job = next(j for j in jobs.list()["data"] if j["request_id"] == created["id"])
    jobs.wait(job["id"], lambda j: j.get("progress", {}).get("tokens", 0) >= 2, what="2 tokens")
    assert me.cancel(created["id"])["status"] == "cancelled"


def _background(me: Caller) -> None:
    created = me.create({"model": "fast", "input": "Hi", "background": True})
    done, _ = me.wait_final(created["id"])
    assert done["status"] == "completed", done
    chained = me.create({"model": "fast", "input": "More.", "previous_response_id": created["id"]})
    assert chained["status"] == "completed"


def test_money_is_conserved_across_chat_and_responses(gw: Gateway) -> None:
    money: As = new_caller(gw, unique("mix"), 5.0)
    me = Caller(gw.url, money.key, money.account)
    jobs = Jobs(gw.url, money.key, money.account)
    chat = {"model": "fast", "messages": USER}
    work: list[Callable[[], Any]] = [
        lambda: money.post(chat),
        lambda: money.stream(chat),
        lambda: me.create({"model": "fast", "input": "Hi"}),
        lambda: me.stream({"model": "fast", "input": "Hi"}),
        lambda: me.stream({"model": "fail", "input": "Hi"}),
        lambda: me.create_raw({"model": "fail", "input": "Hi"}),
        lambda: me.stream({"model": "think", "input": "Hi", "max_output_tokens": 4}),
        lambda: _disconnect(me),
        lambda: _background(me),
        lambda: _cancel_running(me, jobs),
    ]
    with ThreadPoolExecutor(len(work)) as pool:
        for future in [pool.submit(w) for w in work]:
            future.result()
    with slot_held(gw, "one"):
        queued = me.create({"model": "one", "input": "Hi", "background": True})
        assert me.cancel(queued["id"])["status"] == "cancelled"
    assert money.wait_settled() == []
    books = money.assert_books()
    assert books["reconciling_micros"] == 0 and books["open_holds_micros"] == 0, books
    records = usage_records(gw.url, money.key)
    assert len(records) == 12, [r["id"] for r in records]
    assert sum(r["usage"]["cost_micros"] for r in records) == books["spent_micros"] > 0, books
    outcomes = sorted(r["receipt"]["outcome"] for r in records)
    assert outcomes.count("completed") == 7 and outcomes.count("error") == 2, outcomes
    assert outcomes.count("disconnected") == 1 and outcomes.count("canceled") == 2, outcomes
    assert_ledger_balanced(gw)
