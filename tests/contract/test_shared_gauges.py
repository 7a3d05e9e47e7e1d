"""With replicas, the book's gauges are the shared book's: read from Redis at scrape
time, so one replica shows the orders and slots of another. (Two containers in one
process, sharing Redis and PostgreSQL.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from bourse.container import Container, build
from bourse.services.auth import Principal
from bourse.services.completion import Run
from bourse.services.ids import new_request_id
from bourse.settings import Environment, parse_config
from bourse.wire.requests import validate
from tests.support.processes import CLUSTER_ENV

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.postgres]


@asynccontextmanager
async def replica(folder: Path, redis_url: str, dsn: str, prefix: str) -> AsyncIterator[Container]:
    products = {
        "shared": {
            "sim_overrides": True,  # the test sends a per-request sim object to a priced product
            "deployments": [{"engine": "sim", "slots": 1, "floor": 1.0, "tokens_per_s": 20}],
        }
    }
    config = parse_config(
        {"cluster": {"redis_url": redis_url, "key_prefix": prefix}, "products": products},
        "test",
        env={},
    )
    env = Environment(
        admin_key="bk_admin_gauges", secret_key=CLUSTER_ENV["BOURSE_SECRET_KEY"]
    )  # one key: replicas
    container = build(config, data_dir=folder, env=env, database=dsn)
    container.announce = False
    await container.start()
    try:
        yield container
    finally:
        await container.stop()


async def _open(c: Container, principal: Principal) -> Run:
    body: dict[str, Any] = {
        "model": "shared",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "stream": True,
        "sim": {"output_tokens": 100},
    }
    return await c.completions.open(
        "chat", body, validate("chat", body), principal, request_id=new_request_id("chat")
    )


async def _gauges(c: Container) -> dict[str, float]:
    scraped = await c.observer.scrape(None)
    assert scraped is not None
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(scraped[0].decode()):
        for s in fam.samples:
            if s.labels.get("product") == "shared":
                out[s.name] = s.value
    return out


async def test_one_replica_scrapes_the_orders_and_slots_of_another(
    tmp_path: Path, redis_service_url: str, postgres_dsn: str
) -> None:
    prefix = "t" + os.urandom(6).hex()
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(replica(tmp_path / "a", redis_service_url, postgres_dsn, prefix))
        b = await stack.enter_async_context(replica(tmp_path / "b", redis_service_url, postgres_dsn, prefix))
        await b.admin.create_account("acct", 1.0)
        created = await b.admin.create_key("acct", None, None, None, None)
        principal = await b.auth.user(f"Bearer {created['key']}")
        first = await _open(b, principal)  # takes the only slot
        events = first.events()
        await anext(events)  # queued, then admitted
        await anext(events)
        second = await _open(b, principal)  # waits in the shared book
        try:
            seen = await _gauges(a)
            assert seen["bourse_deployment_slots_busy"] == 1
            assert seen["bourse_book_waiting_orders"] == 1
            assert seen["bourse_book_level_usd_per_million_tokens"] == 1.0
        finally:
            await second.abandon()
            await events.aclose()
            await asyncio.sleep(0)
    admin = aioredis.from_url(redis_service_url)
    try:
        keys = [k async for k in admin.scan_iter(match=f"*{prefix}*", count=1000)]
        if keys:
            await admin.delete(*keys)
    finally:
        await admin.aclose()
