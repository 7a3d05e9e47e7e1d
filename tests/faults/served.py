"""A served ``bourse serve`` process for the load tests: its accounts and keys, its
views, and waiting for its books to come to rest."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.faults.ledger import Books, read_books
from tests.faults.load import PRODUCTS

ADMIN_KEY = "bk_admin_faults_load"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Served:
    """A gateway process: its URL, its data folder and database (None: SQLite)."""

    url: str
    data_dir: Path
    dsn: str | None

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=ADMIN, timeout=30, **kw)

    def accounts(self, prefix: str, n: int, credit_usd: float) -> list[str]:
        """``n`` new accounts with ``credit_usd`` each; one API key each."""
        keys = []
        for i in range(n):
            r = self.admin("POST", "/admin/accounts", json={"id": f"{prefix}-{i}", "credit_usd": credit_usd})
            assert r.status_code == 201, r.text
            r = self.admin("POST", "/admin/keys", json={"account": f"{prefix}-{i}"})
            assert r.status_code == 201, r.text
            keys.append(r.json()["key"])
        return keys

    def books(self) -> Books:
        return read_books(self.data_dir, self.dsn)

    def at_rest(self, within_s: float) -> Books:
        """The books once no hold is open and no job is unfinished (AssertionError after ``within_s``)."""
        deadline = time.monotonic() + within_s
        while True:
            books = self.books()
            if (not books.ids("open") and books.unfinished_jobs == 0) or time.monotonic() > deadline:
                still = sorted((h, books.requests[h]) for h in books.ids("open"))
                assert not still, f"{len(still)} holds still open after {within_s} s: {still[:5]}"
                assert not books.unfinished, f"jobs unfinished after {within_s} s: {books.unfinished[:5]}"
                return books
            time.sleep(0.1)

    def assert_served_books(self, books: Books, prefix: str, n: int) -> None:
        """The gateway's own views agree with the database: the ledger's totals, each
        account's books, and every product's slots free and book empty."""
        led = self.admin("GET", "/admin/ledger").json()
        assert led["balanced"] is True, led
        assert (led["credits_micros"], led["balances_micros"], led["holds_micros"], led["revenue_micros"]) == (
            books.credits, books.balances, books.holds, books.revenue,
        ), (led, books)  # fmt: skip
        for i in range(n):
            a = self.admin("GET", f"/admin/accounts/{prefix}-{i}").json()
            parts = a["balance_micros"] + a["open_holds_micros"] + a["reconciling_micros"] + a["spent_micros"]
            assert a["credited_micros"] == parts and a["open_holds_micros"] == 0, a
        for product in PRODUCTS:
            view = httpx.get(f"{self.url}/v1/market/{product}", timeout=10).json()
            assert view["slots"]["busy"] == 0 and view["waiting"] == 0, view
