"""``bourse serve --workers 2``: two processes on one port acting as one exchange.

With ``[cluster]`` (Redis and PostgreSQL) the workers are replicas of one cluster:
one product of one slot never runs two generations at once, though both workers
serve requests; ``/metrics``, whichever worker answers it, carries every worker's
series (labelled ``worker``) and the cluster's once. Without it, ``--workers 2`` is refused with one line and exit 2,
having written nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster.test_two_replicas import _cleanup_redis, sim_upstream
from tests.support.bodies import USER
from tests.support.processes import clean_env, free_port, serve_process

ADMIN_KEY = "bk_admin_workers_test"
REQUESTS = 16


def _config(upstream: str, redis_url: str, prefix: str) -> str:
    return f"""
[server]
log_level = "warning"

[cluster]
redis_url = "{redis_url}"
key_prefix = "{prefix}"
lease_s = 1.5

[products.one]
sim_overrides = true
[[products.one.deployments]]
engine = "openai"
base_url = "{upstream}/v1"
model = "sim"
slots = 1
floor = 0.1
"""


def _complete(url: str, key: str, i: int) -> int:
    body = {
        "model": "one",
        "messages": USER,
        "max_price": 50.0,
        "sim": {"output_tokens": 8, "tokens_per_s": 200},
    }
    with httpx.Client(timeout=60) as client:  # a connection of its own: the kernel picks its worker
        r = client.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    return r.status_code


@pytest.mark.postgres
@pytest.mark.redis
def test_two_workers_serve_one_book_of_one_slot(
    tmp_path: Path, postgres_dsn: str, redis_service_url: str
) -> None:
    prefix = "w" + os.urandom(6).hex()
    data = tmp_path / "data"
    data.mkdir()
    try:
        with (
            sim_upstream(tmp_path) as upstream,
            serve_process(
                tmp_path, "workers", _config(upstream, redis_service_url, prefix), data, ADMIN_KEY,
                postgres_dsn, extra_args=["--workers", "2"],
            ) as (url, proc),
        ):  # fmt: skip
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            httpx.post(url + "/admin/accounts", json={"id": "acme", "credit_usd": 100.0}, headers=admin,
                       timeout=30).raise_for_status()  # fmt: skip
            r = httpx.post(url + "/admin/keys", json={"account": "acme"}, headers=admin, timeout=30)
            r.raise_for_status()
            key = r.json()["key"]
            with ThreadPoolExecutor(REQUESTS) as pool:
                codes = list(pool.map(lambda i: _complete(url, key, i), range(REQUESTS)))
            assert codes == [200] * REQUESTS
            stats = httpx.get(upstream + "/sim/stats", timeout=10).json()
            assert (stats["completed"], stats["peak_running"]) == (REQUESTS, 1)
            with psycopg.connect(postgres_dsn) as conn:
                owners = {row[0] for row in conn.execute("SELECT DISTINCT owner FROM holds")}
            assert len(owners) == 2, owners  # both workers served, each a replica of its own id
            assert proc.poll() is None
    finally:
        _cleanup_redis(redis_service_url, prefix)


def _scrape(url: str) -> tuple[dict[str, float], set[str], Counter[str]]:
    """One scrape on a connection of its own (the kernel picks the worker that answers):
    the completed requests of ``one`` by worker (the docs' ``sum by`` adds them up),
    the workers whose process series it holds, and how many series of ``one`` each
    family has."""
    r = httpx.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    completed: dict[str, float] = {}
    processes: set[str] = set()
    series: Counter[str] = Counter()
    names = []
    for fam in text_string_to_metric_families(r.text):
        names.append(fam.name)
        for s in fam.samples:
            if s.name == "process_start_time_seconds":
                processes.add(s.labels.get("worker", "none"))
            if s.labels.get("product") != "one":
                continue
            series[s.name] += 1
            if s.name == "bourse_requests_total" and s.labels.get("outcome") == "completed":
                completed[s.labels.get("worker", "none")] = s.value
    assert len(names) == len(set(names)), "a family written twice"
    return completed, processes, series


@pytest.mark.postgres
@pytest.mark.redis
def test_every_scrape_of_two_workers_counts_every_request_once(
    tmp_path: Path, postgres_dsn: str, redis_service_url: str
) -> None:
    """Rounds of requests (each on a connection of its own, so both workers serve), each
    followed by scrapes on connections of their own: every scrape, whichever worker
    answers it, counts exactly the requests sent so far, so the total never goes down
    (on main, 1 -> 5 -> 1 over eight scrapes); both workers' series are there, and the
    cluster's gauges once."""
    prefix = "w" + os.urandom(6).hex()
    data = tmp_path / "data"
    data.mkdir()
    temp = tmp_path / "temp"  # where the gateway makes the workers' sockets
    temp.mkdir()
    try:
        with (
            sim_upstream(tmp_path) as upstream,
            serve_process(
                tmp_path, "workers", _config(upstream, redis_service_url, prefix), data, ADMIN_KEY,
                postgres_dsn, extra_args=["--workers", "2"], env={"TMPDIR": str(temp)},
            ) as (url, _proc),
        ):  # fmt: skip
            admin = {"authorization": f"Bearer {ADMIN_KEY}"}
            httpx.post(url + "/admin/accounts", json={"id": "acme", "credit_usd": 100.0}, headers=admin,
                       timeout=30).raise_for_status()  # fmt: skip
            r = httpx.post(url + "/admin/keys", json={"account": "acme"}, headers=admin, timeout=30)
            r.raise_for_status()
            key = r.json()["key"]
            sent = 0
            seen: list[float] = []
            for _ in range(3):
                with ThreadPoolExecutor(4) as pool:
                    codes = list(pool.map(lambda i: _complete(url, key, i), range(4)))
                assert codes == [200] * 4
                sent += 4
                for _ in range(6):
                    completed, processes, series = _scrape(url)
                    seen.append(sum(completed.values()))
                    assert seen[-1] == sent, (seen, completed)
                    assert processes == {"0", "1"}
                    for name in ("bourse_deployment_slots", "bourse_book_admissions_total"):
                        assert series[name] == 1, (name, series[name])
            assert set(completed) == {"0", "1"}, completed  # the premise: both workers served
            [folder] = temp.iterdir()
            assert folder.stat().st_mode & 0o777 == 0o700
            assert sorted(p.name for p in folder.iterdir()) == ["0.sock", "1.sock"]
        assert list(temp.iterdir()) == []  # the sockets' folder went with the gateway
    finally:
        _cleanup_redis(redis_service_url, prefix)


def test_two_workers_without_a_cluster_are_refused_with_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    args = [sys.executable, "-m", "bourse", "serve", "--workers", "2", "--data-dir", str(data),
            "--host", "127.0.0.1", "--port", str(free_port())]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, env=clean_env(), timeout=60, check=False)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workers 2 needs [cluster]" in lines[0], out.stderr
    assert not data.exists()
