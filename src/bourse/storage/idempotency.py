"""Idempotency keys (table ``idempotency``): a key's first use, its stored answer, and
a later use finding it (the same body: the answer again; another body: a conflict).
"""

from __future__ import annotations

import orjson

from bourse.ports.stores import IdemBegin, StoredResponse
from bourse.storage.executor import Executor


def idem_begin(
    db: Executor, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
) -> IdemBegin:
    db.execute(
        "DELETE FROM idempotency WHERE account_id = $1 AND key = $2 AND expires_at < $3", account_id, key, now
    )
    row = db.fetchrow(
        "SELECT body_hash, state, status, headers, body FROM idempotency WHERE account_id = $1 AND key = $2",
        account_id, key,
    )  # fmt: skip
    if row is None:
        db.execute(
            "INSERT INTO idempotency (account_id, key, body_hash, state, created_at, expires_at) "
            "VALUES ($1, $2, $3, 'in_flight', $4, $5)",
            account_id, key, body_hash, now, now + ttl_s,
        )  # fmt: skip
        return IdemBegin("new")
    if row["body_hash"] != body_hash:
        return IdemBegin("conflict")
    if row["state"] != "done":
        return IdemBegin("in_flight")
    headers = orjson.loads(row["headers"]) if row["headers"] else {}
    return IdemBegin("done", StoredResponse(int(row["status"]), headers, bytes(row["body"] or b"")))


def idem_complete(db: Executor, account_id: str, key: str, response: StoredResponse | None) -> None:
    if response is None:
        db.execute("DELETE FROM idempotency WHERE account_id = $1 AND key = $2", account_id, key)
        return
    db.execute(
        "UPDATE idempotency SET state = 'done', status = $3, headers = $4, body = $5 WHERE account_id = $1 AND key = $2",
        account_id, key, response.status, orjson.dumps(dict(response.headers)).decode(), response.body,
    )  # fmt: skip
