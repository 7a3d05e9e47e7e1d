"""One stream, measured: time to first byte and chunks/s, through the gateway and
directly against the same upstream (``bourse sim-upstream``), from one run.

    .venv/bin/python -m bench.relay [--tokens 2000] [--runs 20]

``--engine`` measures the upstream side alone, in one process and in CPU time (so
other load on the machine matters less): the ``openai`` engine's ``generate()`` over
16-chunk streams from an in-process upstream (the whole answer in one write, and one
write per frame), and the SSE parser on the same bytes.

    .venv/bin/python -m bench.relay --engine [--runs 12]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import timeit

import httpx
import orjson

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


async def upstream_frames(tokens: int = 16) -> list[bytes]:
    """The SSE frames of a ``tokens``-chunk answer as ``bourse sim-upstream`` sends it:
    the chunks, the usage chunk, ``[DONE]``."""
    from bourse.engines.sim import SimEngine, SimSettings
    from bourse.ports.engine import ChunkEvent, GenerationRequest

    engine = SimEngine(SimSettings(), "sim-upstream")
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "sim": {"output_tokens": tokens}}
    frames: list[bytes] = []
    usage = {}
    async for event in engine.generate(GenerationRequest("chatcmpl-1", "chat", body)):
        if isinstance(event, ChunkEvent):
            frames.append(b"data: " + orjson.dumps(event.chunk) + b"\n\n")
        else:
            usage = {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens}
    tail = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": usage}
    return [*frames, b"data: " + orjson.dumps(tail) + b"\n\n", b"data: [DONE]\n\n"]


async def engine_cpu_us(frames: list[bytes], per_frame: bool, runs: int, streams: int = 300) -> list[float]:
    """CPU microseconds per stream of the openai engine (and the in-process upstream serving it)."""
    from aiohttp import web
    from aiohttp.test_utils import RawTestServer

    from bourse.engines.openai_http import OpenAIHTTPEngine
    from bourse.ports.engine import GenerationRequest

    whole = b"".join(frames)

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in frames if per_frame else [whole]:
            await response.write(piece)
        await response.write_eof()
        return response

    server = RawTestServer(handler, host="127.0.0.1")
    await server.start_server()
    engine = OpenAIHTTPEngine(str(server.make_url("/v1")), "sim")
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def one() -> None:
        async for _ in engine.generate(GenerationRequest("r", "chat", dict(body))):
            pass

    try:
        for _ in range(100):  # warm-up: connections, caches
            await one()
        out = []
        for _ in range(runs):
            t0 = time.process_time()
            for _ in range(streams):
                await one()
            out.append((time.process_time() - t0) / streams * 1e6)
        return out
    finally:
        await engine.aclose()
        await server.close()


def parse_cpu_us(frames: list[bytes], pieces: list[bytes], runs: int, number: int = 2000) -> list[float]:
    """CPU microseconds to take the payloads out of one stream fed as ``pieces``."""
    from bourse.wire.sse import SSEParser

    def parse() -> None:
        parser = SSEParser()
        for piece in pieces:
            parser.payloads(piece)
        parser.end()

    return [
        t / number * 1e6 for t in timeit.repeat(parse, number=number, repeat=runs, timer=time.process_time)
    ]


def engine_main(runs: int) -> None:
    frames = asyncio.run(upstream_frames())
    print(f"the openai engine alone: {len(frames) - 2}-chunk streams ({sum(map(len, frames))} bytes), "
          f"CPU us per stream, min / median of {runs} runs")  # fmt: skip
    rows = [
        ("SSE parse, one piece", parse_cpu_us(frames, [b"".join(frames)], runs)),
        ("SSE parse, a piece per frame", parse_cpu_us(frames, frames, runs)),
        ("engine generate(), one write", asyncio.run(engine_cpu_us(frames, False, runs))),
        ("engine generate(), a write per frame", asyncio.run(engine_cpu_us(frames, True, runs))),
    ]
    for name, values in rows:
        print(f"  {name:38} {min(values):8.2f} {statistics.median(values):8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--engine", action="store_true", help="measure the openai engine alone, in process")
    args = ap.parse_args()
    if args.engine:
        return engine_main(args.runs)
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
