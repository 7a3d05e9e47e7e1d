"""A served gateway (in a thread, SQLite) for the dashboard's HTTP tests: two
accounts with usage, a reconciling hold each, and helpers to sign in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bourse.ports.stores import Hold
from bourse.storage.sqlite import SqliteStore
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[server]
log_level = "warning"

[products.dash-fast]
[[products.dash-fast.deployments]]
engine = "sim"
slots = 4
floor = 0.05
tokens_per_s = 0
ttft_ms = 0

[products.dash-other]
[[products.dash-other.deployments]]
engine = "sim"
slots = 2
floor = 0.1
tokens_per_s = 0
ttft_ms = 0
"""

USER = [{"role": "user", "content": "Tell me about rivers."}]


@dataclass
class World:
    gw: Gateway
    keys: dict[str, str]
    """account -> API key"""
    holds: dict[str, str]
    """account -> a reconciling hold id"""

    @property
    def url(self) -> str:
        return self.gw.url

    def complete(self, account: str, product: str, n: int = 1) -> list[str]:
        ids = []
        for _ in range(n):
            r = httpx.post(
                self.url + "/v1/chat/completions",
                json={"model": product, "messages": USER, "max_tokens": 5},
                headers={"authorization": f"Bearer {self.keys[account]}"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-request-id"])
        return ids

    @contextmanager
    def browser(self, key: str | None = None) -> Iterator[httpx.Client]:
        """A client with a cookie jar, signed in with ``key`` (if given), as the page is."""
        with httpx.Client(base_url=self.url, timeout=30, headers={"origin": self.url}) as c:
            if key is not None:
                r = c.post("/dashboard/api/session", json={"key": key})
                assert r.status_code == 200, r.text
                c.headers["x-csrf-token"] = r.json()["csrf"]
            yield c

    def usage_json(self, account: str, **params: str) -> httpx.Response:
        return httpx.get(
            self.url + "/v1/usage", params=params, headers={"authorization": f"Bearer {self.keys[account]}"}
        )


async def _reconciling(db: Path, account: str, request_id: str, amount: int) -> str:
    """A hold left by a crashed run, written straight to the gateway's database."""
    store = SqliteStore(db)
    await store.open()
    try:
        hold_id = f"hold_{account}_{request_id}"
        await store.place_hold(
            Hold(
                hold_id,
                account,
                request_id,
                amount,
                "open",
                owner="gw_dead",
                product="dash-fast",
                created_at=time.time(),
            )
        )
        await store.to_reconciling(hold_id, None, "open when its gateway stopped", time.time())
        return hold_id
    finally:
        await store.close()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with running_gateway(CONFIG) as gw:
        keys = {"alice": gw.new_account("alice", 10.0), "bob": gw.new_account("bob", 10.0)}
        w = World(gw, keys, {})
        w.complete("alice", "dash-fast", 3)
        w.complete("alice", "dash-other", 1)
        w.complete("bob", "dash-fast", 2)
        db = Path(gw.data_dir) / "bourse.db"
        for i, acc in enumerate(("alice", "bob")):
            w.holds[acc] = asyncio.run(_reconciling(db, acc, f"chatcmpl-crashed{i}", 50_000))
        yield w
