"""PostgreSQL refusing every connection of the gateway's database (issue 35, item 2).

A ``bourse serve`` process on a fresh PostgreSQL database serves one account; slow
streams and a job of it are started, then its database is made to refuse connections
(``ALTER DATABASE … ALLOW_CONNECTIONS false``, and every backend of it terminated) and
ten requests of that account come at once. Before the fix 9 of 10 got 500 ``internal_error`` after 20 s and one a 503: the
concurrent holds of one account go as one batch (``PostgresStore._write_many``), and
that path let the pool's ``PoolTimeout`` through unmapped, after the pool's 10 s wait
and a retry.

Now every store call maps unavailability alike, within ``[storage]
unavailable_timeout_s`` (default 5 s): each of the ten gets 503 ``no_capacity`` with
``retry-after`` within that time (and a small margin), none a 500; the streams under
way end for their clients within one such timeout of their last token (their
settlements, refused, are kept). Once the database accepts connections again requests
succeed, and on the live gateway every hold is closed as its run decided (none left
open or to an operator, the balance back), the job has its result, the books balance.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.faults.served import ADMIN_KEY, Served
from tests.support.databases import fresh_postgres_database, postgres_url
from tests.support.processes import serve_process

pytestmark = pytest.mark.postgres

CONCURRENT = 10
UNAVAILABLE_TIMEOUT_S = 5.0
"""The default of ``[storage] unavailable_timeout_s``."""
MARGIN_S = 1.5
"""What an answer may take past the timeout (the event loop, the client, a slow CI)."""
LONG_STREAMS = 3
LONG_SIM = {"output_tokens": 30, "tokens_per_s": 10}
LONG_S = 3.0
"""The runs under way when the database starts refusing: three seconds each."""
BACK_S = 10.0
"""Within this after the database accepts connections again, requests succeed."""
SETTLE_S = 20.0
USER = [{"role": "user", "content": "Tell me about rivers."}]
CONFIG = (
    '[server]\nlog_level = "warning"\n'
    "[products.pd]\nsim_overrides = true\nmax_output_tokens = 64\n"
    '[[products.pd.deployments]]\nname = "pd-a"\nengine = "sim"\nslots = 48\nfloor = 1.0\n'
)


def _admin_sql(*statements: str) -> None:
    """Statements on the server's admin database (never the test's own: it refuses)."""
    import psycopg

    with psycopg.connect(postgres_url(), autocommit=True, connect_timeout=10) as conn:
        for sql in statements:
            conn.execute(sql)


def _refuse(dsn: str, refuse: bool) -> None:
    name = urlsplit(dsn).path.lstrip("/")
    assert name.startswith("bourse_t_"), name  # a test database only
    if refuse:
        _admin_sql(
            f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false',
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'",
        )
    else:
        _admin_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


async def _request(client: httpx.AsyncClient, key: str, n: int) -> tuple[int, str | None, str | None, float]:
    """One request (a stream, a plain one or a job, by ``n``): status, error code,
    ``retry-after``, seconds."""
    auth = {"authorization": f"Bearer {key}"}
    body = {"model": "pd", "messages": USER, "sim": {"output_tokens": 4}}
    t0 = time.monotonic()
    if n % 3 == 0:
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=streamed, headers=auth) as r:
            content = await r.aread()
    elif n % 3 == 1:
        r = await client.post("/v1/chat/completions", json=body, headers=auth)
        content = r.content
    else:
        r = await client.post(
            "/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth
        )
        content = r.content
    took = time.monotonic() - t0
    code = None
    if r.status_code >= 400:
        try:
            code = orjson.loads(content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = content[:200].decode(errors="replace")
    return r.status_code, code, r.headers.get("retry-after"), took


async def _long_runs(url: str, key: str, started: asyncio.Event) -> list[tuple[str, float]]:
    """Streams and a job whose holds are placed before the outage and whose runs end
    during it (``started`` once every stream has its first token): each stream's end
    (its last data frame) and how long it took, and the job's id."""
    auth = {"authorization": f"Bearer {key}"}
    body = {"model": "pd", "messages": USER, "sim": LONG_SIM}
    first = asyncio.Semaphore(0)

    async def stream(client: httpx.AsyncClient) -> tuple[str, float]:
        t0 = time.monotonic()
        last = ""
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=streamed, headers=auth) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if not last:
                        first.release()
                    last = line
        return last, time.monotonic() - t0

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0)) as client:
        r = await client.post(
            "/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth
        )
        assert r.status_code == 202, r.text
        tasks = [asyncio.create_task(stream(client)) for _ in range(LONG_STREAMS)]
        for _ in range(LONG_STREAMS):
            await first.acquire()
        started.set()
        return [*await asyncio.gather(*tasks), (orjson.loads(r.content)["id"], 0.0)]


async def _outage(
    url: str, key: str, dsn: str
) -> tuple[list[tuple[int, str | None, str | None, float]], list[tuple[str, float]]]:
    """Long runs started, the database made to refuse, ten requests at once; the
    database accepts connections again once the long runs have ended."""
    started = asyncio.Event()
    long_runs = asyncio.create_task(_long_runs(url, key, started))
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.to_thread(_refuse, dsn, True)
    try:
        results = await _concurrent(url, key)
        ended = await asyncio.wait_for(long_runs, 60)
    finally:
        await asyncio.to_thread(_refuse, dsn, False)
    return results, ended


async def _concurrent(url: str, key: str) -> list[tuple[int, str | None, str | None, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0)) as client:
        return await asyncio.gather(*(_request(client, key, n) for n in range(CONCURRENT)))


def _served_again(url: str, key: str) -> float:
    """Seconds until a request succeeds again (AssertionError after BACK_S)."""
    t0 = time.monotonic()
    last: object = None
    while time.monotonic() - t0 < BACK_S:
        results = asyncio.run(_concurrent(url, key))
        if all(status in (200, 202) for status, *_ in results):
            return time.monotonic() - t0
        last = results
        time.sleep(0.5)
    raise AssertionError(f"requests still refused {BACK_S} s after the database came back: {last}")


def test_a_database_refusing_connections_answers_503_within_the_timeout_never_500(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with (
        fresh_postgres_database() as dsn,
        serve_process(tmp_path, "refuse", CONFIG, data_dir, ADMIN_KEY, dsn) as (url, _proc),
    ):
        gw = Served(url, data_dir, dsn)
        (key,) = gw.accounts("refuse", 1, 20.0)
        warm = asyncio.run(_concurrent(url, key))
        assert all(status in (200, 202) for status, *_ in warm), warm
        results, ended = asyncio.run(_outage(url, key, dsn))
        bad = [r for r in results if r[0] != 503 or r[1] != "no_capacity" or r[2] is None]
        assert not bad, results
        slowest = max(took for *_, took in results)
        assert slowest <= UNAVAILABLE_TIMEOUT_S + MARGIN_S, results
        # the runs under way end for their clients (their usage as settled, the settlement
        # itself refused and kept), each within one timeout of the database's
        streams = ended[:LONG_STREAMS]
        assert all('"usage"' in last and "internal_error" not in last for last, _ in streams), streams
        assert max(took for _, took in streams) <= LONG_S + UNAVAILABLE_TIMEOUT_S + MARGIN_S, streams
        back_s = _served_again(url, key)
        books = gw.at_rest(SETTLE_S)  # no hold open, the job ended: on the live gateway
        books.assert_balanced()
        assert not books.ids("reconciling"), books.ids("reconciling")  # each closed as its run decided
        a = gw.admin("GET", "/admin/accounts/refuse-0").json()
        assert a["balance_micros"] == a["credited_micros"] - a["spent_micros"], a
        job = httpx.get(
            f"{url}/v1/jobs/{ended[-1][0]}", headers={"authorization": f"Bearer {key}"}, timeout=10
        )
        assert job.json()["status"] == "succeeded", job.text
        print(f"outage: {[r[:2] for r in results]}; slowest {slowest:.2f} s; served again in {back_s:.1f} s")
