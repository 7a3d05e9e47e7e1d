"""What observing costs a finished request, in CPU time: the observer's hooks alone,
and whole requests through the app.

    .venv/bin/python -m bench.observer [--requests 100000] [--runs 5]
    .venv/bin/python -m bench.observer --app [--requests 3000] [--runs 5] [--concurrency 64]

One finished request calls, in order, what a run calls (``services/completion.py``,
``services/billing.py``, ``http/edge.py``): the request's :class:`Caller`, the run's
span, the hold's ledger timing, the wait's and the attempt's spans, the settlement's
span and ledger timing, then the :class:`RunReport` and ``run_finished``. This
measures that path with the null observer (the hooks present, nothing done), with
``[server] metrics`` and ``access_log`` each on and off (the access log written to
/dev/null in its batches), in process CPU time (``time.process_time``: other load
on the machine counts less than in wall time), and prints the best of ``--runs``
runs as microseconds per request, and the difference to the null observer.

``--app`` measures whole requests instead: two gateways in this process (the
container and its ASGI app, no socket), one with ``metrics`` and ``access_log`` on
(the access log to /dev/null), one with both off, each answering non-streamed chat
requests from the ``sim`` engine (16 tokens, no pacing), with the hold and the
settlement on SQLite, ``--concurrency`` at a time. The two are measured alternately
``--runs`` times; the process's CPU time (every thread: the SQLite one too) per
request, the median of the runs, is what a core of its own would serve.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from bourse.observability import build_observer
from bourse.observability.access_log import AccessLog
from bourse.ports.observer import NULL_OBSERVER, Caller, Observer, RunReport
from bourse.settings import ServerConfig


def one_request(observer: Observer, i: int) -> None:
    """The observer calls of one finished streamed request, in the order a run makes them."""
    t0 = time.perf_counter()
    caller = Caller("chatcmpl-0123456789abcdef01234567", "/v1/chat/completions", t0)
    caller.key_id = "key_0123456789abcdef"
    caller.product = "sim-fast"
    run = observer.start_span("bourse.run", caller.traceparent, t0)
    observer.ledger_timed("hold", 0.0004)
    wait = observer.start_span("bourse.book.wait", run)
    wait.end()
    attempt = observer.start_span("bourse.engine.attempt", run)
    attempt.set("bourse.deployment", "sim-fast/0")
    attempt.set("bourse.attempt", 0)
    _ = attempt.traceparent or caller.traceparent
    attempt.end(None)
    settle = observer.start_span("bourse.settle", run)
    observer.ledger_timed("settle", 0.0007)
    settle.end()
    observer.run_finished(
        RunReport(
            method="POST",
            request_id=caller.request_id,
            route=caller.route,
            product="sim-fast",
            outcome="completed",
            status=200,
            stream=True,
            detached=False,
            key_id=caller.key_id,
            correlation_id=caller.correlation_id,
            deployment="sim-fast/0",
            error=None,
            prompt_tokens=12,
            completion_tokens=16 + (i & 7),
            cost_micros=28,
            quote_micros=40,
            bid=1.0,
            cleared_price=1.0,
            queued_ms=0.1,
            ttft_ms=1.2,
            latency_ms=2.3 + (i & 15),
            requeues=0,
        )
    )
    run.end(None)


def measure(observer: Observer, n: int) -> float:
    """CPU microseconds per request over ``n`` requests (inside a running loop, as served)."""

    async def loop() -> float:
        start = time.process_time()
        for i in range(n):
            one_request(observer, i)
        spent = time.process_time() - start
        observer.close()
        return spent

    return asyncio.run(loop()) / n * 1e6


def observers(devnull: Any) -> dict[str, Observer]:
    out: dict[str, Observer] = {"null observer (hooks only)": NULL_OBSERVER}
    for metrics in (False, True):
        for access in (False, True):
            server = ServerConfig(metrics=metrics, access_log=access, log_format="json")
            obs = build_observer(server, books={}, store=None, instance="gw_bench", database="sqlite")
            if obs.access is not None:
                obs.access = AccessLog(json=True, stream=devnull)
            out[f"metrics {'on' if metrics else 'off'}, access log {'on' if access else 'off'}"] = obs
    return out


# -- whole requests through the app ------------------------------------------------------------

APP_CONFIG = """
[products.bench]
[[products.bench.deployments]]
engine = "sim"
slots = 1000
floor = 0.10
output_tokens = 16
"""
BODY = b'{"model": "bench", "messages": [{"role": "user", "content": "benchmark"}], "max_tokens": 16}'


async def _gateway(folder: str, observe: bool) -> tuple[Any, Any, str]:
    """(container, ASGI app, API key) of a started gateway with observing on or off."""
    import tomllib

    from bourse.container import build
    from bourse.settings import Environment, parse_config

    server = {} if observe else {"metrics": False, "access_log": False}
    cfg = parse_config({**tomllib.loads(APP_CONFIG), "server": server}, "bench", env={})
    container = build(cfg, data_dir=folder, env=Environment(admin_key="bk_admin_bench"))
    container.announce = False
    await container.start()
    await container.admin.create_account("bench", 1e6)
    key = (await container.admin.create_key("bench", None, None, None, None))["key"]
    return container, container.app(), key


async def _request(app: Any, key: str) -> int:
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "",
        "scheme": "http", "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json"),
                    (b"content-length", str(len(BODY)).encode())],
    }  # fmt: skip
    sent = [{"type": "http.request", "body": BODY, "more_body": False}]
    never = asyncio.Event()
    status = 0

    async def receive() -> dict[str, Any]:
        if sent:
            return sent.pop()
        await never.wait()  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def _load(app: Any, key: str, n: int, concurrency: int) -> float:
    """CPU µs per request over ``n`` requests, ``concurrency`` at a time."""
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            assert await _request(app, key) == 200

    start = time.process_time()
    await asyncio.gather(*(one() for _ in range(n)))
    return (time.process_time() - start) / n * 1e6


async def app_costs(n: int, runs: int, concurrency: int) -> dict[str, list[float]]:
    import logging
    import tempfile

    logging.getLogger("bourse.access").setLevel(logging.INFO)
    out: dict[str, list[float]] = {"on": [], "off": []}
    with (
        tempfile.TemporaryDirectory() as on_dir,
        tempfile.TemporaryDirectory() as off_dir,
        open(os.devnull, "w") as devnull,  # noqa: ASYNC230 (before the measurement)
    ):
        on = await _gateway(on_dir, True)
        off = await _gateway(off_dir, False)
        on[0].observer.access = AccessLog(json=False, stream=devnull)
        try:
            for gw in (on, off):  # warm up
                await _load(gw[1], gw[2], min(n, 500), concurrency)
            for _ in range(runs):
                out["on"].append(await _load(on[1], on[2], n, concurrency))
                out["off"].append(await _load(off[1], off[2], n, concurrency))
        finally:
            await on[0].stop()
            await off[0].stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--app", action="store_true", help="whole requests through the app, observing on and off")
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    if args.app:
        costs = asyncio.run(app_costs(args.requests or 3000, args.runs, args.concurrency))
        med = {k: statistics.median(v) for k, v in costs.items()}
        print(f"| gateway (c={args.concurrency}) | CPU µs per request, each run | median |")
        print("|---|---|---|")
        for k in ("on", "off"):
            label = "metrics and access log " + k
            print(f"| {label} | {', '.join(f'{x:.0f}' for x in costs[k])} | {med[k]:.0f} |")
        print(
            f"\non/off: {med['on'] / med['off']:.3f} ({(med['on'] / med['off'] - 1) * 100:+.1f} % CPU per request)"
        )
        return
    args.requests = args.requests or 100_000
    import logging

    logging.getLogger("bourse.access").setLevel(logging.INFO)
    with open(os.devnull, "w") as devnull:
        obs = observers(devnull)
        best = {name: min(measure(o, args.requests) for _ in range(args.runs)) for name, o in obs.items()}
    base = best["null observer (hooks only)"]
    print("| observer | CPU µs per finished request | over the null observer |")
    print("|---|---|---|")
    for name, us in best.items():
        print(f"| {name} | {us:.2f} | {us - base:+.2f} |")


if __name__ == "__main__":
    main()
