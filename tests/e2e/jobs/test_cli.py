"""``bourse jobs`` against a served gateway (child processes, ``--url`` and
``--api-key``, or BOURSE_URL / BOURSE_API_KEY): ``submit FILE --watch`` ends 0 and
prints the job, ``submit -`` reads stdin, ``result ID`` prints the completion,
``cancel ID`` cancels, ``watch ID`` follows a job to its end."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs.support import caller, chat_body, slot_held
from tests.support.gateway import Gateway, running_gateway
from tests.support.processes import OutputLines, clean_env
from tests.support.waiting import wait_until

CONFIG = """
[products.one]
sim_overrides = true
[[products.one.deployments]]
engine = "sim"
slots = 1
floor = 1.0
tokens_per_s = 50
"""


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


def _jobs(gw: Gateway, key: str, *args: str, stdin: str | None = None, env: dict[str, str] | None = None,
          flags: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    pre = ["--url", gw.url, "--api-key", key] if flags else []
    return subprocess.run([sys.executable, "-m", "bourse", "jobs", *pre, *args], input=stdin,
                          capture_output=True, text=True, timeout=60, env=env or clean_env())  # fmt: skip


def _first_json(text: str) -> dict[str, Any]:
    doc, _ = json.JSONDecoder().raw_decode(text.lstrip())
    assert isinstance(doc, dict), text
    return doc


def test_submit_file_watch_then_result(gw: Gateway, tmp_path: Path) -> None:
    me, jobs = caller(gw, "cli")
    body = chat_body("one", seed=41, tokens=15)
    f = tmp_path / "job.json"
    f.write_text(json.dumps({"endpoint": "/v1/chat/completions", "body": body}))
    p = _jobs(gw, me.key, "submit", str(f), "--watch")
    assert p.returncode == 0, (p.stdout, p.stderr)
    job = _first_json(p.stdout)
    assert job["id"].startswith("job_") and job["status"] == "queued", job
    assert "succeeded" in p.stderr, p.stderr  # the watch line reached the end
    assert job["id"] in p.stderr, p.stderr
    final = jobs.get(job["id"])
    assert final["status"] == "succeeded", final

    r = _jobs(gw, me.key, "result", job["id"])
    assert r.returncode == 0, (r.stdout, r.stderr)
    res = json.loads(r.stdout)
    assert res["object"] == "chat.completion", res
    assert res == final["result"], (res, final["result"])
    assert res["choices"][0]["message"]["content"], res
    assert res["usage"]["completion_tokens"] == 15, res["usage"]


def test_submit_stdin_bare_body_then_watch(gw: Gateway) -> None:
    me, jobs = caller(gw, "cli-stdin")
    p = _jobs(gw, me.key, "submit", "-", "--endpoint", "/v1/completions",
              stdin=json.dumps({"model": "one", "prompt": "Once", "max_tokens": 4, "sim": {"output_tokens": 4}}))  # fmt: skip
    assert p.returncode == 0, (p.stdout, p.stderr)
    job = _first_json(p.stdout)
    assert job["endpoint"] == "/v1/completions", job
    w = _jobs(gw, me.key, "watch", job["id"], "--interval", "0.1")
    assert w.returncode == 0, (w.stdout, w.stderr)
    assert "succeeded" in w.stderr, w.stderr
    r = _jobs(gw, me.key, "result", job["id"])
    assert r.returncode == 0, (r.stdout, r.stderr)
    res = json.loads(r.stdout)
    assert res["object"] == "text_completion" and res["choices"][0]["text"], res
    assert res == jobs.get(job["id"])["result"]


def test_credentials_from_the_environment(gw: Gateway) -> None:
    """BOURSE_URL and BOURSE_API_KEY stand in for --url and --api-key (the CLI's help)."""
    me, jobs = caller(gw, "cli-env")
    job = jobs.submit(chat_body("one", tokens=3))
    jobs.wait_status(job["id"], "succeeded")
    env = clean_env(BOURSE_URL=gw.url, BOURSE_API_KEY=me.key)
    r = _jobs(gw, me.key, "result", job["id"], flags=False, env=env)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert json.loads(r.stdout) == jobs.get(job["id"])["result"]


def test_cancel(gw: Gateway, tmp_path: Path) -> None:
    me, jobs = caller(gw, "cli-cancel")
    before = me.balance()
    with slot_held(gw, "one"):
        job = jobs.submit(chat_body("one", tokens=5))
        p = _jobs(gw, me.key, "cancel", job["id"])
        assert p.returncode == 0, (p.stdout, p.stderr)
        out = json.loads(p.stdout)
        assert out["id"] == job["id"] and out["status"] == "canceled", out
    assert jobs.get(job["id"])["status"] == "canceled"
    assert me.balance() == before
    # result of a canceled job: not a success
    r = _jobs(gw, me.key, "result", job["id"])
    assert r.returncode != 0, (r.stdout, r.stderr)
    # an unknown job and a wrong key fail clearly
    u = _jobs(gw, me.key, "cancel", "job_000000000000000000000000")
    assert u.returncode != 0 and "not_found" in u.stdout + u.stderr, (u.stdout, u.stderr)
    w = _jobs(gw, "bk_wrong", "result", job["id"])
    assert w.returncode != 0 and "invalid_api_key" in w.stdout + w.stderr, (w.stdout, w.stderr)
    f = tmp_path / "bad.json"
    f.write_text("{nope")
    b = _jobs(gw, me.key, "submit", str(f))
    assert b.returncode == 2 and "not JSON" in b.stderr, (b.stdout, b.stderr)


def test_watch_shows_position_level_then_tokens_with_a_bar(gw: Gateway) -> None:
    me, jobs = caller(gw, "cli-watch")
    with slot_held(gw, "one"):
        job = jobs.submit(chat_body("one", tokens=30, sim={"output_tokens": 30, "tokens_per_s": 20}))
        proc = subprocess.Popen(
            [sys.executable, "-m", "bourse", "jobs", "--url", gw.url, "--api-key", me.key, "watch", job["id"],
             "--interval", "0.05"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=clean_env(),
        )  # fmt: skip
        assert proc.stderr is not None
        err = OutputLines(proc.stderr)
        try:
            # the slot stays held until the watcher has shown the job queued
            wait_until(lambda: err.has(" queued ") or proc.poll() is not None, 30, what="the queued line")
        except BaseException:
            proc.kill()
            raise
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.join()
    assert proc.returncode == 0, lines
    queued = [ln for ln in lines if " queued " in ln]
    running = [ln for ln in lines if " running " in ln]
    assert queued and "position=0" in queued[0] and "level=" in queued[0] and "bid=" in queued[0], lines
    assert running and any("tokens=" in ln and "[" in ln and "%" in ln for ln in running), lines
    assert "succeeded" in lines[-1], lines
