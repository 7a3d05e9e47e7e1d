"""Jobs (table ``jobs``): a queued request's row, its updates as it runs, its claim by a
gateway (its owner's lease lapsed, on the database's clock), and a failed job's charge
given back with it in one transaction.
"""

from __future__ import annotations

from typing import Any

import orjson

from bourse.ports.stores import Job
from bourse.storage.executor import Executor, Row
from bourse.storage.ledger import reverse_charge


def job_counts(db: Executor) -> dict[str, int]:
    return {
        str(r["status"]): int(r["n"])
        for r in db.fetch("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
    }


_JOB_FIELDS = frozenset(
    {
        "status",
        "hold_id",
        "request_id",
        "started_at",
        "finished_at",
        "result",
        "error",
        "webhook_state",
        "webhook_error",
        "bid",
        "owner",
        "expires_at",
    }
)


def job_row(row: Row) -> Job:
    return Job(
        id=row["id"],
        account_id=row["account_id"],
        key_id=row["key_id"],
        endpoint=row["endpoint"],
        body=orjson.loads(row["body"]),
        status=row["status"],
        request_id=row["request_id"],
        bid=float(row["bid"]),
        created_at=float(row["created_at"]),
        expires_at=float(row["expires_at"]),
        hold_id=row["hold_id"],
        webhook_url=row["webhook_url"],
        webhook_state=row["webhook_state"],
        webhook_error=row["webhook_error"],
        result=None if row["result"] is None else orjson.loads(row["result"]),
        error=None if row["error"] is None else orjson.loads(row["error"]),
        started_at=None if row["started_at"] is None else float(row["started_at"]),
        finished_at=None if row["finished_at"] is None else float(row["finished_at"]),
        owner=row["owner"],
    )


def put_job(db: Executor, job: Job) -> None:
    db.execute(
        "INSERT INTO jobs (id, account_id, key_id, endpoint, body, status, request_id, bid, hold_id, webhook_url, "
        "webhook_state, created_at, expires_at, owner) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        job.id, job.account_id, job.key_id, job.endpoint, orjson.dumps(dict(job.body)).decode(), job.status,
        job.request_id, job.bid, job.hold_id, job.webhook_url, job.webhook_state, job.created_at, job.expires_at,
        job.owner,
    )  # fmt: skip


def claim_jobs(db: Executor, owner: str, all_others: bool, include_own: bool) -> list[Job]:
    mine = " OR owner = $1" if include_own else ""
    sql = "UPDATE jobs SET owner = $1 WHERE status IN ('queued', 'running') AND ("
    if all_others:
        rows = db.fetch(sql + f"owner IS NULL OR owner <> $1{mine}) RETURNING *", owner)
    else:  # only those whose owner's lease lapsed, on the database's clock
        live = (
            "owner IS NULL OR (owner <> $1 AND owner NOT IN "
            f"(SELECT id FROM instances WHERE lease_until >= {db.clock}))"
        )
        rows = db.fetch(sql + live + mine + ") RETURNING *", owner)
    jobs = [job_row(r) for r in rows]
    jobs.sort(key=lambda j: (j.created_at, j.id))
    return jobs


def update_job(db: Executor, job_id: str, fields: dict[str, Any]) -> None:
    sets: list[str] = []
    args: list[Any] = [job_id]
    for name, value in fields.items():
        if name not in _JOB_FIELDS:
            raise ValueError(f"not a job field: {name}")
        if name in ("result", "error") and value is not None:
            value = orjson.dumps(value).decode()
        args.append(value)
        sets.append(f"{name} = ${len(args)}")
    if sets:
        db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = $1", *args)


def fail_job_refunded(
    db: Executor, job_id: str, hold_id: str, fields: dict[str, Any], note: str, now: float
) -> int:
    given_back = reverse_charge(db, hold_id, note, now)
    update_job(db, job_id, fields)
    return given_back


def jobs_page(db: Executor, account_id: str, limit: int, after: str | None) -> list[Job]:
    args: list[Any] = [account_id]
    where = "account_id = $1"
    if after is not None:
        row = db.fetchrow("SELECT created_at FROM jobs WHERE account_id = $1 AND id = $2", account_id, after)
        if row is None:
            return []
        args.extend((row["created_at"], after))
        where += " AND (created_at < $2 OR (created_at = $2 AND id < $3))"
    sql = (
        f"SELECT * FROM jobs WHERE {where} ORDER BY created_at DESC, id DESC LIMIT {max(1, min(limit, 1000))}"
    )
    return [job_row(r) for r in db.fetch(sql, *args)]
