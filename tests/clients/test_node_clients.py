"""The npm clients, each a small script in ``node/`` run by ``node`` against a served
gateway: sheet 001's Node sample unchanged, a mid-stream error raised by every client
under every preset whose sheet leaves the error frame to us, and a 408 ``book_timeout``
that the ``openai`` package does not resubmit (``x-should-retry: false``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bourse.domain import policy
from tests.e2e.money.support import new_caller, read_until
from tests.support.config import Dep, Product
from tests.support.env import Env, start_env
from tests.support.sse import open_sse

NODE_DIR = Path(__file__).parent / "node"
PRESETS = tuple(policy.PRESETS)
CLIENTS = ("openai", "ai-openai", "ai-compatible")
EXACT_FRAMES = {("gopuram", "ai-openai")}
"""Sheet 004 dictates an error frame with ``choices``; the AI SDK's ``openai`` provider
reads such a frame as an ordinary chunk and drops its ``error`` (see
``test_the_sheet_frame_with_choices_is_read_as_a_chunk_by_the_ai_sdk_openai_provider``)."""


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail(
            "node is not installed: the npm client tests need Node 20 or later (scripts/test says so)"
        )
    if not (NODE_DIR / "node_modules").is_dir():
        pytest.fail(f"{NODE_DIR}/node_modules is missing: run `npm ci` there (scripts/test does)")
    return node


def run_node(script: str, *args: str, env: dict[str, str], cwd: Path = NODE_DIR) -> str:
    """Run ``node <script> <args>`` in ``cwd``; its stdout (a failure shows its stderr)."""
    proc = subprocess.run(
        [_node(), script, *args],
        cwd=cwd,
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, (script, args, proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout


def run_json(script: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(run_node(script, *args, env=env).strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    products = [
        Product("placeholder-large", [Dep("openfill-a", floor=0.05)], {"policy": "openfill"}),
        *(
            Product(
                f"fail-{p}",
                [Dep(f"fail-{p}-a", sim={"fail_after_tokens": 3, "output_tokens": 10})],
                {"policy": p},
            )
            for p in PRESETS
        ),
        Product("one", [Dep("one-a", slots=1)]),
    ]
    with start_env("sim", products, server={"quiet_interval_s": 0.2}) as e:
        yield e


def _client_env(env: Env, model: str, key: str | None = None) -> dict[str, str]:
    return {"BOURSE_URL": env.gateway.v1, "BOURSE_KEY": key or env.gateway.api_key, "BOURSE_MODEL": model}


def test_the_openfill_node_sample_runs_unchanged(env: Env) -> None:
    source = (NODE_DIR / "samples" / "openfill_stream.mjs").read_text()
    source = source.replace("https://api.openfill.ai/v1", env.gateway.v1)
    with tempfile.NamedTemporaryFile("w", suffix=".mjs", dir=NODE_DIR, prefix=".sample-") as f:
        f.write(source)
        f.flush()
        out = run_node(f.name, env={"OPENFILL_API_KEY": env.gateway.api_key})
    text, _, usage = out.partition("\n")
    assert text.strip(), out
    assert "x_market" in usage and "cost_micros" in usage, out


@pytest.mark.parametrize(
    ("preset", "client"), [(p, c) for p in PRESETS for c in CLIENTS if (p, c) not in EXACT_FRAMES]
)
def test_a_mid_stream_error_raises_in_every_client(env: Env, preset: str, client: str) -> None:
    seen = run_json("stream_error.mjs", client, env=_client_env(env, f"fail-{preset}"))
    assert seen["raised"] is True, seen
    assert seen["text"], seen  # what was delivered before the error stays delivered
    if client != "openai":
        assert seen["errorParts"] and seen["onError"], seen
        assert seen["finishReason"] == "error", seen


def test_the_sheet_frame_with_choices_is_read_as_a_chunk_by_the_ai_sdk_openai_provider(env: Env) -> None:
    """gopuram's sheet fixes its error frame (``choices`` with ``finish_reason: "error"``
    beside ``error``): the OpenAI SDKs and the openai-compatible provider raise on it, the
    AI SDK's ``openai`` provider does not, which is why the default frame has no ``choices``."""
    seen = run_json("stream_error.mjs", "ai-openai", env=_client_env(env, "fail-gopuram"))
    assert seen["raised"] is False and seen["text"], seen


def test_a_book_timeout_is_not_resubmitted_by_the_openai_package(env: Env) -> None:
    me = new_caller(env.gateway, "node-retry", 10.0)
    body = {"model": "one", "sim": {"tokens_per_s": 20, "output_tokens": 400}}
    with open_sse(env, body) as held:
        read_until(held, data_chunks=1)
        seen = run_json("book_timeout.mjs", env=_client_env(env, "one", me.key))
    assert seen["status"] == 408 and seen["shouldRetry"] == "false", seen
    assert seen["elapsedMs"] < 2000, seen
    records = me.get("/v1/usage", params={"limit": "100"}).json()["data"]
    assert [r["outcome"] for r in records] == ["timeout"], records
