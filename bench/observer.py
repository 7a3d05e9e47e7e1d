"""What observing costs a finished request: the observer's hooks alone, in CPU time.

    .venv/bin/python -m bench.observer [--requests 100000] [--runs 5]

One finished request calls, in order, what a run calls (``services/completion.py``,
``services/billing.py``, ``http/edge.py``): the request's :class:`Caller`, the run's
span, the hold's ledger timing, the wait's and the attempt's spans, the settlement's
span and ledger timing, then the :class:`RunReport` and ``run_finished``. This
measures that path with the null observer (the hooks present, nothing done), with
``[server] metrics`` and ``access_log`` each on and off (the access log written to
/dev/null in its batches), in process CPU time (``time.process_time``: other load
on the machine counts less than in wall time), and prints the best of ``--runs``
runs as microseconds per request, and the difference to the null observer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
            error_code=None,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
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
