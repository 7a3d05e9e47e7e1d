"""The ledger's hot rows made narrow (issue 40, migration 18), on SQLite and PostgreSQL:

- the sealed webhook secret lives in ``webhook_secrets``, not on the account's row
  (written twice a request); a database migrated from version 17 keeps every secret;
- a usage record is stored compact (:mod:`bourse.storage.usage_codec`) and read back
  as the very document written, byte for byte once serialized; records written before
  the change read as they were.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import orjson
import pytest

from bourse.ports.reports import UsageFilter
from bourse.ports.stores import Hold, UnknownAccount, UsageRecord
from bourse.storage.executor import IntegrityError
from bourse.storage.ledger import reverse_charge
from bourse.storage.reports import SqlReports
from bourse.storage.schema import migrations
from bourse.storage.usage_codec import decode, encode
from tests.support.databases import StoreFactory

pytestmark = pytest.mark.anyio

LATEST = max(v for v, _ in migrations())
GATEWAY_DOC: dict[str, Any] = {
    "id": "chatcmpl-abc",
    "object": "bourse.usage",
    "created": 1_700_000_000,
    "model": "sim",
    "endpoint": "/v1/chat/completions",
    "outcome": "completed",
    "usage": {
        "prompt_tokens": 11, "completion_tokens": 8, "total_tokens": 19,
        "completion_tokens_details": {"reasoning_tokens": 0},
        "x_market": {"bid": 3.0, "start_bid": 3.0, "deadline_s": None, "cleared_price": 1.0, "level": 0,
                     "position_at_entry": 0, "queued_ms": 0.012, "requeues": 0, "deployment": "sim-0"},
        "cost": 1.9e-05, "cost_micros": 19,
    },
    "receipt": {"latency_ms": 1.353, "ttft_ms": None, "outcome": "completed", "cost_micros": 19,
                "quote_micros": 55},
    "key_id": "key_1",
    "correlation_id": "corr-1",
}  # fmt: skip
ODD_DOCS: list[dict[str, Any]] = [
    # a head the columns do not give (created not the int of created_at, another model)
    {**GATEWAY_DOC, "created": 1_700_000_000.5},
    {**GATEWAY_DOC, "model": "other"},
    {"object": "bourse.usage", "id": "chatcmpl-abc", "created": 1_700_000_000, "model": "sim"},
    # keys that read as codes, the mark, or an escape; nested lists; unicode
    {"": 1, "0": "zero", "~": "tilde", "~0": [{"a": 1, "": None, "bid": [1, {"~~": 2}]}], "é": "ü"},
    {"id": "chatcmpl-abc", "object": "bourse.usage", "created": 1_700_000_000, "model": "sim", "": 0},
    # lists (empty, of strings, of objects of known keys only) beside objects of known keys
    {
        "usage": {"bid": ["x", 1, {"level": [], "note": {}}], "x_market": [], "cost": {"at": ["y"]}},
        "l": [[], [0]],
    },
    # coded strings anywhere, and lists that look like them
    {"outcome": "error", "x": [1, 0], "y": ["completed", [1, 2], "/v1/responses"], "z": {"bid": "timeout"}},
    {"key_id": "completed"},
    {"key_id": ["completed", {"bid": 1}]},
    {},
]


def _record(doc: dict[str, Any], request_id: str = "chatcmpl-abc") -> UsageRecord:
    return UsageRecord(request_id, "a", "sim", 1_700_000_000.25, "completed", 19, doc)


@pytest.mark.parametrize("doc", [GATEWAY_DOC, *ODD_DOCS])
def test_the_codec_gives_back_the_document_written(doc: dict[str, Any]) -> None:
    text = encode(doc, "chatcmpl-abc", "sim", 1_700_000_000.25)
    assert orjson.dumps(decode(text, "chatcmpl-abc", "sim", 1_700_000_000.25)) == orjson.dumps(doc)


STORED = [
    '{"":1,"0":[1,6],"1":[1,0],"2":["567adno",11,8,19,["b",0],["efghijklm",3.0,3.0,null,1.0,0,0,0.012,0,"sim-0"],0.000019,19],"3":["pq1or",1.353,null,[1,0],19,55],"key_id":"key_1","4":"corr-1"}',
    '{"":0,"id":"chatcmpl-abc","object":"bourse.usage","created":1700000000.5,"model":"sim","0":[1,6],"1":[1,0],"2":["567adno",11,8,19,["b",0],["efghijklm",3.0,3.0,null,1.0,0,0,0.012,0,"sim-0"],0.000019,19],"3":["pq1or",1.353,null,[1,0],19,55],"key_id":"key_1","4":"corr-1"}',
    '{"":0,"id":"chatcmpl-abc","object":"bourse.usage","created":1700000000,"model":"other","0":[1,6],"1":[1,0],"2":["567adno",11,8,19,["b",0],["efghijklm",3.0,3.0,null,1.0,0,0,0.012,0,"sim-0"],0.000019,19],"3":["pq1or",1.353,null,[1,0],19,55],"key_id":"key_1","4":"corr-1"}',
    '{"":0,"object":"bourse.usage","id":"chatcmpl-abc","created":1700000000,"model":"sim"}',
    '{"":0,"~":1,"~0":"zero","~~":"tilde","~~0":[0,{"~a":1,"~":null,"e":[0,1,{"~~~":2}]}],"é":"ü"}',
    '{"":1,"~":0}',
    '{"":0,"2":["edn",[0,"x",1,["iy",[0],{}]],[0],["x",[0,"y"]]],"~l":[0,[0],[0,0]]}',
    '{"":0,"1":[1,3],"~x":[0,1,0],"~y":[0,[1,0],[0,1,2],[1,8]],"~z":["e",[1,4]]}',
    '{"":0,"key_id":"completed"}',
    '{"":0,"key_id":[0,[1,0],["e",1]]}',
    '{"":0}',
]
"""The text each of ``[GATEWAY_DOC, *ODD_DOCS]`` is stored as (written by the codec of
version 18): records already stored are read by these codes, so a faster encoder must
write the very same text."""


@pytest.mark.parametrize(("doc", "text"), list(zip([GATEWAY_DOC, *ODD_DOCS], STORED, strict=True)))
def test_the_codec_writes_the_text_it_always_wrote(doc: dict[str, Any], text: str) -> None:
    assert encode(doc, "chatcmpl-abc", "sim", 1_700_000_000.25) == text


def test_a_gateway_record_is_stored_in_much_less() -> None:
    plain = orjson.dumps(GATEWAY_DOC)
    compact = encode(GATEWAY_DOC, "chatcmpl-abc", "sim", 1_700_000_000.25)
    assert len(compact) < 0.6 * len(plain), (len(compact), len(plain))
    assert '"key_id":"key_1"' in compact  # the reports filter on it in SQL
    assert '"key_id":"completed"' in encode({"key_id": "completed"}, "r", "p", 1.0)  # never a coded string


async def test_usage_records_read_back_byte_for_byte(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10**6, 1.0)
        docs = [GATEWAY_DOC, *ODD_DOCS]
        for i, doc in enumerate(docs):
            await s.put_usage(_record(doc, f"chatcmpl-{i}") if i else _record(doc))
        got = {
            u.request_id: u for u in await s.usage_page("a", limit=100, before=None, since=None, until=None)
        }
        assert len(got) == len(docs)
        for i, doc in enumerate(docs):
            rid = f"chatcmpl-{i}" if i else "chatcmpl-abc"
            one = await s.usage("a", rid)
            assert one is not None
            assert orjson.dumps(one.record) == orjson.dumps(got[rid].record) == orjson.dumps(doc)
        # the reports' key filter reads key_id out of the stored JSON
        rows = await SqlReports(s).usage_rows(UsageFilter(key_id="key_1"), limit=100, after=None)
        assert {r.request_id for r in rows} == {"chatcmpl-abc", "chatcmpl-1", "chatcmpl-2"}


async def test_a_reversed_charge_rewrites_a_compact_record(store_factory: StoreFactory) -> None:
    async with store_factory() as s:
        await s.create_account("a", 10**6, 1.0)
        await s.place_hold(Hold("h1", "a", "chatcmpl-abc", 55, "open", owner="gw", created_at=1.0))
        await s.settle("h1", 19, _record(GATEWAY_DOC), 2.0)
        assert await s._run(reverse_charge, "h1", "lost", 3.0) == 19
        got = await s.usage("a", "chatcmpl-abc")
        assert got is not None and got.outcome == "error" and got.cost_micros == 0
        want = {**GATEWAY_DOC, "outcome": "error",
                "usage": {**GATEWAY_DOC["usage"], "cost": 0.0, "cost_micros": 0},
                "receipt": {**GATEWAY_DOC["receipt"], "outcome": "error", "cost_micros": 0},
                "reversed_micros": 19}  # fmt: skip
        assert orjson.dumps(got.record) == orjson.dumps(want)


def _run(store_factory: StoreFactory, statements: list[str]) -> list[Any]:
    if store_factory.kind == "sqlite":
        with sqlite3.connect(store_factory.target) as db:
            return [db.execute(st).fetchall() for st in statements]
    import psycopg

    with psycopg.connect(store_factory.target) as pg:
        return [pg.execute(st).fetchall() if st.startswith("SELECT") else pg.execute(st) for st in statements]


async def test_the_webhook_secrets_migration_keeps_every_secret_and_record(
    store_factory: StoreFactory,
) -> None:
    """A ledger at version 17 with a sealed secret, an account without one and a usage
    record of the old (plain) form: migrated, each secret is read from its new table,
    the account's row has no secret column, and the record reads as it was."""
    sealed = "v1:" + "x" * 160
    old_doc = orjson.dumps(GATEWAY_DOC).decode().replace("'", "''")
    _run(store_factory, [
        *(st for v, sts in migrations() if v <= 17 for st in sts),
        "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)",
        *(f"INSERT INTO schema_migrations (version, applied_at) VALUES ({v}, 1)" for v in range(1, 18)),
        f"INSERT INTO accounts (id, balance_micros, created_at, webhook_secret) VALUES ('a', 100, 1, '{sealed}')",
        "INSERT INTO accounts (id, balance_micros, created_at, webhook_secret) VALUES ('b', 100, 1, NULL)",
        "INSERT INTO usage (request_id, account_id, product, created_at, outcome, cost_micros, record) "
        f"VALUES ('chatcmpl-abc', 'a', 'sim', 1700000000.25, 'completed', 19, '{old_doc}')",
    ])  # fmt: skip
    async with store_factory() as s:
        assert await s.migrate() == LATEST
        assert await s.webhook_secret("a") == sealed  # no secret box here: read as stored
        assert await s.webhook_secret("b") is None
        got = await s.usage("a", "chatcmpl-abc")
        assert got is not None and orjson.dumps(got.record) == orjson.dumps(GATEWAY_DOC)
        await s.set_webhook_secret("b", "whsec_new", 2.0)
        await s.set_webhook_secret("a", "whsec_newer", 2.0)
        assert (await s.webhook_secret("a"), await s.webhook_secret("b")) == ("whsec_newer", "whsec_new")
        with pytest.raises(UnknownAccount):
            await s.set_webhook_secret("nobody", "whsec_x", 2.0)
        await s.create_account("c", 0, 3.0)
        assert len(await s.webhook_secret("c") or "") == 48  # a new account gets its secret there too
    [cols, secrets] = _run(store_factory, [
        "SELECT * FROM accounts WHERE id = 'a'" if store_factory.kind == "postgres" else
        "SELECT name FROM pragma_table_info('accounts')",
        "SELECT account_id FROM webhook_secrets ORDER BY account_id",
    ])  # fmt: skip
    assert "webhook_secret" not in str(cols)
    assert [r[0] for r in secrets] == ["a", "b", "c"]


async def test_writes_over_rows_that_exist_fall_back_to_the_single_statements(
    store_factory: StoreFactory,
) -> None:
    """PostgreSQL writes a hold or a close as one statement without ON CONFLICT; where
    it meets a row that exists (a usage record written before the close, a hold id
    placed twice) the statement rolls back and the single statements run: the record
    is written over, the second hold of an id is refused, the money is exact."""
    async with store_factory() as s:
        await s.create_account("a", 1_000, 1.0)
        first = UsageRecord("chatcmpl-abc", "a", "sim", 1_700_000_000.25, "reconciling", 0, {"note": "first"})
        await s.put_usage(first)
        hold = Hold("h1", "a", "chatcmpl-abc", 55, "open", owner="gw", created_at=1.0)
        await s.place_hold(hold)
        with pytest.raises(IntegrityError):
            await s.place_hold(hold)
        await s.settle("h1", 19, _record(GATEWAY_DOC), 2.0)
        got = await s.usage("a", "chatcmpl-abc")
        assert got is not None and (got.outcome, got.cost_micros) == ("completed", 19)
        assert orjson.dumps(got.record) == orjson.dumps(GATEWAY_DOC)
        account = await s.account("a")
        assert account is not None
        assert (account.balance_micros, account.open_holds_micros, account.spent_micros) == (981, 0, 19)
