"""SIGHUP to ``bourse serve --workers 2`` (issue 37): the gateway tells each worker,
each reads the config file again and applies its live terms; the gateway goes on.
Before, SIGHUP killed the gateway and its workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster.test_two_replicas import _cleanup_redis, sim_upstream
from tests.e2e.cluster.test_workers import _config
from tests.support.processes import serve_process

ADMIN_KEY = "bk_admin_workers_hup"


def _floors(url: str, n: int) -> set[float]:
    """The floor that ``n`` fresh connections read (the kernel picks each one's worker)."""
    seen = set()
    for _ in range(n):
        with httpx.Client(timeout=10) as client:
            seen.add(client.get(url + "/v1/market/one").json()["deployments"][0]["floor"])
    return seen


@pytest.mark.postgres
@pytest.mark.redis
def test_sighup_reaches_every_worker(tmp_path: Path, postgres_dsn: str, redis_service_url: str) -> None:
    prefix = "wh" + os.urandom(6).hex()
    data = tmp_path / "data"
    data.mkdir()
    config = _config("{upstream}", redis_service_url, prefix)
    try:
        with sim_upstream(tmp_path) as upstream:
            text = config.replace("{upstream}", upstream)
            with serve_process(tmp_path, "whup", text, data, ADMIN_KEY, postgres_dsn,
                               extra_args=["--workers", "2"]) as (url, proc):  # fmt: skip
                assert _floors(url, 8) == {0.1}
                (tmp_path / "whup.toml").write_text(text.replace("floor = 0.1", "floor = 0.3"))
                proc.send_signal(signal.SIGHUP)
                deadline = time.monotonic() + 15
                while _floors(url, 8) != {0.3}:
                    assert proc.poll() is None, "SIGHUP stopped the gateway"
                    assert time.monotonic() < deadline, "a worker kept the old floor"
                    time.sleep(0.1)
                assert _floors(url, 16) == {0.3} and proc.poll() is None
    finally:
        _cleanup_redis(redis_service_url, prefix)
