"""A full disk under the SQLite ledger (issue 35, item 1).

A ``bourse serve`` process keeps its data folder (the SQLite file, its WAL) on a
24 MiB tmpfs of the test's own. Slow streams and jobs are started (their holds
placed), then a filler file takes every byte left and requests of every kind come
(streamed and not, jobs). Before the fix 8,547 of 8,787 such requests answered 500:
SQLite rolled the failed transaction back itself and the store's own ROLLBACK then
failed with "cannot rollback - no transaction is active", an error nothing mapped.
The settlements of the runs under way failed too, and their holds stayed open on the
live gateway, balances reduced with nothing running, until its next start.

Now, while the disk is full, a client gets 503 ``no_capacity`` with ``retry-after``
(or, a stream that already has its 200, an in-band error frame), never a 500, and gets
it within ``[storage] unavailable_timeout_s`` (plus a small margin). Once the
filler is removed, the live gateway closes every hold its runs left open within a
bounded time (each as its run ended: settled or released, so the balances come back,
none left to an operator), the unfinished jobs end, the books balance; and a SIGTERM
drain that comes before the periodic sweep closes them itself before the process exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from bourse.settings import StorageConfig
from tests.faults.ledger import Books
from tests.faults.served import ADMIN_KEY, Served
from tests.faults.small_disk import fill, free_bytes, small_disk
from tests.support.processes import serve_process

DISK_MB = 24
ACCOUNTS = 3
LONG_STREAMS = 6
LONG_JOBS = 3
LONG_SIM = {"output_tokens": 30, "tokens_per_s": 10}
"""The runs under way when the disk fills: three seconds each."""
FULL_REQUESTS = 150
FULL_CONCURRENCY = 15
FULL_S = 6.0
"""The disk stays full at least this long: the long runs end (3 s) while it is, and at
least one periodic sweep finds the database still refusing."""
RECOVER_S = 20.0
"""Within this after the filler is removed, no hold is open and every job has ended."""
EXIT_S = 30.0
USER = [{"role": "user", "content": "Tell me about rivers."}]
UNAVAILABLE_TIMEOUT_S: float = StorageConfig.model_fields["unavailable_timeout_s"].default
"""``[storage] unavailable_timeout_s``, the default (the config here leaves it)."""
MARGIN_S = 1.5
"""What a refusal may take past the timeout (the event loop, the client, a slow CI)."""


def _config(extra: str = "") -> str:
    return (
        '[server]\nlog_level = "warning"\n'
        f"{extra}\n"
        "[products.pd]\nsim_overrides = true\nmax_output_tokens = 64\n"
        '[[products.pd.deployments]]\nname = "pd-a"\nengine = "sim"\nslots = 48\nfloor = 1.0\n'
        "breaker_threshold = 1000\ncooldown_s = 0\n"
    )


@dataclass
class Clients:
    """What the clients saw: outcome counts, and anything a client must never see."""

    seen: Counter[str] = field(default_factory=Counter)
    forbidden: list[str] = field(default_factory=list)
    jobs: list[tuple[str, str]] = field(default_factory=list)
    """(job id, the key that submitted it)"""
    refusals_s: list[float] = field(default_factory=list)
    """How long each refusal took to arrive, from the request: its 503 or its error frame."""

    def refused(self, what: str, r: httpx.Response, body: bytes, t0: float) -> str:
        """A non-2xx answer: only 503 ``no_capacity`` with ``retry-after`` is allowed."""
        self.refusals_s.append(time.monotonic() - t0)
        code = None
        try:
            code = orjson.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
        if r.status_code != 503 or code != "no_capacity" or "retry-after" not in r.headers:
            self.forbidden.append(f"{what}: {r.status_code} {dict(r.headers)} {body[:300]!r}")
        return f"{what}:{r.status_code}:{code}"

    async def stream(self, client: httpx.AsyncClient, key: str, sim: dict[str, Any]) -> str:
        body = {"model": "pd", "messages": USER, "stream": True, "sim": sim}
        t0 = time.monotonic()
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as r:
            if r.status_code != 200:
                return self.refused("stream", r, await r.aread(), t0)
            outcome = "stream:done"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if "Traceback" in line or '"internal_error"' in line:
                    self.forbidden.append(f"stream frame: {line[:300]}")
                if '"error"' in line and outcome == "stream:done":
                    outcome = "stream:error_frame"
                    self.refusals_s.append(time.monotonic() - t0)
            return outcome

    async def unary(self, client: httpx.AsyncClient, key: str, sim: dict[str, Any]) -> str:
        body = {"model": "pd", "messages": USER, "sim": sim}
        t0 = time.monotonic()
        r = await client.post("/v1/chat/completions", json=body, headers=_auth(key))
        if r.status_code != 200:
            return self.refused("unary", r, r.content, t0)
        return "unary:200"

    async def job(self, client: httpx.AsyncClient, key: str, sim: dict[str, Any]) -> str:
        body = {"endpoint": "/v1/chat/completions", "body": {"model": "pd", "messages": USER, "sim": sim}}
        t0 = time.monotonic()
        r = await client.post("/v1/jobs", json=body, headers=_auth(key))
        if r.status_code != 202:
            return self.refused("job", r, r.content, t0)
        self.jobs.append((orjson.loads(r.content)["id"], key))
        return "job:202"


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _long_runs(url: str, keys: list[str], seen: Clients, started: asyncio.Event) -> None:
    """Slow streams and jobs, their holds placed before the disk fills (``started``
    once every stream has its first token); returns when the streams have ended."""
    first = asyncio.Semaphore(0)

    async def one_stream(client: httpx.AsyncClient, key: str) -> None:
        body = {"model": "pd", "messages": USER, "stream": True, "sim": LONG_SIM}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth(key)) as r:
            assert r.status_code == 200, await r.aread()
            told = False
            async for line in r.aiter_lines():
                if line.startswith("data: ") and not told:
                    told = True
                    first.release()
                if "Traceback" in line or '"internal_error"' in line:
                    seen.forbidden.append(f"long stream frame: {line[:300]}")
        seen.seen["long:stream"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0, connect=10.0)) as client:
        for i in range(LONG_JOBS):
            assert await seen.job(client, keys[i % len(keys)], LONG_SIM) == "job:202", seen.forbidden
        tasks = [asyncio.create_task(one_stream(client, keys[i % len(keys)])) for i in range(LONG_STREAMS)]
        for _ in range(LONG_STREAMS):
            await first.acquire()
        started.set()
        await asyncio.gather(*tasks)


async def _while_full(url: str, keys: list[str], seen: Clients) -> None:
    """Requests of every kind, quick ones, while the disk is full."""
    left = FULL_REQUESTS
    limits = httpx.Limits(max_connections=FULL_CONCURRENCY + 4)

    async def worker(client: httpx.AsyncClient, n: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            key, kind = keys[left % len(keys)], (left + n) % 3
            sim = {"output_tokens": 4}
            try:
                if kind == 0:
                    outcome = await seen.stream(client, key, sim)
                elif kind == 1:
                    outcome = await seen.unary(client, key, sim)
                else:
                    outcome = await seen.job(client, key, sim)
            except httpx.TransportError as exc:
                outcome = f"transport:{type(exc).__name__}"
                seen.forbidden.append(outcome)
            seen.seen[outcome] += 1

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(60.0)) as client:
        await asyncio.gather(*(worker(client, n) for n in range(FULL_CONCURRENCY)))


async def _fill_under_runs(gw: Served, keys: list[str], disk: Path) -> tuple[Clients, Books]:
    """Long runs started, the disk filled, requests while it is full, the long runs
    ended; what the clients saw and the books then (the disk still full)."""
    seen = Clients()
    started = asyncio.Event()
    long_runs = asyncio.create_task(_long_runs(gw.url, keys, seen, started))
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.to_thread(fill, disk / "filler")
    full_at = time.monotonic()
    assert free_bytes(disk) < 4096, free_bytes(disk)
    await _while_full(gw.url, keys, seen)
    await asyncio.wait_for(long_runs, 60)
    await asyncio.sleep(max(0.0, full_at + FULL_S - time.monotonic()))
    return seen, await asyncio.to_thread(gw.books)


def _check_full(seen: Clients, books: Books) -> None:
    assert seen.forbidden == [], (seen.forbidden[:5], seen.seen)
    assert sum(n for k, n in seen.seen.items() if ":503:" in k) > 0, seen.seen  # the disk was full
    # every refusal within the timeout: no client waits on a store that cannot write
    slowest = max(seen.refusals_s)
    assert slowest <= UNAVAILABLE_TIMEOUT_S + MARGIN_S, (slowest, sorted(seen.refusals_s)[-5:])
    assert seen.seen["long:stream"] == LONG_STREAMS, seen.seen
    # the premise: the runs under way ended, their settlements and their jobs' states
    # could not be written
    assert books.ids("open"), "no hold was left open by the full disk"
    long_jobs = {job_id for job_id, _ in seen.jobs[:LONG_JOBS]}
    assert long_jobs <= {job_id for job_id, _, _ in books.unfinished}, (long_jobs, books.unfinished)
    books.assert_balanced(at_rest=False)


def _check_restored(gw: Served, books: Books, prefix: str) -> None:
    """The books balance and every hold was closed as its run ended (settled or
    released): none was left to an operator, so every balance is back."""
    books.assert_balanced()
    assert not books.ids("open") and not books.ids("reconciling"), {
        s: len(i) for s, i in books.states.items()
    }
    for i in range(ACCOUNTS):
        a = gw.admin("GET", f"/admin/accounts/{prefix}-{i}").json()
        assert a["open_holds_micros"] == 0 and a["reconciling_micros"] == 0, a
        assert a["balance_micros"] == a["credited_micros"] - a["spent_micros"], a


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=EXIT_S) == 0


def test_a_full_disk_gives_no_500_and_the_live_gateway_closes_every_hold_once_space_is_back(
    tmp_path: Path,
) -> None:
    with small_disk(tmp_path / "disk", DISK_MB) as disk:
        data_dir = disk / "data"
        with serve_process(tmp_path, "full", _config(), data_dir, ADMIN_KEY) as (url, proc):
            gw = Served(url, data_dir, None)
            keys = gw.accounts("full", ACCOUNTS, 20.0)
            seen, books = asyncio.run(_fill_under_runs(gw, keys, disk))
            _check_full(seen, books)

            (disk / "filler").unlink()
            t0 = time.monotonic()
            rest = gw.at_rest(RECOVER_S)  # on the live gateway: no hold open, every job ended
            recovered_s = time.monotonic() - t0
            _check_restored(gw, rest, "full")
            for job_id, key in seen.jobs[:LONG_JOBS]:  # generated while the disk was full: their results kept
                r = httpx.get(f"{url}/v1/jobs/{job_id}", headers=_auth(key), timeout=10)
                assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            again = Clients()
            asyncio.run(_while_full(url, keys, again))  # the disk has room again: every request served
            assert again.forbidden == [] and set(again.seen) <= {"stream:done", "unary:200", "job:202"}, (
                again.seen
            )
            _terminate(proc)
        after = gw.books()
        assert not after.ids("open"), after.ids("open")
        after.assert_balanced(at_rest=False)
        print(f"recovered in {recovered_s:.1f} s; clients saw {dict(seen.seen)}; "
              f"slowest refusal {max(seen.refusals_s):.2f} s of {len(seen.refusals_s)}")  # fmt: skip


def test_a_drain_after_a_full_disk_closes_every_hold_before_the_gateway_exits(tmp_path: Path) -> None:
    # no periodic sweep before the signal: the drain alone closes what the full disk left
    config = _config("[storage]\nhold_sweep_interval_s = 3600\n")
    with small_disk(tmp_path / "disk", DISK_MB) as disk:
        data_dir = disk / "data"
        with serve_process(tmp_path, "drain", config, data_dir, ADMIN_KEY) as (url, proc):
            gw = Served(url, data_dir, None)
            keys = gw.accounts("drain", ACCOUNTS, 20.0)
            seen, books = asyncio.run(_fill_under_runs(gw, keys, disk))
            _check_full(seen, books)
            (disk / "filler").unlink()
            _terminate(proc)
            after = gw.books()
            assert not after.ids("open"), f"{len(after.ids('open'))} holds open after the drain"
            after.assert_balanced(at_rest=False)
            assert not after.ids("reconciling"), len(after.ids("reconciling"))


def _without_root(folder: Path) -> BaseException:
    """What mounting the small disk does for a test that is not root: its skip or failure."""
    try:
        with small_disk(folder, 1):
            pass
    except (pytest.fail.Exception, pytest.skip.Exception) as outcome:
        return outcome
    raise AssertionError("mounted a tmpfs without root")


def test_without_root_the_disk_tests_fail_in_ci_and_skip_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("BOURSE_REQUIRE_SERVICES", "1")
    outcome = _without_root(tmp_path)
    assert isinstance(outcome, pytest.fail.Exception), repr(outcome)
    assert "needs root" in str(outcome) and "BOURSE_REQUIRE_SERVICES=1" in str(outcome), outcome
    monkeypatch.delenv("BOURSE_REQUIRE_SERVICES")
    outcome = _without_root(tmp_path)
    assert isinstance(outcome, pytest.skip.Exception) and "needs root" in str(outcome), repr(outcome)
    assert not os.path.ismount(tmp_path)
