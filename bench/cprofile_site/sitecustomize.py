"""For ``python -m bench.calls`` only: put on the gateway process's PYTHONPATH, it
profiles a ``bourse serve`` process's main thread (the event loop's, where a request's
Python runs) with :mod:`cProfile` and, on each SIGUSR1, writes what it counted since the
last signal to ``$BENCH_CPROFILE_OUT.<k>`` (k = 0, 1, ...) and starts counting afresh.
Any other Python process that sees it does nothing."""

import os
import sys

_OUT = os.environ.get("BENCH_CPROFILE_OUT")


def _is_gateway() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = [a.encode() for a in sys.argv]
    return b"bourse" in argv and b"serve" in argv


if _OUT and _is_gateway():
    import cProfile
    import signal

    _state = {"profile": cProfile.Profile(), "taken": 0}

    def _dump(signum: int, frame: object) -> None:
        prof = _state["profile"]
        prof.disable()
        path = f"{_OUT}.{_state['taken']}"
        prof.dump_stats(path + ".part")
        os.replace(path + ".part", path)  # whole or absent
        _state["taken"] += 1
        _state["profile"] = fresh = cProfile.Profile()
        fresh.enable()

    signal.signal(signal.SIGUSR1, _dump)
    _state["profile"].enable()
