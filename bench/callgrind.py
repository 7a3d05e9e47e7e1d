"""Instructions per request: one or more source trees of bourse under callgrind.

    .venv/bin/python -m bench.callgrind BASE_SRC CHANGED_SRC [--conns 64] [--upstream delay] [--seconds 30]
    .venv/bin/python -m bench.callgrind /tmp/base/src src --observe on,off   # each tree's observing
    .venv/bin/python -m bench.callgrind /tmp/base/src src --sse --conns 32   # per stream

Each tree's ``bourse serve`` runs under ``valgrind --tool=callgrind`` on the gateway
core (the harness's config and nginx upstreams, one product), is warmed up with wrk
for 8 s, has its counters zeroed (``callgrind_control -z``), serves wrk for
``--seconds``, and is dumped (``callgrind_control -d``): the dump's instruction count
over the requests wrk saw answered is the tree's instructions per request. valgrind
counts instructions, not seconds, so two runs of one tree agree within 1-2 % however
loaded the machine is when they answer about as many requests (three c=1 runs of one
tree: 1.818M-1.828M), where timed runs of the harness here scatter by 10 % and more.
Work done per second rather than per request (timers, the database threads' wake-ups)
is shared among the requests answered, so two runs that answer different numbers differ
more: two 20 s c=64 runs of one tree, 872 and 1,094 requests, read 1.791M and 1.713M.
It is the judge of a change of a few per cent in CPU per request; what it does not see
is time spent waiting on memory, on the GIL or on the kernel. Under valgrind a gateway
serves ~50 requests/s, so wrk's timeout is raised to 120 s (c=256 lost ~10 % of its
requests to the usual 10 s). Needs valgrind (Debian's ``valgrind`` package).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import harness as H
from bench.common import ADMIN_KEY, free_port, funded_key, observe_per_tree, process, tree_arguments

WARMUP_S = 8.0
WRK_TIMEOUT_S = 120
"""wrk's timeout: a gateway under valgrind answers ~50 requests/s."""


def _control(pid: int, flag: str) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=300)


def _instructions(prefix: str) -> int:
    """The ``summary`` of the dumps callgrind_control -d wrote (``<prefix>.<pid>.<n>``)."""
    total = 0
    for path in glob.glob(prefix + ".*.[0-9]*"):
        m = re.search(r"^summary: (\d+)", Path(path).read_text(errors="replace"), re.M)
        if m:
            total += int(m.group(1))
    return total


def measure(
    stack: H.Stack, src: str, tag: str, args: argparse.Namespace, out: Path, observe: bool = True
) -> dict[str, float]:
    """One tree: requests answered, errors and instructions while measured (``observe``:
    metrics and the access log on, as the harness's default bourse, or both off)."""
    prefix = str(out / tag)
    for old in glob.glob(prefix + ".*"):
        os.remove(old)
    with tempfile.TemporaryDirectory(prefix="bourse-cg-") as d:
        cfg = Path(d) / "bench.toml"
        cfg.write_text(H.bourse_config(stack, {"bench": args.upstream}, observe=observe))
        port = free_port()
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={prefix}.%p", sys.executable,
               "-m", "bourse", "serve", "--config", str(cfg), "--port", str(port), "--data-dir", d]  # fmt: skip
        env = {"BOURSE_ADMIN_KEY": ADMIN_KEY, "PYTHONPATH": str(Path(src).resolve())}
        base = f"http://127.0.0.1:{port}"
        with process(
            cmd, base + "/healthz", env=env, cpu=H.GATEWAY_CPU, log=out / f"{tag}.log", health_timeout_s=600
        ) as proc:
            key = funded_key(base, timeout_s=120)
            gw = H.Gateway(
                tag, base + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                models={"fast": "bench"}, pid=proc.pid,
            )  # fmt: skip
            H.load(gw, args.conns, WARMUP_S, streamed=args.sse, timeout_s=WRK_TIMEOUT_S)
            _control(proc.pid, "-z")
            n, errors = H.load(gw, args.conns, args.seconds, streamed=args.sse, timeout_s=WRK_TIMEOUT_S)
            _control(proc.pid, "-d")  # returns once the dump is written
    ins = _instructions(prefix)
    return {"requests": n, "errors": errors, "instructions": ins, "per_request": ins / max(n, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_arguments(ap, conns=64, seconds=30.0, out=str(H.LOGS / "callgrind"))
    args = ap.parse_args()
    observe = observe_per_tree(ap, args)
    out = Path(args.out)
    stack = H.tool_stack(out)
    results: list[tuple[str, dict[str, float]]] = []
    with H.nginx(stack):
        for i, (src, on) in enumerate(zip(args.srcs, observe, strict=True)):
            res = measure(stack, src, f"tree{i}", args, out, on)
            results.append((src, res))
            print(
                f"{src} (observing {'on' if on else 'off'}): {res['requests']:.0f} requests "
                f"({res['errors']:.0f} errors), {res['per_request']:,.0f} instructions per request",
                flush=True,
            )
    base = results[0][1]["per_request"]
    for src, res in results[1:]:
        print(f"{src} over {results[0][0]}: instructions per request {res['per_request'] / base:.3f}")


if __name__ == "__main__":
    main()
