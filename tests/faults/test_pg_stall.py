"""A PostgreSQL server that stops answering mid-traffic (issue 35: every store failure
is a 503 within ``[storage] unavailable_timeout_s``).

A ``bourse serve`` process reaches its fresh database through a relay on loopback
(:class:`~tests.faults.stall_proxy.StallProxy`); requests of one account (streams,
plain ones, jobs) come continuously, and the relay stops forwarding in both directions
(a frozen server, a partition: connections stay open, nothing is answered, no error
comes) for longer than the timeout. Before the fix the pool bounded only the wait for
a connection: a statement on a live connection waited for the server without limit,
so every request hung for as long as the server stayed frozen.

Now each store call is given up at its deadline (its connection shut down and
discarded; the server also ends a statement past it): every request made while the
server is frozen gets 503 ``no_capacity`` with ``retry-after`` within the timeout (and
a margin), a stream under way ends with its usage or an in-band error frame, never a
500. Once the relay forwards again requests succeed, and on the live gateway no hold
stays open or goes to an operator (a placement whose outcome was unknown is released,
a close refused is written by the hold sweeper); the ledger check runs as the gateway
stops.
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
from tests.faults.stall_proxy import StallProxy
from tests.support.databases import fresh_postgres_database
from tests.support.processes import serve_process

pytestmark = pytest.mark.postgres

UNAVAILABLE_TIMEOUT_S = 5.0
"""The default of ``[storage] unavailable_timeout_s``."""
MARGIN_S = 1.5
"""What an answer may take past the timeout (the event loop, the client, a slow CI)."""
RUN_S = 1.0
"""A stream's run: 10 tokens at 10 a second."""
WORKERS = 8
"""Requests in flight at any time."""
BEFORE_S = 1.5
"""Traffic before the freeze."""
PROBES = 6
"""Requests sent at once while the relay is frozen (a stream, a plain one, a job, twice)."""
FROZEN_S = UNAVAILABLE_TIMEOUT_S + MARGIN_S + 4.0
"""How long the relay forwards nothing: the probes end well before."""
BACK_S = 15.0
SETTLE_S = 30.0
USER = [{"role": "user", "content": "Tell me about rivers."}]
CONFIG = (
    '[server]\nlog_level = "warning"\n'
    "[products.pd]\nsim_overrides = true\nmax_output_tokens = 64\n"
    '[[products.pd.deployments]]\nname = "pd-a"\nengine = "sim"\nslots = 48\nfloor = 1.0\n'
)


class Outcome:
    """One request: when it started and ended (monotonic), its status, error code,
    ``retry-after`` and, for a stream, its last data frame."""

    def __init__(self, kind: str, t0: float) -> None:
        self.kind, self.t0, self.t1 = kind, t0, 0.0
        self.status = 0
        self.code: str | None = None
        self.retry_after: str | None = None
        self.last = ""

    def __repr__(self) -> str:
        return f"{self.kind} {self.status} {self.code} {self.t1 - self.t0:.2f}s {self.last[:120]!r}"


async def _one(client: httpx.AsyncClient, key: str, n: int) -> Outcome:
    auth = {"authorization": f"Bearer {key}"}
    body = {"model": "pd", "messages": USER, "sim": {"output_tokens": 4}}
    kind = ("stream", "plain", "job")[n % 3]
    out = Outcome(kind, time.monotonic())
    content = b""
    if kind == "stream":
        streamed = {**body, "sim": {"output_tokens": 10, "tokens_per_s": 10}, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
        async with client.stream("POST", "/v1/chat/completions", json=streamed, headers=auth) as r:
            if r.status_code == 200:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        out.last = line
            else:
                content = await r.aread()
    elif kind == "plain":
        r = await client.post("/v1/chat/completions", json=body, headers=auth)
        content = r.content
    else:
        r = await client.post(
            "/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth
        )
        content = r.content
    out.t1 = time.monotonic()
    out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
    if r.status_code >= 400:
        try:
            out.code = orjson.loads(content)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            out.code = content[:200].decode(errors="replace")
    return out


async def _traffic(url: str, key: str, proxy: StallProxy) -> tuple[list[Outcome], list[Outcome], float]:
    """Requests from WORKERS clients at once, before, during and after a freeze, and
    PROBES more sent at once half a second into it; the outcomes of all, those of the
    probes, and when the freeze began."""
    outcomes: list[Outcome] = []
    stop = asyncio.Event()

    async def worker(client: httpx.AsyncClient, w: int) -> None:
        n = w
        while not stop.is_set():
            outcomes.append(await _one(client, key, n))
            n += WORKERS

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0)) as client:
        tasks = [asyncio.create_task(worker(client, w)) for w in range(WORKERS)]
        await asyncio.sleep(BEFORE_S)
        proxy.freeze()
        frozen = time.monotonic()
        await asyncio.sleep(0.5)
        probing = asyncio.gather(*(_one(client, key, n) for n in range(PROBES)))
        await asyncio.sleep(max(0.0, frozen + FROZEN_S - time.monotonic()))
        proxy.thaw()
        stop.set()
        probes = await asyncio.wait_for(probing, 120)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return outcomes + probes, probes, frozen


async def _all_served(url: str, key: str) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30.0)) as client:
        got = await asyncio.gather(*(_one(client, key, n) for n in range(6)))
    return all(o.status in (200, 202) and "error" not in o.last for o in got)


def test_a_database_that_stops_answering_gets_503_within_the_timeout_never_a_hang(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with fresh_postgres_database() as dsn:
        parts = urlsplit(dsn)
        with (
            StallProxy((parts.hostname or "127.0.0.1", parts.port or 5432)) as proxy,
            serve_process(tmp_path, "stall", CONFIG, data_dir, ADMIN_KEY, proxy.dsn(dsn)) as (url, _proc),
        ):
            gw = Served(url, data_dir, proxy.dsn(dsn))
            (key,) = gw.accounts("stall", 1, 50.0)
            assert asyncio.run(_all_served(url, key))
            outcomes, during, frozen = asyncio.run(_traffic(url, key, proxy))

            bound = UNAVAILABLE_TIMEOUT_S + MARGIN_S
            errors = [
                o for o in outcomes if (o.status >= 500 and o.status != 503) or "internal_error" in o.last
            ]
            assert not errors, errors
            refused = [o for o in outcomes if o.status == 503]
            assert all(o.code == "no_capacity" and o.retry_after for o in refused), refused
            # in-band errors of streams under way are the store's: no_capacity
            in_band = [o for o in outcomes if '"error"' in o.last]
            assert all("no_capacity" in o.last for o in in_band), in_band
            # every request ends within the timeout (a stream: its run too) of when it
            # began or the freeze did, whichever came later
            slow = [
                o for o in outcomes if o.t1 - max(o.t0, frozen) > bound + (RUN_S if o.kind == "stream" else 0)
            ]
            assert not slow, slow
            # the requests made while frozen are 503s (before the thaw: see FROZEN_S)
            assert all(o.status == 503 for o in during), during
            assert any(o.t0 < frozen < o.t1 for o in outcomes), outcomes  # the freeze met traffic

            deadline = time.monotonic() + BACK_S
            while not asyncio.run(_all_served(url, key)):
                assert time.monotonic() < deadline, f"requests still refused {BACK_S} s after the thaw"
                time.sleep(0.5)
            books = gw.at_rest(SETTLE_S)  # no hold open, every job ended: on the live gateway
            books.assert_balanced()
            assert not books.ids("reconciling"), books.ids("reconciling")
            print(
                f"{len(outcomes)} requests, {len(refused)} answered 503, {len(during)} while frozen; slowest "
                f"{max(o.t1 - max(o.t0, frozen) for o in outcomes):.2f} s past the freeze or its start"
            )
