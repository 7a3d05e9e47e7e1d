"""bourse in front of real engines (issue 34's closing figures): for each engine,
started on loopback with the packaged Gemma 3 270M GGUF (``tests.support.real_engines``)
behind a served gateway (``bench.common.gateway_process``), it measures

- the usage charged for a stream against the engine's own count for the same request
  run non-streamed (a chat and a legacy completion, temperature 0);
- the breaker openings from one over-context request (streamed, then not), and what
  the client was answered;
- the time from killing the engine (SIGKILL) to the deployment being marked unavailable
  in ``/v1/market``, with ``probe_interval_s = 1`` and with the default 10;

and prints one markdown table. ``python -m bench.engines`` (about 70 s here; needs
``scripts/build-llama-server`` to have built llama-server, else that column says so).
vLLM is measured only when its virtualenv exists (``scripts/test-engines`` makes it);
else its column says so.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from tests.support.gateway import breaker_openings
from tests.support.real_engines import (
    RealEngine,
    llama_cpp_python_server,
    llama_server,
    llama_server_cache_path,
    packaged_gguf,
    vllm_server,
)
from tests.support.sse import SSEResult, collect_sse

from bench.common import gateway_process

TIMEOUT_S = 180.0
CHAT = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a sentence about the sea."},
    ],
    "temperature": 0,
    "seed": 7,
    "max_tokens": 16,
}
LEGACY = {"prompt": "The capital of France is", "temperature": 0, "seed": 7, "max_tokens": 16}
OVER_CONTEXT = "a " * 4900
"""~4,900 tokens in 9,800 bytes: over a 2,048-token context, under bourse's byte
pre-check (9,800 / 8 = 1,225)."""

Row = dict[str, str]


def _config(engine: RealEngine) -> str:
    """Two products on the one engine: ``fast`` probed every second (and, for
    llama-cpp-python, counting its streams with the GGUF), ``plain`` with the defaults
    (probes every 10 s, breaker threshold 3)."""
    counting = ""
    if engine.flavor == "llama-cpp-python":
        counting = f'tokenizer = "{packaged_gguf()}"\nn_ctx = {engine.n_ctx}\n'
    return f"""
[products.fast]
[[products.fast.deployments]]
engine = "openai"
name = "fast-main"
base_url = "{engine.base_url}"
model = "{engine.model}"
probe_interval_s = 1
first_byte_timeout_s = {TIMEOUT_S}
{counting}
[products.plain]
[[products.plain.deployments]]
engine = "openai"
name = "plain-main"
base_url = "{engine.base_url}"
model = "{engine.model}"
first_byte_timeout_s = {TIMEOUT_S}
"""


def _direct(engine: RealEngine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(engine.base_url + path, json={"model": engine.model, **body}, timeout=TIMEOUT_S)
    r.raise_for_status()
    doc: dict[str, Any] = r.json()
    return doc


def _tokens(usage: dict[str, Any]) -> str:
    estimated = " (estimated)" if usage.get("usage_estimated") else ""
    return f"{usage['prompt_tokens']} + {usage['completion_tokens']}{estimated}"


def _usage(engine: RealEngine, root: str, auth: dict[str, str], row: Row) -> None:
    for name, path, body in (("chat", "/chat/completions", CHAT), ("legacy", "/completions", LEGACY)):
        _direct(engine, path, body)  # an engine's first run of a prompt may differ: warm it
        own = _direct(engine, path, body)["usage"]
        res = collect_sse(
            root, {"model": "fast", **body, "stream_options": {"include_usage": True}},
            path="/v1" + path, headers=auth, timeout=TIMEOUT_S,
        )  # fmt: skip
        charged = res.chunks[-1].get("usage") if res.status == 200 and res.chunks else None
        row[f"{name}: stream charged (prompt + completion)"] = (
            _tokens(charged) if charged else f"no usage (HTTP {res.status})"
        )
        row[f"{name}: engine's own count, not streamed"] = _tokens(own)


def _answered(res: SSEResult) -> str:
    if res.status != 200:
        error = res.body_json.get("error", {}) if isinstance(res.body_json, dict) else {}
        return f"HTTP {res.status} {error.get('code', '')}".strip()
    codes = [c["error"].get("code") for c in res.chunks if "error" in c]
    return f"200, in-band {codes[0]}" if codes else "200, no error"


def _over_context(root: str, auth: dict[str, str], row: Row) -> None:
    body = {"model": "plain", "messages": [{"role": "user", "content": OVER_CONTEXT}]}
    before = breaker_openings(root)
    streamed = collect_sse(root, {**body, "stream": True}, headers=auth, timeout=TIMEOUT_S)
    after_stream = breaker_openings(root)
    r = httpx.post(root + "/v1/chat/completions", json=body, headers=auth, timeout=TIMEOUT_S)
    after = breaker_openings(root)
    row["over-context request, streamed: breaker openings (client got)"] = (
        f"{after_stream - before:g} ({_answered(streamed)})"
    )
    code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
    row["over-context request, not streamed: breaker openings (client got)"] = (
        f"{after - after_stream:g} (HTTP {r.status_code} {code})"
    )


def _dead_after(root: str, engine: RealEngine, row: Row) -> None:
    """Kill the engine; the seconds until each product's deployment reads unavailable."""

    def available(product: str) -> bool:
        doc = httpx.get(f"{root}/v1/market/{product}", timeout=30).json()
        return bool(doc["deployments"][0]["available"])

    if not (available("fast") and available("plain")):
        raise RuntimeError("a deployment was unavailable before the engine was killed")
    engine.process.kill()
    killed = time.monotonic()
    took: dict[str, float] = {}
    while len(took) < 2 and time.monotonic() - killed < 60:
        for product in ("fast", "plain"):
            if product not in took and not available(product):
                took[product] = time.monotonic() - killed
        time.sleep(0.02)
    for product, label in (("fast", "1"), ("plain", "10 (default)")):
        key = f"killed → unavailable, probe_interval_s = {label}"
        row[key] = f"{took[product]:.2f} s" if product in took else "not within 60 s"


def _measure(engine: RealEngine, folder: Path) -> Row:
    row: Row = {}
    with gateway_process(_config(engine), log=folder / f"gateway-{engine.flavor}.log") as (v1, key, _):
        root, auth = v1.removesuffix("/v1"), {"authorization": f"Bearer {key}"}
        _usage(engine, root, auth, row)
        _over_context(root, auth, row)
        _dead_after(root, engine, row)
    return row


def _engines() -> list[tuple[str, Callable[[Path], contextlib.AbstractContextManager[RealEngine]] | str]]:
    cache = Path(os.environ.get("BOURSE_CACHE_DIR") or Path.home() / ".cache" / "bourse")
    vllm_python, vllm_model = cache / "vllm-venv" / "bin" / "python", cache / "vllm-gemma-3-270m"
    vllm: Callable[[Path], contextlib.AbstractContextManager[RealEngine]] | str = (
        f"not measured: no virtualenv at {vllm_python.parent.parent} (scripts/test-engines makes it)"
    )
    if os.access(vllm_python, os.X_OK) and (vllm_model / "config.json").exists():
        vllm = lambda folder: vllm_server(vllm_model, python=str(vllm_python), log_dir=folder)  # noqa: E731
    server = llama_server_cache_path()
    return [
        ("llama-cpp-python's server", llama_cpp_python_server),
        (
            "llama.cpp llama-server",
            (lambda folder: llama_server(folder)) if os.access(server, os.X_OK) else f"not built ({server})",
        ),
        ("vLLM (CPU)", vllm),
    ]


def table(rows: dict[str, Row | str]) -> str:
    names = list(rows)
    keys: list[str] = []
    for row in rows.values():
        if isinstance(row, dict):
            keys += [k for k in row if k not in keys]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in keys:
        cells = [r.get(k, "") if isinstance(r, dict) else "" for r in rows.values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    notes = [f"{name}: {r}" for name, r in rows.items() if isinstance(r, str)]
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


@contextlib.contextmanager
def _folder(keep: str | None) -> Iterator[Path]:
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
            yield Path(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", help="keep the engines' and gateways' logs in this folder")
    args = ap.parse_args()
    rows: dict[str, Row | str] = {}
    with _folder(args.logs) as folder:
        for name, start in _engines():
            if isinstance(start, str):
                rows[name] = start
                continue
            t0 = time.monotonic()
            with start(folder) as engine:
                rows[name] = _measure(engine, folder)
            print(f"{name}: measured in {time.monotonic() - t0:.0f} s", flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
