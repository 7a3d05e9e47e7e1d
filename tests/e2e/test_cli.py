"""The command line as real processes: ``bourse serve`` on the built-in defaults and on a
config, a bad config refused with one clear line, and ``bourse sim-upstream``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.bodies import USER
from tests.support.processes import clean_env, free_port

START_TIMEOUT_S = 20.0


DEMO_KEY_FILE = re.compile(r"API key is in the file (\S+) \(mode 600\)")


def _demo_key(stderr_log: Path) -> str:
    """The demo account's API key: ``bourse serve`` on a fresh data folder writes it to a
    0600 file and names the file on stderr (not a terminal here, so no key is printed)."""
    deadline = time.monotonic() + 5
    while True:
        m = DEMO_KEY_FILE.search(stderr_log.read_text())
        if m or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert m, f"no API key file named on stderr: {stderr_log.read_text()!r}"
    return Path(m.group(1)).read_text().strip()


@contextmanager
def _process(
    args: list[str], log_dir: Path, name: str
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """Start ``python -m bourse <args> --port <free>``; yield its base URL once /healthz answers.

    A port taken between choosing and binding makes the process exit: try another."""
    last_err = ""
    for attempt in range(3):
        port = free_port()
        out = (log_dir / f"{name}-{attempt}.out").open("wb")
        err_path = log_dir / f"{name}-{attempt}.err"
        err = err_path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "bourse", *args, "--port", str(port)],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=clean_env(),  # no BOURSE_ variable of the suite's; an idle stop at once
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            up = False
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        up = True
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            if up:
                yield url, proc, err_path
                return
            last_err = err_path.read_text()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            out.close()
            err.close()
    raise AssertionError(f"{name} did not start: {last_err}")


def test_serve_with_defaults_streams_a_chat_completion(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with _process(["serve", "--data-dir", str(data_dir)], tmp_path, "serve") as (url, proc, log):
        client = openai.OpenAI(base_url=url + "/v1", api_key=_demo_key(log), max_retries=0, timeout=30)
        ids = {m.id for m in client.models.list()}
        assert "sim-fast" in ids
        pieces: list[str] = []
        models = set()
        with client.chat.completions.create(model="sim-fast", messages=USER, seed=1, stream=True) as stream:
            for chunk in stream:
                models.add(chunk.model)
                pieces.extend(ch.delta.content or "" for ch in chunk.choices)
        text = "".join(pieces)
        assert text
        assert models == {"sim-fast"}
        whole = client.chat.completions.create(model="sim-fast", messages=USER, seed=1)
        assert whole.choices[0].message.content == text
        client.close()
        proc.terminate()
        rc = proc.wait(timeout=15)
        assert rc == 0 or rc == -15, rc
    assert data_dir.is_dir()


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        (
            '[products.p]\n[[products.p.deployments]]\nengine = "sim"\nslots = "many"\n',
            "products.p.deployments[0].slots",
        ),
        ('[server]\nbogus = 1\n[products.p]\n[[products.p.deployments]]\nengine = "sim"\n', "server.bogus"),
        ('[products.p]\npolicy = "nope"\n[[products.p.deployments]]\nengine = "sim"\n', "policy"),
        ('[products.p]\n[[products.p.deployments]]\nengine = "openai"\nmodel = "m"\n', "base_url"),
    ],
    ids=["wrong-type", "unknown-key", "unknown-policy", "missing-base_url"],
)
def test_serve_with_bad_config_exits_with_one_line(tmp_path: Path, toml: str, key: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(toml)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bourse",
            "serve",
            "--config",
            str(bad),
            "--port",
            str(free_port()),
            "--data-dir",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    stderr = proc.stderr.decode()
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert str(bad) in lines[0], lines[0]
    assert key in lines[0], lines[0]


def test_serve_with_missing_config_file_exits_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    proc = subprocess.run(
        [sys.executable, "-m", "bourse", "serve", "--config", str(missing), "--port", str(free_port())],
        capture_output=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    stderr = proc.stderr.decode()
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and str(missing) in lines[0], stderr


def test_sim_upstream_answers_a_chat_completion(tmp_path: Path) -> None:
    with _process(["sim-upstream"], tmp_path, "sim-upstream") as (url, _, _log):
        client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=30)
        whole = client.chat.completions.create(model="anything", messages=USER, seed=1)
        assert whole.choices[0].message.content
        streamed = "".join(
            ch.delta.content or ""
            for chunk in client.chat.completions.create(model="anything", messages=USER, seed=1, stream=True)
            for ch in chunk.choices
        )
        assert streamed == whole.choices[0].message.content
        client.close()
        stats = httpx.get(url + "/sim/stats", timeout=5).json()
        assert stats == {"started": 2, "completed": 2, "cancelled": 0, "running": 0, "peak_running": 1}


def test_serve_process_in_front_of_sim_upstream_process(tmp_path: Path) -> None:
    with _process(["sim-upstream", "--tokens-per-s", "50"], tmp_path, "upstream") as (up, _, _log):
        cfg = tmp_path / "gw.toml"
        cfg.write_text(
            "[products.remote]\n[[products.remote.deployments]]\n"
            f'engine = "openai"\nbase_url = "{up}/v1"\nmodel = "internal-name"\nslots = 4\n'
        )
        # a config file makes no demo account unless asked
        gw = ["serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), "--demo"]
        with _process(gw, tmp_path, "gw") as (
            url,
            _,
            log,
        ):
            client = openai.OpenAI(base_url=url + "/v1", api_key=_demo_key(log), max_retries=0, timeout=30)
            chunks = list(
                client.chat.completions.create(
                    model="remote", messages=USER, seed=2, stream=True, stream_options={"include_usage": True}
                )
            )
            text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
            assert text
            assert {c.model for c in chunks} == {"remote"}
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            # a disconnect mid-stream reaches the upstream process
            stream = client.chat.completions.create(
                model="remote", messages=USER, seed=3, stream=True, extra_body={"sim": {"output_tokens": 100}}
            )
            for i, _chunk in enumerate(stream):
                if i == 1:
                    break
            stream.close()
            client.close()
            deadline = time.monotonic() + 1.0
            stats = httpx.get(up + "/sim/stats", timeout=5).json()
            while stats["cancelled"] < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
                stats = httpx.get(up + "/sim/stats", timeout=5).json()
            assert stats["cancelled"] == 1, stats
