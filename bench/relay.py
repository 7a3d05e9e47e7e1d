"""One stream, measured: time to first byte and chunks/s, through the gateway and
directly against the same upstream (``bourse sim-upstream``), from one run.

    .venv/bin/python -m bench.relay [--tokens 2000] [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from bench.common import gateway, pct, sim_upstream

CONFIG = """
[server]
log_level = "warning"
[products.relay]
max_output_tokens = 100000
[[products.relay.deployments]]
engine = "openai"
base_url = "{upstream}"
model = "sim"
slots = 64
[products.sim-inproc]
max_output_tokens = 100000
[[products.sim-inproc.deployments]]
engine = "sim"
slots = 64
max_output_tokens = 100000
"""


def one_stream(
    client: httpx.Client, url: str, key: str | None, model: str, tokens: int
) -> tuple[float, float, int]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "benchmark"}],
        "stream": True,
        "max_tokens": tokens,
        "seed": 1,
        "sim": {"output_tokens": tokens, "max_output_tokens": tokens},
    }
    headers = {"authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    ttfb = 0.0
    chunks = 0
    with client.stream("POST", url + "/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if chunks == 0:
                    ttfb = time.perf_counter() - t0
                chunks += 1
    total = time.perf_counter() - t0
    return ttfb, total, chunks


def measure(url: str, key: str | None, model: str, tokens: int, runs: int) -> dict[str, float]:
    with httpx.Client(timeout=60) as c:
        one_stream(c, url, key, model, tokens)  # warm-up
        ttfbs, rates = [], []
        for _ in range(runs):
            ttfb, total, chunks = one_stream(c, url, key, model, tokens)
            ttfbs.append(ttfb * 1000)
            rates.append(chunks / total)
    return {
        "ttfb_p50_ms": pct(ttfbs, 50),
        "ttfb_p99_ms": pct(ttfbs, 99),
        "chunks_per_s": statistics.median(rates),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with sim_upstream(cpu=1) as upstream, gateway(CONFIG.format(upstream=upstream), cpu=0) as (gw, key):
        direct = measure(upstream, None, "sim", args.tokens, args.runs)
        via = measure(gw, key, "relay", args.tokens, args.runs)
        inproc = measure(gw, key, "sim-inproc", args.tokens, args.runs)
    print(f"one stream of {args.tokens} chunks, {args.runs} runs (median chunks/s; TTFB p50/p99)")
    print(f"{'path':38} {'TTFB p50 ms':>12} {'TTFB p99 ms':>12} {'chunks/s':>10}")
    for name, r in (
        ("direct: sim-upstream", direct),
        ("gateway -> openai engine -> sim-upstream", via),
        ("gateway, in-process sim engine", inproc),
    ):
        print(f"{name:38} {r['ttfb_p50_ms']:12.2f} {r['ttfb_p99_ms']:12.2f} {r['chunks_per_s']:10.0f}")
    print(
        f"ratio gateway/direct chunks/s: {via['chunks_per_s'] / direct['chunks_per_s']:.2f}; "
        f"added TTFB p50: {via['ttfb_p50_ms'] - direct['ttfb_p50_ms']:.2f} ms"
    )


if __name__ == "__main__":
    main()
