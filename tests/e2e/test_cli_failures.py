"""Every CLI failure as a real process: one line on stderr, exit 2, never a traceback.

A missing or unreadable file, a file that is not JSON, a server that cannot be reached
or that does not answer JSON, a bad config (each problem on its own line), a data
folder that cannot be made."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tests.support.processes import clean_env, free_port
from tests.support.servers import serve_app_in_thread


def _bourse(*args: str, cwd: Path | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bourse", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=clean_env(),
    )


def _one_line_exit_2(p: subprocess.CompletedProcess[str], prog: str, *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{prog}: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def not_json() -> Iterator[str]:
    """A server that answers every request with a plain-text page."""

    async def page(request: Request) -> Response:
        return PlainTextResponse("<html>a proxy's error page</html>", status_code=502)

    app = Starlette(routes=[Route("/{path:path}", page, methods=["GET", "POST"])])
    with serve_app_in_thread(app) as url:
        yield url


def _nowhere() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_jobs_submit_missing_file(tmp_path: Path) -> None:
    p = _bourse("jobs", "--api-key", "k", "--url", _nowhere(), "submit", "missing.json", cwd=tmp_path)
    _one_line_exit_2(p, "bourse jobs", "missing.json", "No such file")


def test_jobs_submit_a_file_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    p = _bourse("jobs", "--api-key", "k", "--url", _nowhere(), "submit", "bad.json", cwd=tmp_path)
    _one_line_exit_2(p, "bourse jobs", "bad.json", "not JSON")


def test_jobs_submit_a_file_that_is_not_text(tmp_path: Path) -> None:
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    p = _bourse("jobs", "--api-key", "k", "--url", _nowhere(), "submit", "bin.json", cwd=tmp_path)
    _one_line_exit_2(p, "bourse jobs", "bin.json")


def test_jobs_submit_stdin_not_json() -> None:
    p = _bourse("jobs", "--api-key", "k", "--url", _nowhere(), "submit", "-", stdin="[1, 2")
    _one_line_exit_2(p, "bourse jobs", "not JSON")


@pytest.mark.parametrize("action", [["result", "job_x"], ["watch", "job_x"], ["cancel", "job_x"]])
def test_jobs_unreachable_server(action: list[str]) -> None:
    url = _nowhere()
    p = _bourse("jobs", "--api-key", "k", "--url", url, *action)
    _one_line_exit_2(p, "bourse jobs", "cannot reach", url)


def test_jobs_submit_unreachable_server(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text('{"model": "m", "messages": []}')
    url = _nowhere()
    p = _bourse("jobs", "--api-key", "k", "--url", url, "submit", "job.json", cwd=tmp_path)
    _one_line_exit_2(p, "bourse jobs", "cannot reach", url)


@pytest.mark.parametrize("action", [["result", "job_x"], ["cancel", "job_x"], ["submit", "-"]])
def test_jobs_server_answers_not_json(not_json: str, action: list[str]) -> None:
    p = _bourse("jobs", "--api-key", "k", "--url", not_json, *action, stdin='{"model": "m"}')
    _one_line_exit_2(p, "bourse jobs", "502", "not JSON")


def test_admin_unreachable_server() -> None:
    url = _nowhere()
    p = _bourse("admin", "--url", url, "--admin-key", "k", "accounts", "show", "a")
    _one_line_exit_2(p, "bourse admin", "cannot reach", url)


def test_serve_bad_config_lists_every_problem(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(
        '[server]\nlog_level = "loud"\nport = "x"\n'
        '[products.p]\npolicy = "nope"\n[[products.p.deployments]]\nengine = "sim"\nslots = 0\n'
    )
    p = _bourse("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), "--port", str(free_port()))
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    keys = ["server.log_level", "server.port", "products.p.policy", "products.p.deployments[0].slots"]
    assert len(lines) == len(keys), lines
    for key, line in zip(
        keys, sorted(lines, key=lambda ln: [k in ln for k in keys].index(True)), strict=True
    ):
        assert line.startswith(f"bourse: config error in {cfg}: {key}: "), line


def test_serve_products_of_the_wrong_type(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("products = 3\n")
    p = _bourse("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"), "--port", str(free_port()))
    _one_line_exit_2(p, "bourse", str(cfg), "products: Input should be a valid dictionary")


def test_serve_data_dir_that_cannot_be_made(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    p = _bourse("serve", "--data-dir", str(tmp_path / "file" / "data"), "--port", str(free_port()))
    _one_line_exit_2(p, "bourse", str(tmp_path / "file"))


WITHOUT_OTEL = """
import runpy, sys


class WithoutOtel:
    '''A meta-path finder before all others: ``opentelemetry`` is not installed here.'''

    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, WithoutOtel())
sys.argv[0] = "bourse"
runpy.run_module("bourse", run_name="__main__")
"""
"""``python -c WITHOUT_OTEL serve …``: ``bourse`` run as ``python -m bourse`` would be,
in an interpreter where the ``otel`` extra's packages cannot be imported (the suite's
venv has them installed; this hides the third-party package only, not bourse's code)."""


def test_serve_with_tracing_but_without_the_otel_extra_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "traced.toml"
    cfg.write_text('[server]\ntracing = true\n[products.p]\n[[products.p.deployments]]\nengine = "sim"\n')
    data = tmp_path / "d"
    p = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL, "serve", "--config", str(cfg), "--data-dir", str(data),
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, env=clean_env(), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    line = _one_line_exit_2(
        p, "bourse", f"config error in {cfg}: server.tracing", "pip install 'bourse[otel]'"
    )
    assert "opentelemetry" in line, line  # what is missing
    written = sorted(p.name for p in data.iterdir()) if data.exists() else []
    assert not {"instance_id", "lock"} & set(written), written
    assert not data.exists(), written  # nothing at all: the folder is made after the config is checked
