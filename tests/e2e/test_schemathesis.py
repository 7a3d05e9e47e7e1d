"""schemathesis over GET /openapi.json against a served gateway (``bourse serve`` as a
child process: the sim engine, SQLite, an admin key, a funded API key).

Every operation is fuzzed (examples, coverage, fuzzing and stateful phases) within a
time budget; the run fails on any 500, an answer that breaks its documented schema,
status code, content type or headers, a schema-invalid request that is accepted, or a
405 without a correct ``Allow``. The gateway's own log must hold no traceback.

To reproduce a failure by hand: the output names the seed and a curl command;
``st run URL/openapi.json --seed N`` with the same ``schemathesis.toml`` replays it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.processes import clean_env, serve_process

ADMIN_KEY = "bk_admin_schemathesis"
CONFIG = """
[server]
max_body_bytes = 65536

[products.sim-fast]
[[products.sim-fast.deployments]]
engine = "sim"
slots = 4
floor = 0.05
max_output_tokens = 16
"""
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "allow_header_conformance",
]
"""Not ``positive_data_acceptance``: a schema-valid body may name a product that does
not exist (404), or cost more than the balance (402), by design."""
REJECTED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5XX"]
"""The statuses that reject a schema-invalid request: schemathesis's own list and 413, the
answer to a body over ``max_body_bytes`` (the fuzzer makes bodies of a megabyte)."""
TIME_BUDGET_S = 35
MAX_EXAMPLES = 40


def _api_key(url: str) -> str:
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(url + "/admin/accounts", json={"id": "fuzz", "credit_usd": 1e6}, headers=admin, timeout=30)
    assert r.status_code == 201, r.text
    r = httpx.post(url + "/admin/keys", json={"account": "fuzz"}, headers=admin, timeout=30)
    assert r.status_code == 201, r.text
    key: str = r.json()["key"]
    return key


def test_schemathesis_finds_no_server_error_or_schema_violation(tmp_path: Path) -> None:
    with serve_process(tmp_path, "gw", CONFIG, tmp_path / "data", ADMIN_KEY) as (url, proc):
        settings = tmp_path / "schemathesis.toml"
        settings.write_text(
            f'[auth.openapi.apiKey]\nbearer = "{_api_key(url)}"\n'
            f'[auth.openapi.adminKey]\nbearer = "{ADMIN_KEY}"\n'
            '[parameters]\n"path.product" = "sim-fast"\n'
            f"[checks.negative_data_rejection]\nexpected-statuses = {REJECTED}\n"
        )
        run = subprocess.run(
            [
                sys.executable, "-m", "schemathesis.cli", "--config-file", str(settings), "--no-color",
                "run", url + "/openapi.json",
                "--checks", ",".join(CHECKS),
                "--max-examples", str(MAX_EXAMPLES),
                "--max-time", str(TIME_BUDGET_S),
                "--workers", "1",
                "--request-timeout", "10",
                "--generation-database", "none",
                "--report-dir", str(tmp_path / "report"),
                # a fuzzed grace_s of 0 would lock the fuzzer's admin key out of every later admin call
                "--exclude-path", "/admin/admin_key/rotate",
            ],
            capture_output=True,
            text=True,
            timeout=TIME_BUDGET_S + 60,
            env=clean_env(),
            cwd=tmp_path,
        )  # fmt: skip
        assert proc.poll() is None, "the gateway died under the fuzzer"
    log = "\n".join(p.read_text() for p in tmp_path.glob("gw-*.log"))
    report = run.stdout[-12000:] + run.stderr[-3000:]
    assert run.returncode == 0, report + "\n--- gateway log ---\n" + log[-6000:]
    assert "Operations:       " in run.stdout and "0 selected" not in run.stdout, report
    assert "Traceback" not in log and "internal error" not in log, log[-6000:]
