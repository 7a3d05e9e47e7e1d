"""A usage record's JSON as stored: compact, and read back to the very document written.

A receipt is written once a request, so its bytes are a share of every request's
writes (SQLite's pages, PostgreSQL's WAL; issue 40). Two things in it are said twice:

- its head, ``id``, ``object``, ``created`` and ``model``, which the row's columns
  already hold (``request_id``, ``created_at`` and ``product``; ``object`` is
  ``bourse.usage`` on every receipt of a run);
- its keys' names (``prompt_tokens``, ``x_market``, ``position_at_entry``…), the same
  on every record.

:func:`encode` drops the head when it is exactly what the columns give, and writes each
known key (at any depth) as a one-character code from :data:`NAMES` (a nested object
of known keys only as a list: the string of its keys' codes, then their values); its
first key, :data:`MARK`, says so; the outcomes and routes (:data:`VALUES`) are coded too. :func:`decode` rebuilds the document, the same keys in the same
order with the same values, so what the usage endpoints, the CSV export and the
receipts return does not change. A record without the mark (written before version 18)
is read as it is. A key that could be read as a code (one of them, the mark, or one
starting with ``~``) is written with a ``~`` before it. ``key_id`` is never coded: the
reports filter on it in SQL (``json_extract`` / ``->>``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import orjson

MARK = ""
"""The first key of a compact record; its value is 1 when the head was dropped, else 0."""
NAMES = (
    "endpoint", "outcome", "usage", "receipt", "correlation_id",
    "prompt_tokens", "completion_tokens", "total_tokens", "usage_estimated",
    "prompt_tokens_details", "completion_tokens_details", "reasoning_tokens", "cached_tokens",
    "x_market", "bid", "start_bid", "deadline_s", "cleared_price", "level", "position_at_entry",
    "queued_ms", "requeues", "deployment", "cost", "cost_micros",
    "latency_ms", "ttft_ms", "quote_micros", "quote", "unpaid_micros",
    "reconciliation", "action", "charged_micros", "at", "note", "reversed_micros",
    "adjustment", "kind", "reason", "actor",
)  # fmt: skip
"""The coded key names: the code of ``NAMES[i]`` is ``_CODES[i]``. Append only: stored
records name their keys by these codes."""
VALUES = (
    "completed", "disconnected", "canceled", "error", "timeout", "reconciling",
    "/v1/chat/completions", "/v1/completions", "/v1/responses",
)  # fmt: skip
"""Strings that most records hold (outcomes, routes), each stored as ``[1, i]`` where
``VALUES[i]`` is it. Append only."""
_CODES = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_TO_CODE = dict(zip(NAMES, _CODES, strict=False))
_FROM_CODE = {c: n for n, c in _TO_CODE.items()}
assert len(NAMES) <= len(_CODES)
_VALUE_INDEX = {v: i for i, v in enumerate(VALUES)}
_HEAD = ("id", "object", "created", "model")
OBJECT = "bourse.usage"


def _escaped(key: str) -> bool:
    return key == MARK or key in _FROM_CODE or key.startswith("~")


def _key(key: str) -> str:
    return _TO_CODE.get(key) or ("~" + key if _escaped(key) else key)


@functools.lru_cache(maxsize=256)
def _shape(keys: tuple[str, ...]) -> str | None:
    """The codes of ``keys`` (an object's, in order) when each is known, else None."""
    if keys and all(k in _TO_CODE for k in keys):
        return "".join(_TO_CODE[k] for k in keys)
    return None


def _code(value: Any) -> Any:
    """``value`` with its dicts coded: one of known keys only as a list, the string of its
    keys' codes then their values (``{"prompt_tokens": 11, "total_tokens": 19}`` is
    ``["57", 11, 19]``); any other with each key coded or escaped; a string of
    :data:`VALUES` as ``[1, i]``. A list is written with a 0 before its items, so that a
    list read back is never taken for a dict or a coded string. (On the commit thread,
    once a request for each record: the known-keys case loops in line.)"""
    kind = type(value)
    if kind is dict:
        codes = _shape(tuple(value))
        if codes is None:
            return {_key(k): _code(v) for k, v in value.items()}
        out: list[Any] = [codes]
        for v in value.values():
            kind = type(v)
            if kind is str:
                i = _VALUE_INDEX.get(v)
                out.append(v if i is None else [1, i])
            elif kind is dict or kind is list:
                out.append(_code(v))
            else:
                out.append(v)  # a subclass too, as it is (its exact type is not one to code)
        return out
    if kind is str:
        i = _VALUE_INDEX.get(value)
        return value if i is None else [1, i]
    if kind is list:
        return [0, *map(_code, value)]
    if isinstance(value, dict | list):  # a subclass: as its base
        return _code(dict(value) if isinstance(value, dict) else list(value))
    return value


def _name(key: str) -> str:
    return _FROM_CODE.get(key) or (key[1:] if key.startswith("~") else key)


def _uncode(value: Any) -> Any:
    if isinstance(value, dict):
        return {_name(k): _uncode(v) for k, v in value.items()}
    if isinstance(value, list):
        first = value[0]
        if isinstance(first, str):
            return {_FROM_CODE[c]: _uncode(v) for c, v in zip(first, value[1:], strict=True)}
        if first == 1:
            return VALUES[value[1]]
        return [_uncode(v) for v in value[1:]]
    return value


def _head_is_columns(head: list[tuple[str, Any]], request_id: str, product: str, created_at: float) -> bool:
    """Whether ``head`` (a document's first four items) is exactly the head the columns rebuild."""
    want = [("id", request_id), ("object", OBJECT), ("created", int(created_at)), ("model", product)]
    return head == want and type(head[2][1]) is int


def encode(doc: Mapping[str, Any], request_id: str, product: str, created_at: float) -> str:
    """The stored JSON text of a record with these columns (always an object: the
    reports read its ``key_id``)."""
    items = list(doc.items())
    dropped = _head_is_columns(items[: len(_HEAD)], request_id, product, created_at)
    out: dict[str, Any] = {MARK: int(dropped)}
    for k, v in items[len(_HEAD) :] if dropped else items:
        out[_key(k)] = v if k == "key_id" and type(v) is str else _code(v)  # as the reports read it
    return orjson.dumps(out).decode()


def decode(text: str | bytes, request_id: str, product: str, created_at: float) -> dict[str, Any]:
    """The record written as ``text`` by :func:`encode` (or before it, as it is)."""
    doc = orjson.loads(text)
    if not isinstance(doc, dict) or next(iter(doc), None) != MARK:
        return doc  # type: ignore[no-any-return]
    dropped = doc.pop(MARK)
    body = {_name(k): _uncode(v) for k, v in doc.items()}
    if not dropped:
        return body
    return {"id": request_id, "object": OBJECT, "created": int(created_at), "model": product, **body}
