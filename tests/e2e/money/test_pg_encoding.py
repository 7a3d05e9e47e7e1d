"""A ledger in a PostgreSQL database made with another server encoding than UTF8
(``SQL_ASCII``, what a bare ``initdb`` under the C locale gives, as a distribution's
package may): psycopg reads such a database's text as bytes unless the connection says
its client encoding, and the gateway then refused to start (the secret key's
fingerprint, read back as bytes, "sealed with another key"). Every connection asks for
UTF8 (``storage/postgres.py``), so it starts, serves and charges as on any other."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.money.support import As, new_caller
from tests.faults.ledger import check_ledger
from tests.support.bodies import USER
from tests.support.databases import fresh_postgres_database
from tests.support.gateway import running_gateway

CONFIG = """
[products.plain]
[[products.plain.deployments]]
engine = "sim"
slots = 2
floor = 1.0
"""


def test_a_sql_ascii_database_serves_and_charges() -> None:
    ascii_db = fresh_postgres_database("ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
    with ascii_db as db, running_gateway(CONFIG, database=db) as gw:
        me: As = new_caller(gw, "ascii", 1.0)
        r = me.post({"model": "plain", "messages": USER, "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert me.wait_settled() == []
        r = gw.admin("POST", "/admin/accounts/ascii/debit", json={"amount_usd": 0.5, "reason": "crédit été"})
        assert r.status_code == 200, r.text
        audit = gw.admin("GET", "/admin/audit").json()["data"]
        assert any("crédit été" in str(a.get("detail")) for a in audit), audit  # text outside ASCII read back
        check_ledger(Path(gw.data_dir), db)
