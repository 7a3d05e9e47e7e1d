"""A job whose result the database refuses after its run was charged: the charge goes
back in the same transaction as the job's failure, through a served ``bourse serve``
process on SQLite and PostgreSQL.

What is kept of a request is checked before its hold (``tests/faults/test_json_depth.py``),
so nothing the client sent can make the result unwritable; the database can still
refuse it (here a trigger refuses every job result, as a full disk or a constraint
would). Before: the job ended ``failed`` with a 500 ``internal_error`` and kept its
charge, an answer the client was charged for and never got. Now the job ends
``failed`` with a 503 ``no_capacity`` saying its charge was given back; its hold is
released with nothing charged, its usage record says ``error`` at no cost, the balance
and the key's spend are whole again, and the books balance.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.faults.databases import DATABASES, database
from tests.faults.served import ADMIN_KEY, Served
from tests.support.processes import serve_process

CONFIG = """
[products.h]
max_output_tokens = 64
[[products.h.deployments]]
engine = "sim"
slots = 2
floor = 1.0
"""
CREDIT_USD = 10.0
SQLITE_TRIGGER = (
    "CREATE TRIGGER refuse_results BEFORE UPDATE OF result ON jobs WHEN NEW.result IS NOT NULL "
    "BEGIN SELECT RAISE(ABORT, 'job results refused'); END"
)
PG_TRIGGER = [
    "CREATE FUNCTION refuse_results() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'job results refused'; END $$ "
    "LANGUAGE plpgsql",
    "CREATE TRIGGER refuse_results BEFORE UPDATE OF result ON jobs FOR EACH ROW WHEN (NEW.result IS NOT NULL) "
    "EXECUTE FUNCTION refuse_results()",
]


@pytest.fixture(params=DATABASES)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("refused")
    with (
        database(request.param) as dsn,
        serve_process(tmp, "refused", CONFIG, tmp / "data", ADMIN_KEY, database=dsn) as (url, _proc),
    ):
        yield Served(url, tmp / "data", dsn)


def _sql(served: Served, statements: list[str]) -> None:
    """Run ``statements`` on the gateway's database, beside the gateway."""
    if served.dsn is None:
        conn = sqlite3.connect(served.data_dir / "bourse.db", timeout=30)
        try:
            for s in statements:
                conn.execute(s)
            conn.commit()
        finally:
            conn.close()
        return
    import psycopg

    with psycopg.connect(served.dsn, autocommit=True) as pg:
        for s in statements:
            pg.execute(s.encode())  # fixed statements, no parameters


def _refuse_results(served: Served, refuse: bool) -> None:
    if refuse:
        _sql(served, [SQLITE_TRIGGER] if served.dsn is None else PG_TRIGGER)
    else:
        _sql(
            served,
            ["DROP TRIGGER refuse_results"]
            if served.dsn is None
            else ["DROP TRIGGER refuse_results ON jobs"],
        )


def _job(served: Served, key: str) -> dict[str, Any]:
    """Submit a small chat job and wait for its end."""
    headers = {"authorization": f"Bearer {key}"}
    body = {
        "endpoint": "/v1/chat/completions",
        "body": {"model": "h", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    }
    r = httpx.post(served.url + "/v1/jobs", json=body, headers=headers, timeout=30)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        job: dict[str, Any] = httpx.get(f"{served.url}/v1/jobs/{job_id}", headers=headers, timeout=30).json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not end: {job}")


def test_a_refused_job_result_gives_its_charge_back_with_the_failure(served: Served) -> None:
    [key] = served.accounts("refused", 1, CREDIT_USD)
    credit = round(CREDIT_USD * 1_000_000)
    _refuse_results(served, True)
    job = _job(served, key)
    assert job["status"] == "failed", job
    error = job["error"]["error"]
    assert (job["error"]["status"], error["code"]) == (503, "no_capacity"), job
    assert "given back" in error["message"], error
    usage = httpx.get(
        f"{served.url}/v1/usage/{job['request_id']}", headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    assert usage.status_code == 200, usage.text
    record = usage.json()
    assert record["outcome"] == "error" and record["receipt"]["cost_micros"] == 0, record
    assert record["usage"]["cost_micros"] == 0, record
    books = served.at_rest(10)
    books.assert_balanced()
    account = served.admin("GET", "/admin/accounts/refused-0").json()
    assert account["balance_micros"] == credit and account["spent_micros"] == 0, "a charge without its answer"
    hold = {h: r for h, r in books.requests.items() if r == job["request_id"]}
    assert hold and all(h in books.ids("released") for h in hold), (hold, books.states)

    # the database takes results again: the next job is answered and charged
    _refuse_results(served, False)
    job = _job(served, key)
    assert job["status"] == "succeeded", job
    books = served.at_rest(10)
    books.assert_balanced()
    assert served.admin("GET", "/admin/accounts/refused-0").json()["balance_micros"] < credit


def test_a_capped_keys_spend_is_given_back_too(served: Served) -> None:
    """And its account's: the account is capped by the day as well."""
    r = served.admin("POST", "/admin/accounts", json={"id": "capped", "credit_usd": CREDIT_USD,
                                                      "spend_cap_usd": 1.0, "spend_cap_period": "day"})  # fmt: skip
    assert r.status_code == 201, r.text
    r = served.admin(
        "POST", "/admin/keys", json={"account": "capped", "spend_cap_usd": 1.0, "spend_cap_period": "total"}
    )
    assert r.status_code == 201, r.text
    key, key_id = r.json()["key"], r.json()["id"]
    _refuse_results(served, True)
    job = _job(served, key)
    assert job["status"] == "failed", job
    served.at_rest(10).assert_balanced()
    [view] = [
        k
        for k in served.admin("GET", "/admin/keys", params={"account": "capped"}).json()["data"]
        if k["id"] == key_id
    ]
    assert view["spend_micros"] == 0, view
    account = served.admin("GET", "/admin/accounts/capped").json()
    assert (account["spend_cap_period"], account["spend_micros"]) == ("day", 0), account
