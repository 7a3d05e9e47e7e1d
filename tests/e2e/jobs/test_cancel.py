"""POST /v1/jobs/{id}/cancel: a queued job is removed and charged nothing; a running
job's engine generation is cancelled (the engine counts it: in-process sim, or the
sim upstream behind the HTTP engine) and the tokens generated so far are charged;
a finished job is returned unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.jobs.support import caller, chat_body, slot_held, usage_records
from tests.e2e.money.support import assert_ledger_balanced, expected_cost
from tests.support.config import Dep, Product
from tests.support.env import ENGINE_KINDS, Env, start_env

FLOOR = 1.0
FINAL = ("succeeded", "failed", "canceled", "expired")


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    products = [Product("one", [Dep("one-a", slots=1, floor=FLOOR, sim={"tokens_per_s": 20})])]
    with start_env(request.param, products) as e:
        yield e


def test_cancel_while_queued_removes_it_and_charges_nothing(env: Env) -> None:
    gw = env.gateway
    me, jobs = caller(gw, "cq")
    before = me.balance()
    with slot_held(gw, "one"):
        started = env.stats("one-a")["started"]
        job = jobs.submit(chat_body("one", tokens=20))
        assert jobs.get(job["id"])["status"] == "queued"
        assert me.account_view()["open_holds_micros"] > 0
        out = jobs.cancel(job["id"])
        assert out["id"] == job["id"] and out["status"] == "canceled", out
        assert "queue" not in out and "progress" not in out, out
        assert out["finished_at"] is not None, out
        if "result" in out:  # a record of nothing: no tokens, no cost
            assert out["result"]["usage"]["completion_tokens"] == 0, out
            assert out["result"]["usage"]["cost_micros"] == 0, out
        # nothing charged, no hold left open
        assert me.balance() == before
        assert me.holds("open") == [] and me.holds("reconciling") == [], me.holds()
        view = me.account_view()
        assert view["open_holds_micros"] == 0 and view["spent_micros"] == 0, view
        assert jobs.get(job["id"])["status"] == "canceled"
    # the slot freed: the job must not run anyway
    assert env.wait_stats("one-a", lambda s: s["started"] > started, timeout=0.5)[0]["started"] == started
    assert jobs.get(job["id"])["status"] == "canceled"
    assert me.balance() == before
    assert all(r["usage"]["cost_micros"] == 0 for r in usage_records(gw.url, jobs.key))
    assert_ledger_balanced(gw)


def test_cancel_while_running_cancels_the_engine_and_charges_generated_tokens(env: Env) -> None:
    gw = env.gateway
    me, jobs = caller(gw, "cr")
    before = me.balance()
    stats0 = env.stats("one-a")
    total = 200  # 10 s at 20 tokens/s: cancelled well before the end
    job = jobs.submit(chat_body("one", tokens=total))
    running = jobs.wait(job["id"], lambda j: j["status"] == "running" and j["progress"]["tokens"] >= 3,
                        what="running with 3 tokens")  # fmt: skip
    assert running["progress"]["tokens"] < total, running
    out = jobs.cancel(job["id"])
    assert out["status"] == "canceled", out
    # the engine saw the cancellation (not a completion)
    stats, waited = env.wait_stats("one-a", lambda s: s["cancelled"] > stats0["cancelled"], timeout=5.0)
    assert stats["cancelled"] == stats0["cancelled"] + 1, (waited, stats0, stats)
    assert stats["completed"] == stats0["completed"], (stats0, stats)
    # the generated tokens are charged, less than the whole answer would cost
    final = jobs.wait_status(job["id"], *FINAL)
    assert final["status"] == "canceled", final
    res = final.get("result")
    assert res is not None, f"a canceled running job should carry its partial usage and receipt: {final}"
    usage = res["usage"]
    generated = usage["completion_tokens"]
    assert 3 <= generated < total, usage
    cost = usage["cost_micros"]
    price = usage["x_market"]["cleared_price"]
    full = expected_cost(usage["prompt_tokens"] + total, price)
    assert 0 < cost < full, (cost, full, usage)
    assert cost == expected_cost(usage["prompt_tokens"] + generated, price), usage
    assert res["receipt"]["outcome"] == "canceled", res["receipt"]
    assert res["receipt"]["cost_micros"] == cost, res["receipt"]
    # the balance moved by exactly that, once
    left = me.wait_settled()
    assert left == [], left
    assert me.balance() == before - cost
    recs = [r for r in usage_records(gw.url, jobs.key) if r["id"] == job["request_id"]]
    assert len(recs) == 1 and recs[0]["usage"]["cost_micros"] == cost, recs
    assert recs[0]["receipt"]["outcome"] == "canceled", recs
    assert_ledger_balanced(gw)
    # cancelling again changes nothing
    assert jobs.cancel(job["id"]) == final
    assert me.balance() == before - cost


def test_cancel_of_a_finished_job_returns_it_unchanged(env: Env) -> None:
    gw = env.gateway
    me, jobs = caller(gw, "cf")
    job = jobs.submit(chat_body("one", tokens=3))
    done = jobs.wait_status(job["id"], *FINAL)
    assert done["status"] == "succeeded", done
    balance = me.balance()
    out = jobs.cancel(job["id"])
    assert out == done
    assert jobs.get(job["id"]) == done
    assert me.balance() == balance
    # and a canceled one stays canceled, unchanged
    with slot_held(gw, "one"):
        queued = jobs.submit(chat_body("one", tokens=3))
        first = jobs.cancel(queued["id"])
        assert first["status"] == "canceled", first
        assert jobs.cancel(queued["id"]) == first
    assert jobs.get(queued["id"]) == first
