"""For ``python -m bench.soak --tracemalloc N`` only: put on the gateway process's
PYTHONPATH, it starts :mod:`tracemalloc` (``N`` frames) in a ``bourse serve`` process
and dumps a snapshot on each SIGUSR1, to ``$SOAK_TRACEMALLOC_DIR/snap-<k>.pickle``
(k = 0, 1, ...). Any other Python process that sees it does nothing."""

import os
import sys

_DIR = os.environ.get("SOAK_TRACEMALLOC_DIR")


def _is_gateway() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = [a.encode() for a in sys.argv]
    return b"bourse" in argv and b"serve" in argv


if _DIR and _is_gateway():
    import gc
    import signal
    import tracemalloc

    tracemalloc.start(int(os.environ.get("SOAK_TRACEMALLOC_FRAMES", "10")))
    _taken = [0]

    def _dump(signum: int, frame: object) -> None:
        gc.collect()
        path = os.path.join(_DIR, f"snap-{_taken[0]}.pickle")
        tracemalloc.take_snapshot().dump(path + ".part")
        os.replace(path + ".part", path)  # whole or absent
        _taken[0] += 1

    signal.signal(signal.SIGUSR1, _dump)
