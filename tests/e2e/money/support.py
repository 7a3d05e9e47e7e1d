"""Helpers of the money tests: calls as a given API key, the books of an account,
waiting for settlement, and the expected charge of a request."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.bodies import USER
from tests.support.gateway import Gateway
from tests.support.sse import SSEResult, SSEStream, collect_sse, open_sse

SETTLE_TIMEOUT_S = 15.0


def units(price_usd_per_m: float) -> int:
    """USD per 1M tokens -> micro-USD per 1M tokens."""
    return round(price_usd_per_m * 1_000_000)


def expected_cost(tokens: int, price_usd_per_m: float) -> int:
    """``tokens`` at ``price`` in micro-USD, rounded up once (exact integer arithmetic)."""
    return -(-(tokens * units(price_usd_per_m)) // 1_000_000)


def quote_tokens(messages: Sequence[Mapping[str, object]], max_tokens: int) -> int:
    """SPEC 3: prompt UTF-8 bytes + 8 per message + 8 + max_tokens."""
    nbytes = sum(len(str(m.get("content") or "").encode()) for m in messages)
    return nbytes + 8 * len(messages) + 8 + max_tokens


def usage_of(doc: dict[str, Any]) -> tuple[int, int, float]:
    """(prompt tokens, completion tokens, cleared price) of a completion or usage chunk."""
    u = doc["usage"]
    return int(u["prompt_tokens"]), int(u["completion_tokens"]), float(u["x_market"]["cleared_price"])


@dataclass
class As:
    """Calls to a gateway as one API key."""

    gw: Gateway
    key: str
    account: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def post(
        self,
        body: dict[str, Any],
        *,
        headers: dict[str, str] | None = None,
        path: str = "/v1/chat/completions",
    ) -> httpx.Response:
        body = {"messages": USER, **body}
        return httpx.post(self.gw.url + path, json=body, headers={**self.auth, **(headers or {})}, timeout=60)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.gw.url + path, headers=self.auth, timeout=30, **kw)

    def stream(self, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> SSEResult:
        return collect_sse(self.gw.url, {"messages": USER, **body}, headers={**self.auth, **(headers or {})})

    @contextmanager
    def open_stream(
        self, body: dict[str, Any], *, headers: dict[str, str] | None = None
    ) -> Iterator[SSEStream]:
        with open_sse(self.gw.url, {"messages": USER, **body}, headers={**self.auth, **(headers or {})}) as s:
            yield s

    def account_view(self) -> dict[str, Any]:
        r = self.get("/v1/account")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def usage(self, request_id: str) -> dict[str, Any]:
        r = self.get(f"/v1/usage/{request_id}")
        assert r.status_code == 200, (request_id, r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    def balance(self) -> int:
        return self.gw.balance(self.account)

    def holds(self, state: str | None = None) -> list[dict[str, Any]]:
        params = {"account": self.account, "limit": "1000"}
        if state is not None:
            params["state"] = state
        r = self.gw.admin("GET", "/admin/holds", params=params)
        assert r.status_code == 200, r.text
        data: list[dict[str, Any]] = r.json()["data"]
        return data

    def wait_settled(self, timeout: float = SETTLE_TIMEOUT_S) -> list[dict[str, Any]]:
        """Poll until the account has no open hold (or ``timeout``); the holds still open."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.holds("open")
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.02)

    def assert_books(self) -> dict[str, Any]:
        """credited = balance + open holds + reconciling holds + spent, for this account."""
        a = self.gw.admin("GET", f"/admin/accounts/{self.account}").json()
        total = a["balance_micros"] + a["open_holds_micros"] + a["reconciling_micros"] + a["spent_micros"]
        assert a["credited_micros"] == total, a
        assert a["balance_micros"] >= 0, a
        out: dict[str, Any] = a
        return out


def new_caller(gw: Gateway, account: str, credit_usd: float, **limits: Any) -> As:
    """A new account with ``credit_usd`` and a key (with ``limits``) for it."""
    r = gw.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": credit_usd})
    assert r.status_code in (200, 201), r.text
    key = gw.new_key(account, **limits) if limits else gw.new_key(account)
    return As(gw, key, account)


def assert_ledger_balanced(gw: Gateway) -> dict[str, Any]:
    led = gw.ledger()
    assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"], led
    assert led["balanced"] is True, led
    return led


def read_until(stream: SSEStream, *, data_chunks: int = 0, comment_prefix: str | None = None) -> list[Any]:
    """Read frames until ``data_chunks`` content chunks arrived, or a comment starting
    with ``comment_prefix``; the frames read."""
    seen: list[Any] = []
    got = 0
    for f in stream.frames():
        seen.append(f)
        if comment_prefix is not None and f.comment is not None and f.comment.startswith(comment_prefix):
            return seen
        if f.data is not None and not f.is_done:
            j = json.loads(f.data)
            if "error" in j:
                raise AssertionError(f"error frame while waiting: {j}")
            if j.get("choices"):
                got += 1
                if data_chunks and got >= data_chunks:
                    return seen
    raise AssertionError(f"the stream ended before the awaited frame: {[(f.comment, f.data) for f in seen]}")


__all__ = [
    "As",
    "assert_ledger_balanced",
    "expected_cost",
    "new_caller",
    "quote_tokens",
    "read_until",
    "units",
    "usage_of",
]


def run_statements(gw: Gateway, db: str | None, statements: Sequence[tuple[str, object]]) -> None:
    """Run each ``(sql, arg)`` (``?`` for its one parameter) on the gateway's ledger, the
    embedded SQLite (``db`` None) or PostgreSQL: how a test moves a stored period back."""
    if db is None:
        with sqlite3.connect(Path(gw.data_dir) / "bourse.db", timeout=30) as conn:
            for sql, arg in statements:
                conn.execute(sql, (arg,))
        return
    import psycopg

    with psycopg.connect(db, connect_timeout=10) as pg:
        for sql, arg in statements:
            pg.execute(sql.replace("?", "%s"), (arg,))
