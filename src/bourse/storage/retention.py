"""Retention: usage records and closed holds past their age, deleted.

The unit is a request: its holds and its usage record go together, and only once all
of them are old (the usage record by its created_at, each hold by its updated_at, the
time it was closed), none of its holds is open or reconciling and no unfinished job
runs it (a resumed job reads its earlier hold). What they added up to goes to
``pruned`` in the same transaction, so the ledger's sums still balance (and what they
charged on a key's or an account's spend cap to ``pruned_key_spend`` and
``pruned_account_spend``, so each cap's counter is still its period's holds).
"""

from __future__ import annotations

from collections.abc import Sequence

from bourse.storage.executor import Executor
from bourse.storage.ledger import CLOSED

_OLD_ENOUGH = (
    "{h}." + CLOSED + " AND {h}.updated_at < {cutoff} "
    "AND NOT EXISTS (SELECT 1 FROM holds o WHERE o." + CLOSED + " "
    "AND o.request_id = {h}.request_id AND o.updated_at >= {cutoff}) "
    "AND {h}.request_id NOT IN (SELECT request_id FROM holds WHERE state = 'open') "
    "AND {h}.request_id NOT IN (SELECT request_id FROM holds WHERE state = 'reconciling') "
    "AND NOT EXISTS (SELECT 1 FROM usage u WHERE u.request_id = {h}.request_id AND u.created_at >= {cutoff}) "
    "AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.request_id = {h}.request_id AND j.status IN ('queued', 'running'))"
)
"""A closed hold whose request's records are all older than the cutoff, and free to go.
Each state of the request's other holds is looked up in its own partial index (the
closed ones by request; the open and reconciling ones, few, read once a statement):
no index has every hold of a request (migration 19)."""


def prunable(db: Executor, age_s: float, limit: int) -> list[str]:
    """Up to ``limit`` requests whose records are all older than ``age_s`` (a read)."""
    where = _OLD_ENOUGH.format(h="h", cutoff=f"({db.clock} - $1)")
    rows = db.fetch(
        f"SELECT DISTINCT h.request_id FROM holds h WHERE {where} LIMIT {max(1, int(limit))}", age_s
    )
    return [str(r["request_id"]) for r in rows]


def prune(db: Executor, request_ids: Sequence[str], age_s: float) -> tuple[int, int]:
    """Delete the holds and usage records of ``request_ids`` that are still old enough
    (checked again: this is a later transaction than the look), adding their sums to
    ``pruned``; (holds, usage records) deleted."""
    if not request_ids:
        return 0, 0
    ids = ", ".join(f"${i}" for i in range(2, len(request_ids) + 2))
    where = _OLD_ENOUGH.format(h="holds", cutoff=f"({db.clock} - $1)")
    gone = db.fetch(
        f"DELETE FROM holds WHERE request_id IN ({ids}) AND {where} "
        "RETURNING account_id, request_id, state, charged_micros, key_id, spend_period, account_period",
        age_s, *request_ids,
    )  # fmt: skip
    if not gone:
        return 0, 0
    sums: dict[str, list[int]] = {}  # account -> [charged, usage cost, holds, usage records]
    caps: dict[tuple[str, str, int], int] = {}  # (table, key or account, spend period) -> charged
    for r in gone:
        charged = int(r["charged_micros"]) if r["state"] == "settled" else 0
        acc = sums.setdefault(str(r["account_id"]), [0, 0, 0, 0])
        acc[0] += charged
        acc[2] += 1
        for table, owner, counted in (("pruned_key_spend", "key_id", "spend_period"),
                                      ("pruned_account_spend", "account_id", "account_period")):  # fmt: skip
            if charged and r[owner] is not None and r[counted] is not None:
                cap = (table, str(r[owner]), int(r[counted]))
                caps[cap] = caps.get(cap, 0) + charged
    done = sorted({str(r["request_id"]) for r in gone})
    used = db.fetch(
        f"DELETE FROM usage WHERE request_id IN ({', '.join(f'${i}' for i in range(1, len(done) + 1))}) "
        "RETURNING account_id, cost_micros",
        *done,
    )
    for r in used:
        acc = sums.setdefault(str(r["account_id"]), [0, 0, 0, 0])
        acc[1] += int(r["cost_micros"])
        acc[3] += 1
    for account_id, (charged, cost, holds, records) in sums.items():
        db.execute(
            "INSERT INTO pruned (account_id, charged_micros, usage_cost_micros, holds, usage_records, updated_at) "
            f"VALUES ($1, $2, $3, $4, $5, {db.clock}) ON CONFLICT (account_id) DO UPDATE SET "
            "charged_micros = pruned.charged_micros + excluded.charged_micros, "
            "usage_cost_micros = pruned.usage_cost_micros + excluded.usage_cost_micros, "
            "holds = pruned.holds + excluded.holds, usage_records = pruned.usage_records + excluded.usage_records, "
            "updated_at = excluded.updated_at",
            account_id, charged, cost, holds, records,
        )  # fmt: skip
    for (table, owner_id, period), charged in caps.items():
        owner = "key_id" if table == "pruned_key_spend" else "account_id"
        db.execute(
            f"INSERT INTO {table} ({owner}, spend_period, charged_micros) VALUES ($1, $2, $3) "
            f"ON CONFLICT ({owner}, spend_period) DO UPDATE SET "
            f"charged_micros = {table}.charged_micros + excluded.charged_micros",
            owner_id, period, charged,
        )  # fmt: skip
    return len(gone), len(used)
