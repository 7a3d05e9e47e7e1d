"""The gateway's CPU and thread switches a request at low load (issue 40, item 2).

One ``bourse serve`` (embedded SQLite, an in-process ``sim`` product answering at once),
wrk at ``-c1`` and ``-c32`` (non-streamed), a warm-up then a measured run each; from
``/proc/<pid>/task/*`` it reports, per request: the process's CPU (µs), the CPU of the
threads other than the event loop's, and the voluntary context switches of all its threads (a
hand-off of a transaction to that thread and back costs at least two).

    PYTHONPATH=src:. python -m bench.lowload --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.common import gateway_process
from bench.harness import Gateway, _wrk_start

SIM_FAST = """[server]
log_level = "warning"
metrics = false
access_log = false
[products.bench]
max_waiting = 1000000
[[products.bench.deployments]]
engine = "sim"
slots = 100000
floor = 0.10
output_tokens = 16
"""


def _threads(pid: int) -> dict[str, tuple[float, int]]:
    """CPU seconds and voluntary context switches of the event loop's thread ("main")
    and of all the others summed (the SQLite threads, the default executor's)."""
    out: dict[str, tuple[float, int]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            status = (task / "status").read_text()
        except OSError:
            continue
        name = "main" if task.name == str(pid) else "others"
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        vol = next(
            int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("voluntary_ctxt_switches")
        )
        c, v = out.get(name, (0.0, 0))
        out[name] = (c + cpu, v + vol)
    return out


def run(gw: Gateway, pid: int, conns: int, seconds: float, warmup: float) -> dict[str, float]:
    result: dict[str, float] = {}
    for d in (warmup, seconds):
        before = _threads(pid)
        proc = _wrk_start(gw, "fast", conns, d, 10)
        stdout, _ = proc.communicate(timeout=d + 60)
        after = _threads(pid)
        line = next(ln for ln in stdout.splitlines() if ln.startswith("WRKJSON "))
        r = json.loads(line[8:])
        n = max(1, int(r["requests"]))
        cpu = sum(c for c, _ in after.values()) - sum(c for c, _ in before.values())
        vol = sum(v for _, v in after.values()) - sum(v for _, v in before.values())
        others = after.get("others", (0.0, 0))[0] - before.get("others", (0.0, 0))[0]
        result = {
            "conns": conns,
            "requests": n,
            "rps": round(n / (r["duration_us"] / 1e6)),
            "cpu_us": round(cpu / n * 1e6),
            "other_threads_cpu_us": round(others / n * 1e6),
            "switches": round(vol / n, 2),
            "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000,
            "errors": sum(v for k, v in r.items() if k.startswith("err_")),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--conns", default="1,32")
    args = ap.parse_args()
    with gateway_process(SIM_FAST) as (base, key, proc):
        gw = Gateway("bourse", base + "/chat/completions", headers={"authorization": f"Bearer {key}"},
                     models={"fast": "bench"}, pid=proc.pid)  # fmt: skip
        for c in args.conns.split(","):
            print(json.dumps(run(gw, proc.pid, int(c), args.seconds, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
