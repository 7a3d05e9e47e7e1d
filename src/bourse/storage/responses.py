"""Stored responses of the Responses API (table ``responses``): a response's row,
written over as it changes, read back by its account until it expires.
"""

from __future__ import annotations

import orjson

from bourse.ports.stores import ResponseRecord
from bourse.storage.executor import Executor, Row


def response_row(row: Row) -> ResponseRecord:
    return ResponseRecord(
        id=row["id"],
        account_id=row["account_id"],
        status=row["status"],
        body=orjson.loads(row["body"]),
        input_items=orjson.loads(row["input_items"]),
        context=orjson.loads(row["context"]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
        job_id=row["job_id"],
    )


def put_response(db: Executor, r: ResponseRecord) -> None:
    db.execute(
        "INSERT INTO responses (id, account_id, status, job_id, body, input_items, context, created_at, expires_at) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO UPDATE SET status = $3, job_id = $4, "
        "body = $5, input_items = $6, context = $7, expires_at = $9",
        r.id, r.account_id, r.status, r.job_id, orjson.dumps(r.body).decode(),
        orjson.dumps(r.input_items).decode(), orjson.dumps(r.context).decode(), r.created_at, r.expires_at,
    )  # fmt: skip
