"""The ledger check the fault suite runs after every test (:func:`tests.faults.ledger.check_ledger`)
finds each of its ten invariants broken: a served gateway's real books (a charged
chat completion, a capped key's spend and a capped account's, a finished job), copied, then damaged one way at
a time in the copy. The untouched copy passes.

And the suite runs it on every database a fault test uses, however the test made it:
a gateway in process (:func:`tests.support.asgi.in_process_gateway`) and a store opened
by the test itself in :func:`tests.support.ledgers.watched`, each damaged before it
stops, fail the test as they stop."""

from __future__ import annotations

import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from bourse.storage.sqlite import SqliteStore
from tests.faults.ledger import check_ledger
from tests.support.asgi import in_process_gateway
from tests.support.gateway import Gateway, running_gateway
from tests.support.ledgers import WATCH, watched

CONFIG = """
[server]
log_level = "warning"

[products.chat]
[[products.chat.deployments]]
engine = "sim"
slots = 2
floor = 1.0
output_tokens = 8
"""

DAMAGE = {
    "1: credits": "UPDATE accounts SET balance_micros = balance_micros + 1 WHERE id = (SELECT MIN(id) FROM accounts)",
    "1: account": "UPDATE credits SET account_id = (SELECT a.id FROM accounts a WHERE a.id <> credits.account_id "
    "LIMIT 1) WHERE id = (SELECT MIN(id) FROM credits)",
    "2: account": "UPDATE accounts SET balance_micros = -1 WHERE id = (SELECT MIN(id) FROM accounts)",
    "3/9: hold": "UPDATE holds SET amount_micros = charged_micros - 1, "
    "charged_micros = charged_micros WHERE state = 'settled' AND charged_micros > 0",
    "4: settled hold": "DELETE FROM usage WHERE cost_micros > 0",
    "4: usage record": "UPDATE holds SET state = 'released', charged_micros = 0 WHERE state = 'settled'",
    "5: request": "INSERT INTO holds (id, account_id, request_id, amount_micros, charged_micros, state, owner, "
    "note, created_at, updated_at) SELECT 'h-twice', account_id, request_id, amount_micros, charged_micros, "
    "'settled', owner, note, created_at, updated_at FROM holds WHERE state = 'settled' AND charged_micros > 0 "
    "LIMIT 1",
    "6: key": "UPDATE api_keys SET spend_micros = spend_micros + 1 WHERE spend_cap_micros IS NOT NULL",
    "6: account": "UPDATE accounts SET spend_micros = spend_micros + 1 WHERE spend_cap_micros IS NOT NULL",
    "7: job": "UPDATE holds SET state = 'open', charged_micros = 0 WHERE id = (SELECT hold_id FROM jobs LIMIT 1)",
    "10: account": "UPDATE accounts SET pending_micros = pending_micros + 1 WHERE id = (SELECT MIN(id) FROM accounts)",
    # a record in the plain form (as before migration 18) that says another cost
    "8: usage record": 'UPDATE usage SET record = \'{"usage": {"cost_micros": -1}}\' WHERE cost_micros > 0',
    # a compact record (storage/usage_codec.py) whose column says another cost
    "8: usage record chatcmpl-": "UPDATE usage SET cost_micros = cost_micros + 1 "
    "WHERE cost_micros > 0 AND request_id LIKE 'chatcmpl-%'",
}
"""What each damage must be reported as (the start of the violation) -> the SQL."""


@pytest.fixture(scope="module")
def books(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of a stopped gateway's database that holds every kind of row the check reads."""
    copy = tmp_path_factory.mktemp("books")
    with running_gateway(CONFIG) as gw:
        _fill(gw)
        data = Path(gw.data_dir)
        _wait_quiet(data)
        with (
            sqlite3.connect(data / "bourse.db", timeout=30) as live,
            sqlite3.connect(copy / "pristine.db") as out,
        ):
            live.backup(out)  # the WAL's pages too
    yield copy / "pristine.db"


def _fill(gw: Gateway) -> None:
    gw.new_account("bystander", 1.0)  # a second account, for the damage that moves a credit
    capped = gw.admin(
        "PATCH", f"/admin/accounts/{gw.account}", json={"spend_cap_usd": 50, "spend_cap_period": "month"}
    )
    assert capped.status_code == 200, capped.text
    key = gw.new_key(gw.account, spend_cap_usd=5)
    body = {"model": "chat", "messages": [{"role": "user", "content": "rivers"}], "max_tokens": 8}
    auth = {"authorization": f"Bearer {key}"}
    r = httpx.post(f"{gw.v1}/chat/completions", json=body, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{gw.url}/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth,
                   timeout=30)  # fmt: skip
    assert r.status_code in (200, 201, 202), r.text
    job = r.json()["id"]
    deadline = time.monotonic() + 30
    while httpx.get(f"{gw.url}/v1/jobs/{job}", headers=auth, timeout=10).json()["status"] != "succeeded":
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.05)


def _wait_quiet(data: Path) -> None:
    """Until no hold is open (the job's settlement is written)."""
    deadline = time.monotonic() + 15
    while True:
        with sqlite3.connect(data / "bourse.db", timeout=30) as db:
            if db.execute("SELECT COUNT(*) FROM holds WHERE state = 'open'").fetchone()[0] == 0:
                return
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_real_books_pass(books: Path, tmp_path: Path) -> None:
    shutil.copy(books, tmp_path / "bourse.db")
    with sqlite3.connect(tmp_path / "bourse.db") as db:
        kinds = db.execute(
            "SELECT (SELECT COUNT(*) FROM usage WHERE cost_micros > 0), (SELECT COUNT(*) FROM jobs), "
            "(SELECT COUNT(*) FROM api_keys WHERE spend_cap_micros IS NOT NULL AND spend_micros > 0), "
            "(SELECT COUNT(*) FROM accounts WHERE spend_cap_micros IS NOT NULL AND spend_micros > 0)"
        ).fetchone()
    assert kinds[0] >= 2 and kinds[1] == 1 and kinds[2] == 1 and kinds[3] == 1, kinds
    check_ledger(tmp_path, None, settle_s=0)


@pytest.mark.parametrize("said", list(DAMAGE))
def test_each_invariant_is_checked(books: Path, tmp_path: Path, said: str) -> None:
    shutil.copy(books, tmp_path / "bourse.db")
    with sqlite3.connect(tmp_path / "bourse.db") as db:
        db.execute("PRAGMA ignore_check_constraints = ON")
        assert db.execute(DAMAGE[said]).rowcount >= 1, said
    with pytest.raises(AssertionError) as broken:
        check_ledger(tmp_path, None, settle_s=0.2)
    assert re.search("[\"']" + re.escape(said), str(broken.value)), broken.value


def _damage(data_dir: Path, said: str) -> None:
    with sqlite3.connect(data_dir / "bourse.db", timeout=30) as db:
        db.execute("PRAGMA ignore_check_constraints = ON")
        assert db.execute(DAMAGE[said]).rowcount >= 1, said


def test_an_in_process_gateway_is_checked_as_it_stops(tmp_path: Path) -> None:
    async def damaged() -> None:
        async with in_process_gateway(CONFIG, tmp_path) as gw:
            assert any(ledger.data_dir == tmp_path for ledger in WATCH.live), WATCH.live
            assert (await gw.get("/v1/account")).status_code == 200
            _damage(tmp_path, "10: account")

    with pytest.raises(AssertionError) as broken:
        anyio.run(damaged)
    assert re.search("[\"']10: account", str(broken.value)), broken.value


def test_a_store_a_test_opens_itself_is_checked_when_its_block_ends(tmp_path: Path) -> None:
    async def books() -> None:
        store = SqliteStore(tmp_path / "bourse.db")
        await store.open()
        try:
            await store.create_account("acct", 1_000, time.time())
        finally:
            await store.close()

    with pytest.raises(AssertionError) as broken, watched(tmp_path, None):
        anyio.run(books)
        _damage(tmp_path, "2: account")
    assert re.search("[\"']2: account", str(broken.value)), broken.value
