"""The JSON the dashboard's script reads: rows of the requests table, points of the
market charts, admissions, spend points. Plain functions of the stored records and
book views; the routes in :mod:`~bourse.http.dashboard.api` and
:mod:`~bourse.http.dashboard.streams` send them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from bourse.domain.money import micros_to_usd
from bourse.ports.book import Clear
from bourse.ports.reports import SpendPoint
from bourse.ports.stores import Account, UsageRecord
from bourse.services.tape import Sample

_STATUS = {"completed": 200, "timeout": 408}
"""The HTTP status an outcome implies (usage records do not keep the status)."""


def _sub(doc: Mapping[str, Any], *path: str) -> Any:
    value: Any = doc
    for part in path:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def request_row(rec: UsageRecord) -> dict[str, Any]:
    """One finished request (or one refused before the book: outcome ``refused``, with
    its status and ``error`` code), as a row of the requests table."""
    doc = rec.record
    status = doc.get("status", _STATUS.get(rec.outcome))
    return {
        "id": rec.request_id,
        "account": rec.account_id or None,
        "key_id": doc.get("key_id"),
        "product": rec.product or None,
        "created": rec.created_at,
        "outcome": rec.outcome,
        "status": status,
        "prompt_tokens": _sub(doc, "usage", "prompt_tokens"),
        "completion_tokens": _sub(doc, "usage", "completion_tokens"),
        "cost_micros": rec.cost_micros,
        "ttft_ms": _sub(doc, "receipt", "ttft_ms"),
        "latency_ms": _sub(doc, "receipt", "latency_ms"),
        "bid": _sub(doc, "usage", "x_market", "bid"),
        "cleared_price": _sub(doc, "usage", "x_market", "cleared_price"),
        "queued_ms": _sub(doc, "usage", "x_market", "queued_ms"),
        "deployment": _sub(doc, "usage", "x_market", "deployment"),
        "error": _sub(doc, "error", "code"),
    }


def request_detail(rec: UsageRecord) -> dict[str, Any]:
    """A request's row, its receipt and its whole usage record."""
    return {**request_row(rec), "receipt": rec.record.get("receipt"), "record": dict(rec.record)}


def account_doc(a: Account) -> dict[str, Any]:
    return {**asdict(a), "balance_usd": micros_to_usd(a.balance_micros)}


def point(s: Sample) -> dict[str, Any]:
    """One sample of a product's book, for the charts over time."""
    v = s.view
    return {
        "t": s.t,
        "level": v.level,
        "waiting": v.waiting,
        "best_bid": v.best_bid,
        "busy": {d.name: d.busy for d in v.deployments},
        "slots": {d.name: d.slots for d in v.deployments},
    }


def clear_doc(c: Clear) -> dict[str, Any]:
    """One admission: when, the order's bid, the price it cleared at, its wait; ``failed``:
    its run ended before any output (a failed attempt, nobody paid it: not a clear)."""
    return {"t": c.at, "bid": c.bid, "price": c.price, "deployment": c.deployment, "wait_s": c.waited_s,
            "failed": c.failed}  # fmt: skip


def spend_doc(p: SpendPoint) -> dict[str, Any]:
    return {"t": p.t, "account": p.account_id, "key_id": p.key_id, "cost_micros": p.cost_micros,
            "requests": p.requests}  # fmt: skip
