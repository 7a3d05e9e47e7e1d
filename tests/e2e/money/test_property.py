"""A property of the ledger under random traffic (hypothesis): whatever mix of
normal requests, client disconnects (mid-stream, while queued, during a stall),
engine failures before and after output, stalls, missing usage and book timeouts
runs (concurrently, over the default, openfill, aigrid and gopuram policies), once
everything has settled:

- ``credits = balances + open holds + revenue`` exactly, and no hold is open;
- per account: credited = balance + open + reconciling + spent;
- every hold has exactly one usage record, whose cost is what the hold charged, and
  the receipts add up to the account's spend.

One gateway per database; one fresh account per example. Over SQLite and PostgreSQL.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.e2e.money.support import As, assert_ledger_balanced, new_caller, read_until
from tests.support.gateway import Gateway, running_gateway

POLICIES = {"pd": "default", "po": "openfill", "pa": "aigrid", "pg": "gopuram"}


def _config() -> str:
    out = ["[server]\nquiet_interval_s = 0.2\n"]
    for name, policy in POLICIES.items():
        out.append(
            f'[products.{name}]\npolicy = "{policy}"\nmax_output_tokens = 512\nsim_overrides = true\n'
            f'[[products.{name}.deployments]]\nengine = "sim"\nslots = 6\nfloor = 0.37\n'
            "breaker_threshold = 1000\ncooldown_s = 0\n"
        )
    # one slot, taken for the whole test by a blocker: every order here waits
    out.append(
        '[products.busy]\nsim_overrides = true\n[[products.busy.deployments]]\nengine = "sim"\nslots = 1\nfloor = 0.37\n'
    )
    return "\n".join(out)


CONFIG = _config()
PRODUCTS = sorted(POLICIES)

Action = dict[str, Any]

actions = st.one_of(
    st.fixed_dictionaries({"kind": st.just("normal"), "n": st.integers(1, 30)}),
    st.fixed_dictionaries({"kind": st.just("disconnect"), "k": st.integers(1, 5)}),
    st.fixed_dictionaries({"kind": st.just("disconnect_in_stall"), "k": st.integers(1, 3)}),
    st.fixed_dictionaries({"kind": st.just("fail_before"), "times": st.sampled_from([1, 2, -1])}),
    st.fixed_dictionaries({"kind": st.just("fail_after"), "k": st.integers(0, 5)}),
    st.fixed_dictionaries(
        {"kind": st.just("stall"), "k": st.integers(0, 4), "s": st.sampled_from([0.05, 0.25])}
    ),
    st.fixed_dictionaries({"kind": st.just("omit_usage"), "n": st.integers(1, 20)}),
    st.fixed_dictionaries({"kind": st.just("book_timeout"), "timeout": st.sampled_from([0.1, 0.3])}),
    st.fixed_dictionaries({"kind": st.just("queued_disconnect")}),
).flatmap(
    lambda a: st.fixed_dictionaries(
        {
            **{k: st.just(v) for k, v in a.items()},
            "product": st.sampled_from(PRODUCTS),
            "stream": st.booleans(),
        }
    )
)

ALL_KINDS: list[Action] = [
    {"kind": "normal", "n": 5, "product": "pd", "stream": False},
    {"kind": "disconnect", "k": 2, "product": "po", "stream": True},
    {"kind": "disconnect", "k": 2, "product": "pd", "stream": True},
    {"kind": "disconnect_in_stall", "k": 2, "product": "pg", "stream": True},
    {"kind": "fail_before", "times": 1, "product": "pd", "stream": True},
    {"kind": "fail_before", "times": -1, "product": "pg", "stream": False},
    {"kind": "fail_after", "k": 3, "product": "pg", "stream": True},
    {"kind": "fail_after", "k": 2, "product": "po", "stream": False},
    {"kind": "stall", "k": 2, "s": 0.25, "product": "pa", "stream": True},
    {"kind": "omit_usage", "n": 7, "product": "pa", "stream": False},
    {"kind": "omit_usage", "n": 7, "product": "pd", "stream": True},
    {"kind": "book_timeout", "timeout": 0.3, "product": "pd", "stream": True},
    {"kind": "queued_disconnect", "product": "pd", "stream": True},
]


def _run(me: As, a: Action) -> str:
    """Run one action; a short description of what the client saw."""
    kind, product, stream = a["kind"], a["product"], a["stream"]
    body: dict[str, Any] = {"model": product, "max_tokens": 40, "stream_options": {"include_usage": True}}
    if kind in ("disconnect", "disconnect_in_stall", "queued_disconnect"):
        if kind == "disconnect":
            body["sim"] = {"tokens_per_s": 100, "output_tokens": 40}
        elif kind == "disconnect_in_stall":
            body["sim"] = {"stall_after_tokens": a["k"], "stall_s": 0.3, "output_tokens": 20}
        else:
            body["model"] = "busy"
        with me.open_stream(body) as s:
            assert s.status == 200, (a, s.status)
            if kind == "queued_disconnect":
                read_until(s, comment_prefix="queued")
            else:
                read_until(s, data_chunks=a["k"])
        return "left"
    if kind == "book_timeout":
        body["model"] = "busy"
        body["timeout"] = a["timeout"]
    else:
        body["sim"] = {
            "normal": lambda: {"output_tokens": a["n"]},
            "fail_before": lambda: {"fail_before_output": a["times"], "output_tokens": 10},
            "fail_after": lambda: {"fail_after_tokens": a["k"], "output_tokens": 10},
            "stall": lambda: {"stall_after_tokens": a["k"], "stall_s": a["s"], "output_tokens": 8},
            "omit_usage": lambda: {"omit_usage": True, "output_tokens": a["n"]},
        }[kind]()
    if stream:
        res = me.stream(body)
        assert res.status == 200, (a, res.status, res.raw[:300])
        errors = [c["error"] for c in res.chunks if "error" in c]
        assert all(e.get("code") != "internal_error" for e in errors), (a, errors)
        return "stream:" + ",".join(str(e.get("code")) for e in errors)
    r = me.post(body)
    assert r.status_code in (200, 400, 408, 502), (a, r.status_code, r.text)
    return f"status:{r.status_code}"


def _check_account(gw: Gateway, me: As) -> None:
    left = me.wait_settled(timeout=20)
    assert left == [], f"holds still open after 20 s: {left}"
    me.assert_books()
    holds = me.holds()
    r = me.get("/v1/usage", params={"limit": 100})
    assert r.status_code == 200, r.text
    records = {d["id"]: d for d in r.json()["data"]}
    by_request = {h["request_id"]: h for h in holds}
    assert set(records) == set(by_request), (sorted(records), sorted(by_request))
    for rid, h in by_request.items():
        rec = records[rid]
        assert rec["usage"]["cost_micros"] == h["charged_micros"], (rec, h)
        assert rec["receipt"]["cost_micros"] == h["charged_micros"], (rec, h)
        assert (h["state"] == "reconciling") == (rec["outcome"] == "reconciling"), (rec, h)
    view = me.account_view()
    assert view["spent_micros"] == sum(h["charged_micros"] for h in holds), view
    assert view["open_holds_micros"] == 0, view


def test_random_traffic_keeps_the_ledger_balanced(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        blocker = new_caller(gw, "blocker", 10.0)
        hold_busy = {"model": "busy", "max_tokens": 256, "sim": {"tokens_per_s": 2, "output_tokens": 256}}
        with blocker.open_stream(hold_busy) as s:
            read_until(s, data_chunks=1)
            counter = itertools.count()

            @settings(
                max_examples=15,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(st.lists(actions, min_size=1, max_size=8))
            @example(ALL_KINDS)
            def check(seq: list[Action]) -> None:
                me = new_caller(gw, f"prop-{next(counter)}", 1.0)
                with ThreadPoolExecutor(max_workers=len(seq)) as pool:
                    seen = list(pool.map(lambda a: _run(me, a), seq))
                assert len(seen) == len(seq)
                _check_account(gw, me)
                assert_ledger_balanced(gw)

            check()
        # the blocker left too: nothing open anywhere, the books balance
        assert blocker.wait_settled() == []
        r = gw.admin("GET", "/admin/holds", params={"state": "open"})
        assert r.json()["data"] == [], r.json()
        assert_ledger_balanced(gw)
        assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200
