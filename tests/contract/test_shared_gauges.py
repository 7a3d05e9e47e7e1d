"""With replicas, the book's gauges are the shared book's: read from Redis at scrape
time, so one replica shows the orders and slots of another; every replica exports
them, labelled ``scope="cluster"``, so the queries docs/operating.md gives (``max``
over those, ``sum`` over the rest) count each once. (Two containers in one process,
sharing Redis and PostgreSQL.)"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from bourse.container import Container, build
from bourse.services.auth import Principal
from bourse.services.completion import Run
from bourse.services.ids import new_request_id
from bourse.settings import Environment, parse_config
from bourse.wire.requests import validate
from tests.support.processes import CLUSTER_ENV
from tests.support.promql import evaluate

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


async def _open(c: Container, principal: Principal, tokens: int = 100) -> Run:
    body: dict[str, Any] = {
        "model": "shared",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 100,
        "stream": True,
        "sim": {"output_tokens": tokens, "tokens_per_s": 20 if tokens == 100 else 1000},
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


async def _samples(c: Container, instance: str) -> list[Sample]:
    """One scrape's samples, each with the ``instance`` label Prometheus gives its target."""
    scraped = await c.observer.scrape(None)
    assert scraped is not None
    return [
        s._replace(labels={**s.labels, "instance": instance})
        for fam in text_string_to_metric_families(scraped[0].decode())
        for s in fam.samples
    ]


def _by_the_rule(samples: list[Sample], name: str, **labels: str) -> float:
    """docs/operating.md's rule: a series labelled ``scope="cluster"`` is the same on
    every replica (its max counts it once); every other one is the replica's own (sum)."""
    values = [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert values, (name, labels)
    scoped = {s.labels.get("scope") == "cluster" for s in values}
    assert len(scoped) == 1, f"{name}: some series scoped, some not"
    return max(s.value for s in values) if scoped.pop() else sum(s.value for s in values)


DOCS = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
PRODUCT, DONE = ("product", "shared"), ("outcome", "completed")
QUERIES: dict[str, dict[tuple[tuple[str, str], ...], float]] = {
    "sum by (product, outcome) (rate(bourse_requests_total[5m]))": {(PRODUCT, DONE): 2},
    "max by (product) (rate(bourse_book_admissions_total[5m]))": {(PRODUCT,): 3},
    "max by (product) (bourse_book_waiting_orders)": {(PRODUCT,): 1},
    "sum by (product) (max by (product, deployment) (bourse_deployment_slots_busy)) / sum by (product) "
    "(max by (product, deployment) (bourse_deployment_slots))": {(PRODUCT,): 1.0},
}


async def test_the_documented_queries_count_each_cluster_value_once(
    tmp_path: Path, redis_service_url: str, postgres_dsn: str
) -> None:
    """A run finished on each replica, then one running on b and one waiting on a: the
    documented queries over both replicas' scrapes give 2 completed requests, 3
    admissions, 1 order waiting, the one slot busy, and the ledger's holds and jobs
    once each (on main every replica exported the shared values unlabelled, and the
    docs' ``sum()`` counted them twice)."""
    prefix = "t" + os.urandom(6).hex()
    documented = " ".join(DOCS.read_text().split())
    for query in QUERIES:
        assert query in documented, f"docs/operating.md does not give: {query}"
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(replica(tmp_path / "a", redis_service_url, postgres_dsn, prefix))
        b = await stack.enter_async_context(replica(tmp_path / "b", redis_service_url, postgres_dsn, prefix))
        await b.admin.create_account("acct", 1.0)
        created = await b.admin.create_key("acct", None, None, None, None)
        principal = await b.auth.user(f"Bearer {created['key']}")
        for c in (a, b):
            done = await _open(c, principal, tokens=3)
            async for _ in done.events():
                pass
        first = await _open(b, principal)  # takes the only slot
        events = first.events()
        await anext(events)
        await anext(events)
        second = await _open(a, principal)  # waits in the shared book
        try:
            samples = await _samples(a, "a") + await _samples(b, "b")
            holds = await a.store.hold_counts()
            jobs = await a.store.job_counts()
        finally:
            await second.abandon()
            await events.aclose()
            await asyncio.sleep(0)
    for query, expected in QUERIES.items():
        assert evaluate(query, samples) == expected, query
    for query, truth in (
        ("max by (state) (bourse_holds)", {s: n for s, (n, _) in holds.items()}),
        ("max by (state) (bourse_jobs)", jobs),
    ):
        assert query in documented, f"docs/operating.md does not give: {query}"
        got = {dict(k)["state"]: v for k, v in evaluate(query, samples).items()}
        assert got == {state: truth.get(state, 0) for state in got}, query
    rule = partial(_by_the_rule, samples)
    assert rule("bourse_requests_total", product="shared", outcome="completed") == 2
    assert rule("bourse_book_admissions_total", product="shared") == 3
    assert rule("bourse_book_waiting_orders", product="shared") == 1
    assert rule("bourse_deployment_slots_busy", product="shared") == 1
    assert rule("bourse_deployment_slots", product="shared") == 1
    assert holds["open"][0] == 2  # the premise: both orders hold money
    for state in ("open", "reconciling"):
        assert rule("bourse_holds", state=state) == holds.get(state, (0, 0))[0]
        assert rule("bourse_holds_micro_usd", state=state) == holds.get(state, (0, 0))[1]
    for state in ("queued", "running", "succeeded"):
        assert rule("bourse_jobs", state=state) == jobs.get(state, 0)
    await _cleanup(redis_service_url, prefix)


async def _cleanup(redis_url: str, prefix: str) -> None:
    admin = aioredis.from_url(redis_url)
    try:
        keys = [k async for k in admin.scan_iter(match=f"*{prefix}*", count=1000)]
        if keys:
            await admin.delete(*keys)
    finally:
        await admin.aclose()


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
