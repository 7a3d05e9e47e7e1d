"""A job expires at ``expires_at`` exactly: the first read after it says ``expired``,
without the result, whenever the sweeper (which frees the stored result) next runs."""

from __future__ import annotations

import time

from tests.e2e.jobs.support import caller, chat_body
from tests.support.gateway import running_gateway

CONFIG = """
[products.one]
sim_overrides = true
[[products.one.deployments]]
engine = "sim"
slots = 1
floor = 1.0

[jobs]
sweep_interval_s = 3600
min_result_s = 1
"""
FINAL = ("succeeded", "failed", "canceled", "expired")


def test_a_read_after_expires_at_says_expired_without_the_result() -> None:
    with running_gateway(CONFIG) as gw:
        _me, jobs = caller(gw, "exact")
        job = jobs.submit(chat_body("one", tokens=3), ttl_s=1.5)
        done = jobs.wait_status(job["id"], *FINAL, timeout=5)
        assert done["status"] == "succeeded" and "result" in done, done
        # (the result is kept min_result_s after the job ends: expires_at may have moved)
        while time.time() <= max(job["expires_at"], done["expires_at"]):
            time.sleep(0.02)
        gone = jobs.get(job["id"])
        assert gone["status"] == "expired", gone
        assert "result" not in gone and "error" not in gone, gone
        listed = {j["id"]: j for j in jobs.list()["data"]}[job["id"]]
        assert listed["status"] == "expired" and "result" not in listed, listed
        assert jobs.cancel(job["id"]) == gone
