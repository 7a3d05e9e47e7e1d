"""The Redis book's entries as text (the layout ``lua/book.lua`` describes): read from
what the scripts return (a clear, a slot in use, an admission's terms) and written for
the heartbeat script (a waiting order, a slot held, to rest again what Redis forgot)."""

from __future__ import annotations

from bourse.domain.book import Admission, Order
from bourse.ports.book import Clear

FAILED_MARK = "|x"
"""Ends a recent entry whose run failed before any output (``lua/book_failed.lua``)."""


def clear(entry: str, skew: float) -> Clear:
    """A ``recent`` entry ('ms|price|bid|deployment|order_id|attempt', then ``|x`` for a
    failed attempt; an entry written before has the first four only) as a clear, on
    this replica's clock (``skew``: its time less Redis's)."""
    at, price, bid, rest = entry.split("|", 3)
    failed = rest.endswith(FAILED_MARK)
    if failed:
        rest = rest[: -len(FAILED_MARK)]
    dep, oid, attempt = rest, "", 0
    parts = rest.rsplit("|", 2)
    if len(parts) == 3 and parts[2].isdigit():
        dep, oid, attempt = parts[0], parts[1], int(parts[2])
    return Clear(float(at) / 1000.0 + skew, float(price), float(bid), dep, None, oid, attempt, failed)


def running(oid: str, held: str) -> tuple[str, str, int | None]:
    """(order id, deployment, output cap or None) of a ``held`` entry."""
    f = held.split("|")
    cap = f[6] if len(f) > 6 else ""
    return oid, f[0], int(cap) if cap.isdigit() else None


def held_terms(held: str) -> tuple[str, float, float, int, float | None]:
    """(deployment, price, level, attempt, bid) of a ``held`` entry (see the scripts' key
    layout; the bid it cleared at is None where the entry does not say it)."""
    dep, _replica, price, level, attempt, *rest = held.split("|")
    bid = rest[0] if rest else ""
    return dep, float(price), float(level), int(attempt), float(bid) if bid else None


def waiting_terms(order: Order) -> str:
    """A waiting order as the heartbeat script reads it (to rest it again if forgotten)."""
    return f"w|{order.id}|{order.seq}|{float(order.bid)!r}|{order.avoid or ''}|{order.requeues}"


def slot_terms(adm: Admission) -> str:
    """A slot in use as the heartbeat script reads it (to count it again if forgotten)."""
    o = adm.order
    return (
        f"h|{o.id}|{adm.deployment}|{float(adm.price)!r}|{float(adm.level)!r}|{o.requeues}|{float(o.bid)!r}"
    )
