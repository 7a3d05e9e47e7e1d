"""The dashboard's live feeds over HTTP: the market stream (history, then snapshots)
and the requests stream (only what the session may see)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from bourse.wire.sse import SSEParser
from tests.e2e.dashboard.conftest import World
from tests.support.gateway import ADMIN_KEY


def named_events(resp: httpx.Response) -> Iterator[tuple[str, Any]]:
    """(event name, decoded data) of each named event of an SSE response."""
    parser = SSEParser()
    for piece in resp.iter_raw():
        for ev in parser.feed(piece):
            if ev.event is not None and ev.data is not None:
                yield ev.event, json.loads(ev.data)


def test_market_stream_sends_history_then_snapshots(world: World) -> None:
    with world.browser(ADMIN_KEY) as c, c.stream("GET", "/dashboard/api/markets/dash-fast/events") as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["cache-control"] == "no-store"
        assert "content-security-policy" in resp.headers
        seen = named_events(resp)
        name, history = next(seen)
        assert name == "history" and history["product"] == "dash-fast" and history["interval_s"] > 0
        assert isinstance(history["points"], list) and isinstance(history["clears"], list)
        last_t = 0.0
        for _ in range(2):
            name, snap = next(seen)
            assert name == "snapshot" and snap["product"] == "dash-fast"
            assert {"book", "level", "waiting", "deployments", "point", "clears"} <= set(snap)
            assert snap["deployments"][0]["breaker"] == "closed"
            assert set(snap["point"]["busy"]) == {"dash-fast/0"}
            assert snap["point"]["t"] > last_t
            last_t = snap["point"]["t"]


def test_requests_stream_shows_only_the_sessions_account(world: World) -> None:
    with world.browser(world.keys["alice"]) as c, c.stream("GET", "/dashboard/api/requests/events") as resp:
        seen = named_events(resp)
        assert next(seen)[0] == "ready"
        world.complete("bob", "dash-fast")
        mine = world.complete("alice", "dash-other")[0]
        name, row = next(seen)
        assert name == "request" and row["id"] == mine and row["account"] == "alice"
        assert row["product"] == "dash-other" and row["outcome"] == "completed" and row["status"] == 200
        assert row["cost_micros"] > 0 and row["latency_ms"] is not None


def test_requests_stream_filters(world: World) -> None:
    params = {"product": "dash-other", "outcome": "completed"}
    with (
        world.browser(ADMIN_KEY) as c,
        c.stream("GET", "/dashboard/api/requests/events", params=params) as resp,
    ):
        seen = named_events(resp)
        assert next(seen)[0] == "ready"
        world.complete("bob", "dash-fast")
        wanted = world.complete("bob", "dash-other")[0]
        name, row = next(seen)
        assert (name, row["id"], row["account"]) == ("request", wanted, "bob")
