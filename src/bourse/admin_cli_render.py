"""The human view of ``bourse admin``'s answers (:mod:`bourse.admin_cli`): a list as a
plain-text table (its columns per object), anything else as ``field: value`` lines,
micro-USD amounts in USD and Unix times as UTC dates; a secret made (a key, a webhook
secret) named as shown once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any


def _usd(micros: Any) -> str:
    return "-" if micros is None else f"${int(micros) / 1_000_000:,.6f}"


def _time(t: Any) -> str:
    return "-" if t is None else datetime.fromtimestamp(float(t), UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _text(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v) or "(none)"
    if isinstance(v, dict):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    return str(v)


_THIS = {"day": " today", "week": " this week", "month": " this month"}


def _cap(row: Mapping[str, Any]) -> str:
    cap = row.get("spend_cap_micros")
    if cap is None:
        return "-"
    return f"{_usd(row.get('spend_micros', 0))} of {_usd(cap)}" + _THIS.get(
        str(row.get("spend_cap_period")), ""
    )


Column = tuple[str, Callable[[Mapping[str, Any]], str]]


def _col(title: str, field: str, fmt: Callable[[Any], str] = _text) -> Column:
    return title, lambda row: fmt(row.get(field))


COLUMNS: dict[str, list[Column]] = {
    "accounts": [
        _col("ID", "id"),
        _col("BALANCE", "balance_micros", _usd),
        _col("OPEN HOLDS", "open_holds_micros", _usd),
        _col("RECONCILING", "reconciling_micros", _usd),
        _col("SPENT", "spent_micros", _usd),
        _col("CREDITED", "credited_micros", _usd),
        _col("CREATED", "created_at", _time),
        ("SPEND CAP", _cap),
    ],
    "keys": [
        _col("ID", "id"),
        _col("ACCOUNT", "account_id"),
        _col("NAME", "name"),
        _col("STATE", "state"),
        _col("PRODUCTS", "products", lambda v: "all" if v is None else _text(v)),
        _col("CREATED", "created_at", _time),
        _col("LAST USED", "last_used_at", _time),
        _col("EXPIRES", "expires_at", _time),
        ("SPEND CAP", _cap),
    ],
    "holds": [
        _col("ID", "id"),
        _col("ACCOUNT", "account_id"),
        _col("STATE", "state"),
        _col("AMOUNT", "amount_micros", _usd),
        _col("CHARGED", "charged_micros", _usd),
        _col("PRODUCT", "product"),
        _col("CREATED", "created_at", _time),
        _col("NOTE", "note"),
    ],
    "operators": [
        _col("ID", "id"),
        _col("NAME", "name"),
        _col("ROLE", "role"),
        _col("CREATED", "created_at", _time),
        _col("REVOKED", "revoked_at", _time),
    ],
    "audit": [
        _col("AT", "at", _time),
        _col("ID", "id"),
        _col("ACTOR", "actor"),
        _col("ACTION", "action"),
        _col("TARGET", "target"),
        _col("DETAIL", "detail"),
    ],
}


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """``rows`` as a plain-text table, one line each, under a header."""
    cells = [[title for title, _ in columns]] + [[fmt(row) for _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in cells
    )


_SECRET_NAMES = {"operator": "operator key", "bourse.admin_key": "admin key"}  # by "object"; else an API key


def render(obj: str, doc: Mapping[str, Any]) -> str:
    """A human view of an answer: a table for a list, ``field: value`` lines otherwise."""
    if doc.get("object") == "list" and isinstance(doc.get("data"), list):
        out = table(doc["data"], COLUMNS[obj])
        if not doc["data"]:
            out += "\n(none)"
        if doc.get("has_more"):
            out += f"\nmore: --after {doc['next_after']}"
        return out
    if doc.get("object") == "market":
        head = (
            f"market version {doc.get('version')} (by {doc.get('actor')} at {_time(doc.get('created_at'))})"
        )
        return "\n".join([head, json.dumps(doc.get("products"), indent=2)])
    if doc.get("object") == "market.change":
        done = "applied" if doc.get("applied") else "not applied (a dry run, or nothing to change)"
        changes = [f"  {line}" for line in doc.get("changes") or []] or ["  (no change)"]
        return "\n".join([f"market version {doc.get('version')}: {done}", *changes])
    lines: list[str] = []
    if "key" in doc and isinstance(doc["key"], str):
        what = _SECRET_NAMES.get(str(doc.get("object")), "API key")
        lines.append(f"{what} (shown once, keep it now): {doc['key']}")
    shown = {"key"}
    if doc.get("object") == "bourse.webhook_secret":
        lines.append(f"webhook secret (shown once, give it to the receiver): {doc['webhook_secret']}")
        shown.add("webhook_secret")
    lines += [_field(name, value) for name, value in doc.items() if name not in shown]
    return "\n".join(lines)


def _field(name: str, value: Any) -> str:
    """One ``name: value`` line: micro-USD amounts in USD, Unix times as UTC dates."""
    if name.endswith("_micros"):
        return f"{name.removesuffix('_micros')}: {_usd(value)}"
    if name.endswith(("_at", "_until")):
        return f"{name}: {_time(value)}"
    if name == "products" and value is None:
        return "products: all"
    return f"{name}: {_text(value)}"
