"""Retention on a served gateway, over SQLite and PostgreSQL (issue 35, item 9: "the
database grows ~1.5 KB a request with no retention for usage records and settled
holds").

A ``bourse serve`` process with ``[storage] retention_s`` set to a few seconds takes
requests (charged ones, released ones, a detached job, and ones whose hold goes to
``reconciling`` for want of usage), waits until they are older than the retention,
then takes more. The housekeeping's retention pass deletes the old requests' holds
and usage records (``GET /v1/usage/{id}`` is then a 404) and keeps the recent ones
and every reconciling hold; the books still balance to the micro-USD with what was
pruned counted through its sums (:mod:`tests.faults.ledger`), and so do the
gateway's own ledger and account views.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.databases import DATABASES, database
from tests.faults.ledger import check_ledger
from tests.faults.load import config
from tests.faults.served import ADMIN_KEY, Served
from tests.support.processes import serve_process

RETENTION_S = 4.0
PRUNED_WITHIN_S = 15.0
CONFIG = config(slots=8, extra=f"[storage]\nretention_s = {RETENTION_S}\nretention_interval_s = 0.2\n")
"""The fault suite's products (``pd``: the default policy; ``pa``: aigrid, which keeps a
hold without usage ``reconciling``), the retention a few seconds, looked at 5 times a second."""
USER = [{"role": "user", "content": "Tell me something about rivers."}]


@pytest.fixture(params=DATABASES)
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    data = tmp_path / "data"
    with (
        database(request.param) as dsn,
        serve_process(tmp_path, "gw", CONFIG, data, ADMIN_KEY, dsn) as (url, _),
    ):
        yield Served(url, data, dsn)


def _requests(gw: Served, keys: list[str]) -> list[str]:
    """Per key, in this order: a charged answer, one whose usage is missing (its hold goes
    to ``reconciling`` under the ``aigrid`` policy), one that fails before any output on
    every attempt (502: released), a detached job (charged); their request ids."""
    ids = []
    sims = [("pd", {"output_tokens": 5}, 200), ("pa", {"output_tokens": 3, "omit_usage": True}, 200),
            ("pd", {"output_tokens": 5, "fail_before_output": -1}, 502)]  # fmt: skip
    with httpx.Client(timeout=30) as c:
        for key in keys:
            auth = {"authorization": f"Bearer {key}"}
            for product, sim, status in sims:
                body = {"model": product, "messages": USER, "max_tokens": 16, "sim": sim}
                r = c.post(gw.url + "/v1/chat/completions", headers=auth, json=body)
                assert r.status_code == status, r.text
                ids.append(r.headers["x-request-id"])
            job = {"endpoint": "/v1/chat/completions",
                   "body": {"model": "pd", "messages": USER, "max_tokens": 8, "sim": {"output_tokens": 4}}}  # fmt: skip
            r = c.post(gw.url + "/v1/jobs", headers=auth, json=job)
            assert r.status_code == 202, r.text
            ids.append(r.json()["request_id"])
    return ids


def _holds_by_request(gw: Served) -> dict[str, set[str]]:
    """request id -> the states of its holds, read from the database."""
    books = gw.books()
    out: dict[str, set[str]] = {}
    for state, ids in books.states.items():
        for h in ids:
            out.setdefault(books.requests[h], set()).add(state)
    return out


def _usage_status(gw: Served, key: str, request_id: str) -> int:
    r = httpx.get(gw.url + f"/v1/usage/{request_id}", headers={"authorization": f"Bearer {key}"}, timeout=30)
    return r.status_code


def test_old_records_are_pruned_recent_kept_and_the_books_balance(served: Served) -> None:
    keys = served.accounts("ret", 2, 5.0)
    # a capped key too: its spend counter must still add up once its holds are pruned
    r = served.admin("POST", "/admin/keys", json={"account": "ret-0", "spend_cap_usd": 4.0})
    assert r.status_code == 201, r.text
    keys.append(r.json()["key"])
    # and a capped account: its counter too, counted on every one of its keys' holds
    r = served.admin(
        "PATCH", "/admin/accounts/ret-1", json={"spend_cap_usd": 4.0, "spend_cap_period": "month"}
    )
    assert r.status_code == 200, r.text
    old = _requests(served, keys)
    served.at_rest(30)
    before = _holds_by_request(served)
    reconciling = {r for r, states in before.items() if "reconciling" in states}
    assert len(reconciling) == len(keys), before  # one 'pa' request per key
    closed_old = {r for r in old if r in before and r not in reconciling}
    assert len(closed_old) == 3 * len(keys), (old, before)  # charged, released, the job's
    time.sleep(RETENTION_S + 0.5)  # every record above is now past the retention

    recent = _requests(served, keys)
    deadline = time.monotonic() + PRUNED_WITHIN_S
    while True:
        holds = _holds_by_request(served)
        left = closed_old & holds.keys()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"{len(left)} old requests not pruned within {PRUNED_WITHIN_S} s: {sorted(left)[:5]}"
    served.at_rest(30)
    holds = _holds_by_request(served)
    assert reconciling <= holds.keys() and all(holds[r] == {"reconciling"} for r in reconciling), holds
    recent_closed = {r for r in recent if r in holds and "reconciling" not in holds[r]}
    assert len(recent_closed) == 3 * len(keys), (recent, holds)

    key_of = {r: keys[i // 4] for i, r in enumerate(old)}
    key_of.update({r: keys[i // 4] for i, r in enumerate(recent)})
    assert {_usage_status(served, key_of[r], r) for r in closed_old} == {404}
    charged_recent = [r for r in recent_closed if "settled" in holds[r]]
    assert {_usage_status(served, key_of[r], r) for r in charged_recent} == {200}

    books = served.books()
    books.assert_balanced()
    check_ledger(
        served.data_dir, served.dsn
    )  # the ten invariants, the capped key's and account's counters too
    served.assert_served_books(books, "ret", 2)
    pruned = _pruned(served)
    assert pruned["holds"] == 3 * len(keys) and pruned["charged"] > 0, pruned
    assert pruned["charged"] == pruned["usage_cost"], pruned


def _pruned(gw: Served) -> dict[str, Any]:
    sql = ("SELECT COALESCE(SUM(holds), 0), COALESCE(SUM(usage_records), 0), COALESCE(SUM(charged_micros), 0), "
           "COALESCE(SUM(usage_cost_micros), 0) FROM pruned")  # fmt: skip
    if gw.dsn is None:
        import sqlite3

        conn = sqlite3.connect(f"file:{gw.data_dir / 'bourse.db'}?mode=ro", uri=True)
        try:
            row = conn.execute(sql).fetchone()
        finally:
            conn.close()
    else:
        import psycopg

        with psycopg.connect(gw.dsn) as pg:
            row = pg.execute(sql).fetchone()
    assert row is not None
    return dict(zip(("holds", "usage_records", "charged", "usage_cost"), (int(v) for v in row), strict=True))
