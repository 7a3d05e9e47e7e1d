"""The ``operators`` table's transactions (migration 0013): create, look up by key
hash, list, revoke."""

from __future__ import annotations

from typing import Any

from bourse.ports.operators import Operator, OperatorExists, UnknownOperator
from bourse.storage.executor import Executor, IntegrityError


def operator_row(row: Any) -> Operator:
    revoked = row["revoked_at"]
    return Operator(
        id=row["id"],
        name=row["name"],
        role=row["role"],
        created_at=float(row["created_at"]),
        revoked_at=None if revoked is None else float(revoked),
    )


def create_operator(db: Executor, op: Operator, key_hash: str) -> None:
    if db.fetchrow("SELECT id FROM operators WHERE name = $1", op.name) is not None:
        raise OperatorExists(op.name)
    try:
        db.execute(
            "INSERT INTO operators (id, name, role, key_hash, created_at) VALUES ($1, $2, $3, $4, $5)",
            op.id, op.name, op.role, key_hash, op.created_at,
        )  # fmt: skip
    except IntegrityError:
        raise OperatorExists(op.name) from None


def operator_by_hash(db: Executor, key_hash: str) -> Operator | None:
    row = db.fetchrow("SELECT * FROM operators WHERE key_hash = $1", key_hash)
    return None if row is None else operator_row(row)


def operators(db: Executor) -> list[Operator]:
    return [operator_row(r) for r in db.fetch("SELECT * FROM operators ORDER BY created_at, id")]


def revoke_operator(db: Executor, operator_id: str, now: float) -> Operator:
    row = db.fetchrow(
        "UPDATE operators SET revoked_at = COALESCE(revoked_at, $2) WHERE id = $1 RETURNING *",
        operator_id,
        now,
    )
    if row is None:
        raise UnknownOperator(operator_id)
    return operator_row(row)
