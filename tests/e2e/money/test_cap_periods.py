"""A key's weekly spend cap on a served gateway, over SQLite and PostgreSQL: requests
pass while their holds fit what the week has left, the next one gets 402
``key_budget_exceeded`` saying "per UTC week" and holds nothing; once the week is
over the count starts at zero by itself (no job), and the ledger check's invariant
(the key's counter is what its period's holds hold or charge) holds throughout. The
``bourse admin`` CLI sets a weekly and a monthly cap and lists them.

The week is turned by moving the key's counter and its holds' period numbers one
week back in the database (as if they had been placed last week): the gateway's
clock is the database's, which a test cannot move, and "a new week" is exactly a
stored number that is not the current week's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.money.support import As, expected_cost, new_caller, quote_tokens, run_statements
from tests.e2e.money.test_key_edit import _cli
from tests.faults.ledger import check_ledger
from tests.support.bodies import USER
from tests.support.gateway import Gateway, running_gateway

PRICE = 1.0
CONFIG = f"""
[products.weekly]
max_output_tokens = 512
sim_overrides = true
[[products.weekly.deployments]]
engine = "sim"
slots = 20
floor = {PRICE}
"""
MAX_TOKENS = 40
BODY = {"model": "weekly", "max_tokens": MAX_TOKENS, "sim": {"output_tokens": 5}}


def _row(gw: Gateway, key_id: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [k for k in gw.admin("GET", "/admin/keys", params={"account": "weekly"}).json()["data"]
            if k["id"] == key_id]  # fmt: skip
    assert len(rows) == 1
    return rows[0]


def _cost(me: As) -> int:
    r = me.post(BODY)
    assert r.status_code == 200, r.text
    assert me.wait_settled() == []
    return int(r.headers["x-bourse-cost-micros"])


def _last_week(gw: Gateway, db: str | None, key_id: str) -> None:
    """The key's counter and its holds, one week earlier."""
    statements = [
        ("UPDATE api_keys SET spend_period = spend_period - 1 WHERE id = ?", key_id),
        ("UPDATE holds SET spend_period = spend_period - 1 WHERE key_id = ?", key_id),
    ]
    run_statements(gw, db, statements)


def test_a_weekly_cap_refuses_past_it_and_starts_again_next_week(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        new_caller(gw, "weekly", 10.0)
        made = gw.admin(
            "POST", "/admin/keys", json={"account": "weekly", "spend_cap_usd": 1, "spend_cap_period": "week"}
        )
        assert made.status_code == 201, made.text
        key_id = made.json()["id"]
        assert made.json()["spend_cap_period"] == "week"
        me = As(gw, made.json()["key"], "weekly")

        first = _cost(me)  # what one request charges; its hold is the quote
        hold = expected_cost(quote_tokens(USER, MAX_TOKENS), PRICE)
        assert 0 < first < hold
        cap = 2 * first + hold - 1  # a second request fits, a third one's hold does not
        r = gw.admin("PATCH", f"/admin/keys/{key_id}", json={"spend_cap_usd": cap / 1_000_000})
        assert (r.status_code, r.json()["spend_cap_period"], r.json()["spend_micros"]) == (200, "week", first)
        assert _cost(me) == first
        holds = len(me.holds())
        r = me.post(BODY)
        assert r.status_code == 402, r.text
        err = r.json()["error"]
        assert err["code"] == "key_budget_exceeded" and "per UTC week" in err["message"], err
        assert len(me.holds()) == holds  # nothing held
        assert _row(gw, key_id)["spend_micros"] == 2 * first
        check_ledger(Path(gw.data_dir), db)

        _last_week(gw, db, key_id)
        assert _row(gw, key_id)["spend_micros"] == 0  # a new week: nothing taken yet
        check_ledger(Path(gw.data_dir), db)  # last week's holds still add up to its count
        assert _cost(me) == first and _cost(me) == first  # the whole cap again: two fit
        assert me.post(BODY).status_code == 402
        assert _row(gw, key_id)["spend_micros"] == 2 * first
        assert me.wait_settled() == []
        check_ledger(Path(gw.data_dir), db)


def test_the_admin_cli_sets_a_weekly_and_a_monthly_cap() -> None:
    with running_gateway(CONFIG) as gw:
        new_caller(gw, "weekly", 10.0)
        p = _cli(
            gw.url,
            "--json",
            "keys",
            "create",
            "--account",
            "weekly",
            "--cap-usd",
            "1",
            "--cap-period",
            "week",
        )
        assert p.returncode == 0, p.stderr
        key_id = json.loads(p.stdout)["id"]
        assert _row(gw, key_id)["spend_cap_period"] == "week"
        p = _cli(gw.url, "keys", "list", "--account", "weekly")
        assert p.returncode == 0 and "$0.000000 of $1.000000 this week" in p.stdout, p.stdout
        p = _cli(gw.url, "keys", "update", key_id, "--cap-period", "month")
        assert p.returncode == 0 and "spend_cap_period: month" in p.stdout, p.stderr
        p = _cli(gw.url, "keys", "list", "--account", "weekly")
        assert "$0.000000 of $1.000000 this month" in p.stdout, p.stdout
        p = _cli(gw.url, "keys", "update", key_id, "--cap-period", "year")
        assert p.returncode == 2 and "invalid choice: 'year'" in p.stderr, p.stderr
