"""The refusals list replicas share (``coordination/refusals_redis.py``) on a real
Redis: two feeds, each with its own hub over one key prefix, list each other's
refusals newest first, each once; the list keeps the newest ``keep``; a line it
cannot read is skipped; Redis away, a feed lists its own and the request is not
held up."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from bourse.coordination.refusals_redis import RedisRefusals
from bourse.ports.observer import Caller
from bourse.services.request_feed import RequestFeed
from tests.contract.cluster import Replicas
from tests.support.processes import free_port

pytestmark = [pytest.mark.redis, pytest.mark.anyio]


class _Completions:
    def __init__(self) -> None:
        self.on_settled: list[Any] = []


def _refuse(feed: RequestFeed, rid: str, account: str | None, status: int = 429) -> None:
    caller = Caller(rid, "/v1/chat/completions", time.perf_counter(), key_id="key_1", account_id=account)
    feed.refused(caller, status, "rate_limited" if status == 429 else "invalid_api_key")


async def _settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0.01)


async def test_two_replicas_list_each_others_refusals(redis_service_url: str) -> None:
    reps = Replicas(redis_service_url)
    try:
        a_log = RedisRefusals(await reps.hub(), keep=3)
        b_log = RedisRefusals(await reps.hub(), keep=3)
        a = RequestFeed(cast(Any, _Completions()), cast(Any, None), keep_refused=3, shared=a_log)
        b = RequestFeed(cast(Any, _Completions()), cast(Any, None), keep_refused=3, shared=b_log)
        _refuse(a, "r1", "acme")
        await _settle()
        _refuse(b, "r2", None, 401)
        await _settle()
        _refuse(a, "r3", "acme")
        await _settle()
        on_b = await b.refusals(lambda r: True, 10)
        assert [r.request_id for r in on_b] == ["r3", "r2", "r1"]
        assert (on_b[0].account_id, on_b[0].outcome, on_b[0].record["status"]) == ("acme", "refused", 429)
        assert on_b[1].record["error"] == {"code": "invalid_api_key"} and on_b[1].account_id == ""
        assert [r.request_id for r in await a.refusals(lambda r: r.account_id == "acme", 10)] == ["r3", "r1"]
        # the newest ``keep`` only, each once though a feed holds its own too
        _refuse(b, "r4", "acme")
        await _settle()
        assert [r.request_id for r in await a.refusals(lambda r: True, 10)] == ["r4", "r3", "r2"]
        assert await reps.admin.llen(a_log.key) == 3
        # a line this version cannot read is skipped (two on top: the newest 3 read are
        # those and r4; b's own r2 is still listed, a's r3 is past the window)
        await reps.admin.lpush(a_log.key, "not json", '{"doc": {}}')
        assert [r.request_id for r in await b.refusals(lambda r: True, 10)] == ["r4", "r2"]
        # Redis away (b's replica pointed at a port nobody listens on): it lists its own,
        # refusing is not held up
        hub_b = reps.hubs[1]
        live, hub_b.redis = hub_b.redis, aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0")
        started = time.perf_counter()
        _refuse(b, "r5", "acme")
        assert time.perf_counter() - started < 0.05
        await _settle()
        assert [r.request_id for r in await b.refusals(lambda r: True, 10)] == ["r5", "r4", "r2"]
        await hub_b.redis.aclose()
        hub_b.redis = live
    finally:
        await reps.aclose()
