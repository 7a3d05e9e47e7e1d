"""Replicas whose clocks disagree: leases, take-overs and expiry judged on one clock.

Found by the fault drills of issue 35 (item 3): with one replica's clock 120 s ahead,
it "resumed 10 jobs of a replica whose lease lapsed" while that replica was alive and
running them. Every job was generated twice, the owner's settlements were dropped
("hold ... was already closed") and, in a longer run, jobs ended ``failed`` ("the
result is lost"). Each replica wrote its ledger lease (``instances.lease_until``) and
judged the others' on its own ``time.time()``: a clock ahead sees every other lease
lapsed; a clock behind writes leases that the others see lapsed already.

Two ``bourse serve`` replicas share one PostgreSQL database and one Redis book, as
docs/replicas.md runs them; one of them runs under libfaketime (Debian's
``libfaketime``, ``LD_PRELOAD`` with ``FAKETIME``), +120 s in one case and -120 s in
the other. Slow jobs (the simulator at 10 tokens/s, longer than two of the replicas'
lease sweeps) are submitted to both. Every job must succeed, run once (one hold per
request, settled), with no settlement dropped, no take-over logged, and the books
balanced (:mod:`tests.faults.ledger`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.faults.ledger import read_books
from tests.support.databases import MISSING_SERVICE_MARK, services_required
from tests.support.processes import CLUSTER_ENV, serve_process

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ADMIN_KEY = "bk_admin_clock_skew"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
"""Debian's libfaketime (scripts/ensure-faketime installs it from the test command)."""
JOBS_PER_REPLICA = 5
OUTPUT_TOKENS = 130
TOKENS_PER_S = 10
"""A job runs ~13 s: past two of the replicas' lease sweeps (every 5 s, the ledger lease being 15 s)."""
DONE_S = 60.0


def _config(redis_url: str, prefix: str) -> str:
    return f"""
[server]
log_level = "info"
log_format = "json"

[cluster]
redis_url = "{redis_url}"
key_prefix = "{prefix}"
lease_s = 1

[products.slow]
sim_overrides = true
[[products.slow.deployments]]
engine = "sim"
slots = {2 * JOBS_PER_REPLICA}
floor = 0.1
"""


def _log_lines(tmp: Path, name: str) -> list[str]:
    logs = sorted(tmp.glob(f"{name}-*.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1].read_text(errors="replace").splitlines() if logs else []


def _clock_of(tmp: Path, name: str) -> float:
    """The replica's own time, read from the timestamp of its latest JSON log line."""
    for line in reversed(_log_lines(tmp, name)):
        if line.startswith("{"):
            ts = json.loads(line)["ts"]
            return datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
    raise AssertionError(f"no JSON log line from {name}")


def _holds_per_request(dsn: str) -> dict[str, list[tuple[str, int, str]]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT request_id, state, charged_micros, owner FROM holds").fetchall()
    out: dict[str, list[tuple[str, int, str]]] = {}
    for request_id, state, charged, owner in rows:
        out.setdefault(str(request_id), []).append((str(state), int(charged), str(owner)))
    return out


@pytest.fixture
def skew_setup(tmp_path: Path, postgres_dsn: str, redis_service_url: str) -> Iterator[dict[str, Any]]:
    if LIBFAKETIME is None:
        problem = "libfaketime is not installed (apt-get install faketime libfaketime; scripts/test does it)"
        if services_required():
            pytest.fail(f"{problem}; BOURSE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
        pytest.skip(f"{problem}; {MISSING_SERVICE_MARK}")
    yield {"tmp": tmp_path, "dsn": postgres_dsn, "redis": redis_service_url}


@pytest.mark.parametrize("skew", ["+120s", "-120s"], ids=["ahead", "behind"])
def test_a_replica_with_a_skewed_clock_runs_no_job_twice(skew_setup: dict[str, Any], skew: str) -> None:
    tmp, dsn = skew_setup["tmp"], skew_setup["dsn"]
    prefix = "t" + os.urandom(6).hex()
    config = _config(skew_setup["redis"], prefix)
    faked = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": skew}
    with ExitStack() as stack:
        urls = []
        for i, env in enumerate([CLUSTER_ENV, {**CLUSTER_ENV, **faked}]):  # one sealing key, as replicas need
            data = tmp / f"data{i}"
            data.mkdir()
            url, _ = stack.enter_context(
                serve_process(tmp, f"replica{i}", config, data, ADMIN_KEY, dsn, env=env)
            )
            urls.append(url)
        r = httpx.post(urls[0] + "/admin/accounts", headers=ADMIN, json={"id": "skew", "credit_usd": 100.0})
        assert r.status_code == 201, r.text
        r = httpx.post(urls[0] + "/admin/keys", headers=ADMIN, json={"account": "skew"})
        assert r.status_code == 201, r.text
        user = {"authorization": f"Bearer {r.json()['key']}"}

        # the skew is real: the faked replica's log lines are stamped ~120 s off
        offset = _clock_of(tmp, "replica1") - time.time()
        expected = float(skew.rstrip("s"))
        assert abs(offset - expected) < 20, f"replica1's clock is {offset:+.1f} s off, not {skew}"

        jobs: dict[str, str] = {}  # job id -> request id
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": OUTPUT_TOKENS,
                "sim": {"output_tokens": OUTPUT_TOKENS, "tokens_per_s": TOKENS_PER_S}}  # fmt: skip
        for n in range(2 * JOBS_PER_REPLICA):
            r = httpx.post(urls[n % 2] + "/v1/jobs", headers=user, timeout=30,
                           json={"endpoint": "/v1/chat/completions", "body": body})  # fmt: skip
            assert r.status_code == 202, r.text
            jobs[r.json()["id"]] = r.json()["request_id"]

        deadline = time.monotonic() + DONE_S
        views: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            for job_id in jobs:
                views[job_id] = httpx.get(urls[0] + f"/v1/jobs/{job_id}", headers=user, timeout=30).json()
            ended = all(v["status"] not in ("queued", "running") for v in views.values())
            if ended and not read_books(tmp, dsn).ids("open"):
                break
            time.sleep(0.5)
        statuses = {j: v["status"] for j, v in views.items()}
        assert set(statuses.values()) == {"succeeded"}, (statuses, [v.get("error") for v in views.values()])

        holds = _holds_per_request(dsn)
        twice = {jobs[j]: holds.get(jobs[j]) for j in jobs if len(holds.get(jobs[j], [])) != 1}
        assert not twice, f"jobs run more than once (holds per request): {twice}"
        for j in jobs:
            [(state, charged, _)] = holds[jobs[j]]
            assert state == "settled" and charged > 0, (j, holds[jobs[j]])
            assert charged == views[j]["result"]["usage"]["cost_micros"], (j, holds[jobs[j]], views[j])
        books = read_books(tmp, dsn)
        books.assert_balanced()
        assert not books.ids("open") and not books.ids("reconciling"), books

        lines = _log_lines(tmp, "replica0") + _log_lines(tmp, "replica1")
        dropped = [ln for ln in lines if "already closed" in ln]
        taken = [ln for ln in lines if "lease lapsed" in ln or "reconciling" in ln]
        assert not dropped, f"settlements dropped: {dropped[:3]}"
        assert not taken, f"a live replica's work was taken over: {taken[:3]}"


IDEM_TTL_S = 60
"""``[storage] idempotency_ttl_s``, its least: a clock 120 s off is past it."""
IDEM_TOKENS = 40
"""The idempotent request runs ~4 s (10 tokens a second)."""


def _idem_config(redis_url: str, prefix: str) -> str:
    return _config(redis_url, prefix) + f"\n[storage]\nidempotency_ttl_s = {IDEM_TTL_S}\n"


@pytest.mark.parametrize("skew", ["+120s", "-120s"], ids=["ahead", "behind"])
def test_an_idempotency_key_in_flight_is_not_run_again_by_a_skewed_replica(
    skew_setup: dict[str, Any], skew: str
) -> None:
    """A request with an ``Idempotency-Key`` runs on one replica; the same key and body
    come to the other while it runs. The claim is the key's lease: before the fix each
    replica wrote its expiry (``now + idempotency_ttl_s``) and judged it on its own
    clock, so a replica 120 s ahead saw the other's live claim expired (and one 120 s
    behind wrote a claim the other saw expired), deleted it and ran the request a second
    time: two holds, two charges. Now both are on the database's clock: the second is a
    409 while the first runs, and its replay once it ended, one hold charged."""
    tmp, dsn = skew_setup["tmp"], skew_setup["dsn"]
    config = _idem_config(skew_setup["redis"], "t" + os.urandom(6).hex())
    faked = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": skew}
    with ExitStack() as stack:
        urls = []
        for i, env in enumerate([CLUSTER_ENV, {**CLUSTER_ENV, **faked}]):
            data = tmp / f"data{i}"
            data.mkdir()
            url, _ = stack.enter_context(
                serve_process(tmp, f"idem{i}", config, data, ADMIN_KEY, dsn, env=env)
            )
            urls.append(url)
        r = httpx.post(urls[0] + "/admin/accounts", headers=ADMIN, json={"id": "idem", "credit_usd": 100.0})
        assert r.status_code == 201, r.text
        r = httpx.post(urls[0] + "/admin/keys", headers=ADMIN, json={"account": "idem"})
        assert r.status_code == 201, r.text
        user = {
            "authorization": f"Bearer {r.json()['key']}",
            "idempotency-key": "once-" + os.urandom(4).hex(),
        }
        # the claim is made by the replica whose clock is behind the other's
        first, second = (urls[0], urls[1]) if skew.startswith("+") else (urls[1], urls[0])
        body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": IDEM_TOKENS,
                "sim": {"output_tokens": IDEM_TOKENS, "tokens_per_s": TOKENS_PER_S}}  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(
                httpx.post, first + "/v1/chat/completions", headers=user, json=body, timeout=60
            )
            time.sleep(1.0)  # the claim is made, the run under way
            again = httpx.post(second + "/v1/chat/completions", headers=user, json=body, timeout=60)
            done = running.result()
        assert done.status_code == 200, done.text
        assert again.status_code == 409, f"the key was run again: {again.status_code} {again.text[:300]}"
        assert again.json()["error"]["code"] == "idempotency_conflict", again.text
        replay = httpx.post(second + "/v1/chat/completions", headers=user, json=body, timeout=60)
        assert replay.status_code == 200 and replay.headers.get("idempotent-replayed") == "true", replay.text
        assert replay.json()["id"] == done.json()["id"], (replay.text, done.text)
        with psycopg.connect(dsn) as conn:
            holds = conn.execute(
                "SELECT state, charged_micros FROM holds WHERE account_id = 'idem'"
            ).fetchall()
        assert [state for state, _ in holds] == ["settled"], holds
