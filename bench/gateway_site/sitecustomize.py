"""The benchmarks' hooks inside a ``bourse serve`` process: put this folder on the
gateway's PYTHONPATH. Each hook answers SIGUSR1 (k = 0, 1, ... is the signal's number);
any other Python process that sees this file does nothing.

- ``SOAK_TRACEMALLOC_DIR`` (``python -m bench.soak --tracemalloc N``): starts
  :mod:`tracemalloc` (``SOAK_TRACEMALLOC_FRAMES`` frames, default 10) and dumps a
  snapshot to ``$SOAK_TRACEMALLOC_DIR/snap-<k>.pickle``.
- ``BENCH_CPROFILE_OUT`` (``python -m bench.calls``): profiles the main thread (the
  event loop's, where a request's Python runs) with :mod:`cProfile`, writes what it
  counted since the last signal to ``$BENCH_CPROFILE_OUT.<k>`` and counts afresh.
- ``BENCH_OPCODES_OUT`` (``python -m bench.calls --opcodes``): counts the bytecode
  instructions the main thread runs in each function (``sys.settrace`` with
  ``f_trace_opcodes``: ~50 times slower, exact), writes them as JSON
  (``[[file, first line, function, count], ...]``) to ``$BENCH_OPCODES_OUT.<k>`` and
  counts afresh.

Not on a signal: ``BENCH_FORECAST_LOG`` (``python -m bench.market_probe``): each order
whose wait the forecast scores (it rested in the book), as it is admitted, one JSON line
appended to ``$BENCH_FORECAST_LOG.<pid>``: the wait told as it entered, the one it had,
and what the prediction went by (the arguments of
:func:`bourse.domain.forecast.wait_s`: slots, orders ahead, rate of arrivals above...).
"""

import os
import sys


def _is_gateway() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = [a.encode() for a in sys.argv]
    return b"bourse" in argv and b"serve" in argv


def _tracemalloc(folder: str) -> None:
    import gc
    import signal
    import tracemalloc

    tracemalloc.start(int(os.environ.get("SOAK_TRACEMALLOC_FRAMES", "10")))
    taken = [0]

    def dump(signum: int, frame: object) -> None:
        gc.collect()
        path = os.path.join(folder, f"snap-{taken[0]}.pickle")
        tracemalloc.take_snapshot().dump(path + ".part")
        os.replace(path + ".part", path)  # whole or absent
        taken[0] += 1

    signal.signal(signal.SIGUSR1, dump)


def _cprofile(prefix: str) -> None:
    import cProfile
    import signal

    current = [cProfile.Profile()]
    taken = [0]

    def dump(signum: int, frame: object) -> None:
        current[0].disable()
        path = f"{prefix}.{taken[0]}"
        current[0].dump_stats(path + ".part")
        os.replace(path + ".part", path)  # whole or absent
        taken[0] += 1
        current[0] = cProfile.Profile()
        current[0].enable()

    signal.signal(signal.SIGUSR1, dump)
    current[0].enable()


def _opcodes(prefix: str) -> None:
    import collections
    import json
    import signal
    from types import CodeType, FrameType
    from typing import Any

    counts: collections.Counter[CodeType] = collections.Counter()
    taken = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[frame.f_code] += 1
        return local

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    def dump(signum: int, frame: object) -> None:
        sys.settrace(None)
        rows = [[c.co_filename, c.co_firstlineno, c.co_name, n] for c, n in counts.items()]
        path = f"{prefix}.{taken[0]}"
        with open(path + ".part", "w") as f:
            json.dump(rows, f)
        os.replace(path + ".part", path)  # whole or absent
        taken[0] += 1
        counts.clear()
        sys.settrace(call)

    signal.signal(signal.SIGUSR1, dump)
    sys.settrace(call)


def _forecast_log(prefix: str) -> None:
    import json
    import math

    from bourse.services import market_forecast as mf

    path = f"{prefix}.{os.getpid()}"
    calls: list[dict[str, object]] = []
    entry: dict[str, dict[str, object]] = {}
    wait_s, rested, admitted, gone = (
        mf.wait_s,
        mf.Forecaster.rested,
        mf.Forecaster.admitted,
        mf.Forecaster.gone,
    )

    def fin(x: float) -> float | None:
        return x if math.isfinite(x) else None

    def logged_wait_s(bid, slots, ahead, above_per_s=0.0, horizon_s=mf.HORIZON_S, **kw):  # type: ignore[no-untyped-def]
        slots = list(slots)
        calls.append({
            "bid": bid, "slots": [[s.floor, s.at, s.run_s] for s in slots],
            "ahead": [[a.bid, fin(a.leaves_in), a.weight, a.run_s] for a in ahead],
            "above_per_s": above_per_s, "horizon_s": horizon_s, **kw,
        })  # fmt: skip
        return wait_s(bid, slots, ahead, above_per_s, horizon_s, **kw)

    def logged_rested(self, order, now, state):  # type: ignore[no-untyped-def]
        calls.clear()
        out = rested(self, order, now, state)
        entry[order.id] = {"id": order.id, "bid": order.bid, "position": order.position_at_entry,
                           "rested": now, "shared": state.view is not None, "calls": list(calls)}  # fmt: skip
        return out

    def logged_admitted(self, order, deployment, now):  # type: ignore[no-untyped-def]
        w = self._waiting.get(order.id)
        e = entry.pop(order.id, None)
        if w is not None and w.scored and e is not None:
            e.update(entered=w.entered, predicted=w.predicted, median=w.median, actual=now - w.entered)
            with open(path, "a") as f:
                f.write(json.dumps(e) + "\n")
        return admitted(self, order, deployment, now)

    def logged_gone(self, order, now=None, *, gave_up=False):  # type: ignore[no-untyped-def]
        entry.pop(order.id, None)
        return gone(self, order, now, gave_up=gave_up)

    mf.wait_s = logged_wait_s
    mf.Forecaster.rested = logged_rested
    mf.Forecaster.admitted = logged_admitted
    mf.Forecaster.gone = logged_gone


if _is_gateway():
    if os.environ.get("BENCH_FORECAST_LOG"):
        _forecast_log(os.environ["BENCH_FORECAST_LOG"])
    if os.environ.get("SOAK_TRACEMALLOC_DIR"):
        _tracemalloc(os.environ["SOAK_TRACEMALLOC_DIR"])
    elif os.environ.get("BENCH_CPROFILE_OUT"):
        _cprofile(os.environ["BENCH_CPROFILE_OUT"])
    elif os.environ.get("BENCH_OPCODES_OUT"):
        _opcodes(os.environ["BENCH_OPCODES_OUT"])
