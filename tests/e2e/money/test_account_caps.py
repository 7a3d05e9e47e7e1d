"""An account's daily spend cap on a served gateway, through the official ``openai``
SDK, over SQLite and PostgreSQL (issue 37, item 4): requests of the account's two keys
pass while their holds fit what the day has left; the next one, from either key, is
refused on the wire with 402 ``account_budget_exceeded``, a message that says it is
the account's cap and when it starts again (the next UTC midnight), and holds
nothing, streamed or not; once the day is over the count starts at zero by itself (no
job), and the ledger check (the account's counter is what its period's holds hold or
charge) holds throughout. The ``bourse admin`` CLI sets, changes and lists the cap.

The day is turned by moving the account's counter and its holds' period numbers one
day back in the database (as if they had been placed yesterday): the gateway's clock
is the database's, which a test cannot move, and "a new day" is exactly a stored
number that is not the current day's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.money.support import As, expected_cost, quote_tokens, run_statements
from tests.e2e.money.test_key_edit import _cli
from tests.faults.ledger import check_ledger
from tests.support.bodies import USER
from tests.support.gateway import Gateway, running_gateway

PRICE = 1.0
CONFIG = f"""
[products.daily]
max_output_tokens = 512
sim_overrides = true
[[products.daily.deployments]]
engine = "sim"
slots = 20
floor = {PRICE}
"""
MAX_TOKENS = 40
SIM = {"sim": {"output_tokens": 5}}


def _account(gw: Gateway, account: str) -> dict[str, Any]:
    r = gw.admin("GET", f"/admin/accounts/{account}")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _ask(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="daily",
        messages=USER,
        max_tokens=MAX_TOKENS,
        extra_body=SIM,
        **kw,
    )


def _cost(gw: Gateway, me: As, client: openai.OpenAI) -> int:
    raw = client.chat.completions.with_raw_response.create(
        model="daily",
        messages=USER,
        max_tokens=MAX_TOKENS,
        extra_body=SIM,
    )
    assert raw.http_request is not None and raw.status_code == 200
    assert me.wait_settled() == []
    return int(raw.headers["x-bourse-cost-micros"])


def _refused(client: openai.OpenAI, **kw: Any) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        out = _ask(client, **kw)
        if kw.get("stream"):
            list(out)
    return caught.value


def _yesterday(gw: Gateway, db: str | None, account: str) -> None:
    """The account's counter and its holds, one day earlier."""
    statements = [
        ("UPDATE accounts SET spend_period = spend_period - 1 WHERE id = ?", account),
        ("UPDATE holds SET account_period = account_period - 1 WHERE account_id = ?", account),
    ]
    run_statements(gw, db, statements)


def test_a_daily_account_cap_refuses_every_key_on_the_wire_and_starts_again_next_day(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        made = gw.admin("POST", "/admin/accounts",
                        json={"id": "team", "credit_usd": 10.0, "spend_cap_usd": 1, "spend_cap_period": "day"})  # fmt: skip
        assert made.status_code == 201, made.text
        assert (made.json()["spend_cap_micros"], made.json()["spend_cap_period"]) == (1_000_000, "day")
        keys = [gw.new_key("team"), gw.new_key("team", spend_cap_usd=5)]  # the second's own cap is far
        me = As(gw, keys[0], "team")
        clients = [gw.client(api_key=k) for k in keys]

        first = _cost(gw, me, clients[0])  # what one request charges; its hold is the quote
        hold = expected_cost(quote_tokens(USER, MAX_TOKENS), PRICE)
        assert 0 < first < hold
        cap = 2 * first + hold - 1  # a second request fits, a third one's hold does not
        r = gw.admin("PATCH", "/admin/accounts/team", json={"spend_cap_usd": cap / 1_000_000})
        assert (r.status_code, r.json()["spend_cap_period"], r.json()["spend_micros"]) == (200, "day", first)
        assert _cost(gw, me, clients[1]) == first  # the other key: the same account's day
        holds = len(me.holds())
        tomorrow = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((time.time() // 86_400 + 1) * 86_400))
        for client, stream in ((clients[0], False), (clients[1], False), (clients[1], True)):
            err = _refused(client, stream=stream)
            assert err.status_code == 402, err
            body = err.body if isinstance(err.body, dict) else {}
            assert err.code == "account_budget_exceeded" and body.get("type") == "insufficient_funds", (
                err.body
            )
            assert f"This account's spend cap is {cap} micro-USD per UTC day" in err.message, err.message
            assert f"{2 * first} micro-USD of it is spent or held" in err.message, err.message
            assert f"It starts again at {tomorrow} (the next UTC day)" in err.message, err.message
        assert len(me.holds()) == holds  # nothing held
        view = _account(gw, "team")
        assert (view["spend_micros"], view["spend_cap_resets_at"]) == (
            2 * first,
            (time.time() // 86_400 + 1) * 86_400,
        )
        check_ledger(Path(gw.data_dir), db)

        _yesterday(gw, db, "team")
        assert _account(gw, "team")["spend_micros"] == 0  # a new day: nothing taken yet
        check_ledger(Path(gw.data_dir), db)  # yesterday's holds still add up to its count
        assert (
            _cost(gw, me, clients[1]) == first and _cost(gw, me, clients[0]) == first
        )  # the whole cap again
        assert _refused(clients[0]).status_code == 402
        assert _account(gw, "team")["spend_micros"] == 2 * first
        assert me.wait_settled() == []
        check_ledger(Path(gw.data_dir), db)


def test_the_admin_cli_sets_changes_and_lists_an_accounts_cap() -> None:
    with running_gateway(CONFIG) as gw:
        p = _cli(gw.url, "--json", "accounts", "create", "cli-team", "--credit-usd", "5", "--cap-usd", "2",
                 "--cap-period", "week")  # fmt: skip
        assert p.returncode == 0, p.stderr
        made = json.loads(p.stdout)
        assert (made["spend_cap_micros"], made["spend_cap_period"]) == (2_000_000, "week")
        p = _cli(gw.url, "accounts", "list")
        line = next(x for x in p.stdout.splitlines() if x.startswith("cli-team"))
        assert "$0.000000 of $2.000000 this week" in line, p.stdout
        p = _cli(gw.url, "accounts", "update", "cli-team", "--cap-usd", "3", "--cap-period", "month")
        assert (
            p.returncode == 0 and "spend_cap: $3.000000" in p.stdout and "spend_cap_period: month" in p.stdout
        )
        p = _cli(gw.url, "accounts", "show", "cli-team")
        assert "spend_cap_resets_at: " in p.stdout and "spend: $0.000000" in p.stdout, p.stdout
        p = _cli(gw.url, "accounts", "update", "cli-team", "--cap-usd", "none")
        assert p.returncode == 0 and "spend_cap: -" in p.stdout and "spend_cap_period: -" in p.stdout, (
            p.stdout
        )
        p = _cli(gw.url, "accounts", "update", "cli-team", "--cap-period", "day")
        assert p.returncode == 2 and "400 invalid_request" in p.stderr and "no spend cap" in p.stderr, (
            p.stderr
        )
        p = _cli(gw.url, "accounts", "update", "cli-team", "--cap-period", "year")
        assert p.returncode == 2 and "invalid choice: 'year'" in p.stderr, p.stderr
        rows = gw.admin("GET", "/admin/audit", params={"target": "cli-team"}).json()["data"]
        assert [(e["action"], e["actor"]) for e in rows][:2] == [("account.update", "admin:cli")] * 2
