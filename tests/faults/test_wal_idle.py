"""An idle gateway empties its WAL, even with a periodic writer that finds nothing to
do (issue 35, item 10).

The store empties the WAL (a TRUNCATE checkpoint) once it has been idle for
``SqliteStore.IDLE_CHECKPOINT_S``. Idle used to mean "no commit": with ``[jobs]
sweep_interval_s = 0.5`` (a valid setting) the jobs' sweeper committed a transaction
every half second whether or not it expired anything, so the idle pass never came,
and after 6,000 requests the WAL stayed at 91.5 MB through 20 s of idle (with the
default 30 s it emptied in ~2.5 s). Now idle means that no row was written: a
``bourse serve`` process with that setting takes a mixed load (jobs included, so the
sweeper has jobs to look at), then, idle, its WAL is empty within :data:`IDLE_S`.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from tests.faults.load import Load, config
from tests.faults.served import ADMIN_KEY, Served
from tests.support.processes import serve_process

REQUESTS = 1500
CONCURRENCY = 32
LOAD_S = 120.0
MIN_WAL_BYTES = 1 << 20
"""The load leaves at least this much WAL (else the test proves nothing)."""
IDLE_S = 6.0
"""The idle pass comes ``IDLE_CHECKPOINT_S`` (1 s) after the last write; the load's last
settlements and webhooks-free jobs end within a couple of seconds of its end."""
IDLE_BOUND_BYTES = 64 * 1024


def _wal_bytes(data_dir: Path) -> int:
    try:
        return os.path.getsize(data_dir / "bourse.db-wal")
    except FileNotFoundError:
        return 0


def test_the_wal_is_emptied_when_idle_though_the_jobs_sweeper_runs_every_half_second(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    toml = config(extra="[jobs]\nsweep_interval_s = 0.5\n")
    with serve_process(tmp_path, "walidle", toml, data_dir, ADMIN_KEY) as (url, _proc):
        gw = Served(url, data_dir, None)
        keys = gw.accounts("wal", 4, 50.0)
        tally = asyncio.run(
            Load(url, keys, seed=35).run(requests=REQUESTS, concurrency=CONCURRENCY, seconds=LOAD_S)
        )
        assert tally.forbidden == [], tally.forbidden[:5]
        after_load = _wal_bytes(data_dir)
        assert after_load >= MIN_WAL_BYTES, after_load
        gw.at_rest(30.0)
        t0 = time.monotonic()
        sizes = []
        while time.monotonic() - t0 < IDLE_S + 30.0:  # looked at longer, to report how long it took
            sizes.append(_wal_bytes(data_dir))
            if sizes[-1] <= IDLE_BOUND_BYTES:
                break
            time.sleep(0.1)
        emptied_s = time.monotonic() - t0
        assert sizes[-1] <= IDLE_BOUND_BYTES and emptied_s <= IDLE_S, (
            f"WAL {after_load / 2**20:.1f} MiB after the load, {sizes[-1] / 2**20:.1f} MiB "
            f"{emptied_s:.1f} s into idle"
        )
        print(
            f"WAL {after_load / 2**20:.1f} MiB after {REQUESTS} requests; emptied {emptied_s:.1f} s into idle"
        )
