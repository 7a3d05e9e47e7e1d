"""An operator's debit and refund of an account (issue 37 item 2), on a served gateway
over SQLite and PostgreSQL: each is a ledger entry with its reason and an audit entry;
a debit is a charge with its usage record (outcome ``debit``, in the usage export),
never past the balance (402); the books balance (the fault suite's ten invariants)
after each; a user key cannot call them; the CLI does the same. Before, ``credit
--amount-usd -5`` was a 400 and there was no debit at all."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.money.support import new_caller
from tests.faults.ledger import check_ledger
from tests.support.gateway import ADMIN_KEY, running_gateway

CONFIG = """
[products.adj]
[[products.adj.deployments]]
engine = "sim"
floor = 1.0
"""


def test_a_debit_is_a_charge_with_its_reason_and_a_refund_a_credit(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        me = new_caller(gw, "adj", 10.0)
        r = gw.admin(
            "POST", "/admin/accounts/adj/debit", json={"amount_usd": 2.5, "reason": "chargeback 1234"}
        )
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["balance_micros"] == 7_500_000 and doc["spent_micros"] == 2_500_000, doc
        rid = doc["debit"]["request_id"]
        assert doc["debit"]["amount_micros"] == 2_500_000
        usage = me.usage(rid)  # the account sees it as a record of its own
        assert (usage["outcome"], usage["usage"]["cost_micros"]) == ("debit", 2_500_000), usage
        assert usage["adjustment"]["reason"] == "chargeback 1234"
        table = gw.admin("GET", "/admin/usage.csv", params={"account": "adj"}).text
        rows = [row for row in csv.DictReader(io.StringIO(table)) if row["request_id"] == rid]
        assert len(rows) == 1 and rows[0]["outcome"] == "debit" and rows[0]["cost_usd"] == "2.500000", rows

        over = gw.admin("POST", "/admin/accounts/adj/debit", json={"amount_usd": 7.6, "reason": "too much"})
        assert over.status_code == 402 and over.json()["error"]["code"] == "insufficient_funds", over.text
        assert me.balance() == 7_500_000  # nothing moved

        r = gw.admin("POST", "/admin/accounts/adj/refund", json={"amount_usd": 1.0, "reason": "outage"})
        assert r.status_code == 200 and r.json()["balance_micros"] == 8_500_000, r.text
        me.assert_books()
        check_ledger(Path(gw.data_dir), db)

        audit = gw.admin("GET", "/admin/audit", params={"target": "adj"}).json()["data"]
        seen = {(e["action"], e["detail"].get("amount_micros"), e["detail"].get("reason")) for e in audit}
        assert {
            ("account.debit", 2_500_000, "chargeback 1234"),
            ("account.refund", 1_000_000, "outage"),
        } <= seen

        for path, body in (
            ("debit", {"amount_usd": 0, "reason": "x"}),
            ("debit", {"amount_usd": 1.0}),
            ("debit", {"amount_usd": 1.0, "reason": ""}),
            ("refund", {"amount_usd": -5, "reason": "x"}),
            ("refund", {"amount_usd": 1.0, "reason": "x" * 501}),
        ):
            bad = gw.admin("POST", f"/admin/accounts/adj/{path}", json=body)
            assert bad.status_code == 400, (path, body, bad.text)
        missing = gw.admin("POST", "/admin/accounts/nobody/debit", json={"amount_usd": 1.0, "reason": "x"})
        assert missing.status_code == 404, missing.text
        as_user = me.post({}, path="/admin/accounts/adj/refund")
        assert as_user.status_code == 403, as_user.text
        check_ledger(Path(gw.data_dir), db)


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", url, "--admin-key", ADMIN_KEY, "--json", *args],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_the_cli_debits_and_refunds(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        new_caller(gw, "cli", 3.0)
        out = _cli(gw.url, "accounts", "debit", "cli", "--amount-usd", "1", "--reason", "late fee")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["balance_micros"] == 2_000_000
        out = _cli(gw.url, "accounts", "refund", "cli", "--amount-usd", "0.5", "--reason", "goodwill")
        assert out.returncode == 0 and json.loads(out.stdout)["balance_micros"] == 2_500_000, out.stderr
        out = _cli(gw.url, "accounts", "debit", "cli", "--amount-usd", "9", "--reason", "too much")
        assert out.returncode != 0 and "insufficient" in out.stderr, (out.stdout, out.stderr)
        check_ledger(Path(gw.data_dir), db)
