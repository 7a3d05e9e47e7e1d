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

``--functions N`` also prints, for each tree after the first, the N C functions whose
own instructions a request on the event loop's thread moved most from the first tree's
(self cost, read from the loop thread's dump; Python's own recursion suffixes folded).
That is how a cost hidden in C shows: on 2026-12-02 it put ``PyUnicode_FromFormatV``
at +12,000 instructions a stream, from ``_PyNumber_Index`` under ``_Py_bytes_contains``:
CPython 3.11's ``sub in some_bytes`` formats and clears a ``TypeError`` before it searches
(``wire/sse.py`` now uses ``find``).

``--cache-sim`` also simulates the caches and the branch predictor (callgrind's
``--cache-sim=yes --branch-sim=yes``; ``--ll BYTES`` sets the last-level cache's size)
and prints each event a request (``D1mr``, ``DLmr``, ``Bcm``, ...) and cachegrind's
estimate of cycles (an instruction each, 10 a first-level miss or mispredicted branch,
100 a last-level miss). It runs ~5 times slower still: compare runs of equal length.
On 2026-12-01 it found main's streams no worse than the tree before issue 12 in any
miss (first-level 0.91-0.94, last-level with a 1 MiB LL 0.68-0.88, mispredicts 0.94),
so the CPU per stream main spends over that tree alone is not Python work nor its
memory as valgrind models it (see docs/design.md).
"""

from __future__ import annotations

import argparse
import collections
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


LOOP_THREAD = "-01"
"""How a dump of the event loop's thread (the first) ends (``--separate-threads=yes``)."""


def _events(prefix: str) -> dict[str, dict[str, int]]:
    """The ``summary`` of the dumps callgrind_control -d wrote, one per thread
    (``<prefix>.<pid>.<n>-<thread>``, ``--separate-threads=yes``), by event (``Ir``:
    instructions; with ``--cache-sim`` the cache and branch events too): ``all``, and
    ``loop`` for the first thread (the event loop's, where a request's Python runs)."""
    total: dict[str, dict[str, int]] = {"all": {}, "loop": {}}
    for path in glob.glob(prefix + ".*.[0-9]*"):
        text = Path(path).read_text(errors="replace")
        names = re.search(r"^events: (.+)$", text, re.M)
        values = re.search(r"^summary: (.+)$", text, re.M)
        if names and values:
            into = [total["all"]] + ([total["loop"]] if path.endswith(LOOP_THREAD) else [])
            for name, value in zip(names.group(1).split(), values.group(1).split(), strict=False):
                for t in into:
                    t[name] = t.get(name, 0) + int(value)
    return total


_NAME = re.compile(r"\((\d+)\)(?: (.*))?")


def _self_costs(path: str) -> collections.Counter[str]:
    """Each function's own instructions in one callgrind dump (not what it calls): cost
    lines count to the current ``fn=``, except the one after each ``calls=`` (a call's
    inclusive cost). Names are compressed (``(id) name`` once, ``(id)`` after) and a
    recursion suffix (``'2``) is folded into the function."""
    names: dict[str, str] = {}
    cost: collections.Counter[str] = collections.Counter()
    fn, after_call = "", False
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                key, rest = line.rstrip("\n").split("=", 1)
                m = _NAME.match(rest)
                name = rest
                if m:
                    if m.group(2):
                        names[m.group(1)] = m.group(2)
                    name = names.get(m.group(1), m.group(1))
                if key == "fn":
                    fn = re.sub(r"'\d+$", "", re.sub(r" \[.*\]$", "", name))
            elif line.startswith("calls="):
                after_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) >= 2:
                    if after_call:
                        after_call = False
                    else:
                        cost[fn] += int(parts[1])
    return cost


def _loop_dump(prefix: str) -> str | None:
    found = sorted(glob.glob(prefix + ".*.[0-9]*" + LOOP_THREAD))
    return found[-1] if found else None


def _moved(
    base: tuple[str, float], tree: tuple[str, float], top: int
) -> list[tuple[float, float, float, str]]:
    """The ``top`` functions whose own instructions a request (dump, requests) moved most."""
    a, b = _self_costs(base[0]), _self_costs(tree[0])
    rows = [(b[k] / tree[1] - a[k] / base[1], a[k] / base[1], b[k] / tree[1], k) for k in set(a) | set(b)]
    rows.sort(key=lambda r: -abs(r[0]))
    return rows[:top]


def _cycles(ev: dict[str, int]) -> float:
    """cachegrind's estimate of cycles: an instruction each, 10 for a first-level miss,
    100 for a last-level one, 10 for a mispredicted branch."""
    l1 = ev.get("I1mr", 0) + ev.get("D1mr", 0) + ev.get("D1mw", 0)
    ll = ev.get("ILmr", 0) + ev.get("DLmr", 0) + ev.get("DLmw", 0)
    return ev.get("Ir", 0) + 10 * l1 + 100 * ll + 10 * (ev.get("Bcm", 0) + ev.get("Bim", 0))


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
        sim = ["--cache-sim=yes", "--branch-sim=yes"] if args.cache_sim else []
        if args.cache_sim and args.ll:
            sim.append(f"--LL={args.ll},16,64")
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", *sim, f"--callgrind-out-file={prefix}.%p", sys.executable,
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
    threads = _events(prefix)
    ev = threads["all"]
    per = max(n, 1)
    result: dict[str, float] = {
        "requests": n,
        "errors": errors,
        "instructions": ev.get("Ir", 0),
        "per_request": ev.get("Ir", 0) / per,
        "loop_per_request": threads["loop"].get("Ir", 0) / per,
    }
    if args.cache_sim:
        result.update({f"{k}_per_request": v / per for k, v in ev.items()})
        result["cycles_per_request"] = _cycles(ev) / per
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_arguments(ap, conns=64, seconds=30.0, out=str(H.LOGS / "callgrind"))
    ap.add_argument(
        "--cache-sim", action="store_true",
        help="simulate the caches and branch predictor too: misses a request and an estimate of cycles",
    )  # fmt: skip
    ap.add_argument(
        "--ll", type=int, default=0,
        help="with --cache-sim: the last-level cache's size in bytes (16-way, 64-byte lines; default: this "
        "machine's), e.g. 1048576 for a share of a busy host's L3",
    )  # fmt: skip
    ap.add_argument(
        "--functions", type=int, default=0, metavar="N",
        help="print the N C functions whose own instructions a request on the event loop's thread moved "
        "most from the first tree's",
    )  # fmt: skip
    args = ap.parse_args()
    if args.ll and not args.cache_sim:
        ap.error("--ll sizes a simulated cache: give --cache-sim too")
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
                f"({res['errors']:.0f} errors), {res['per_request']:,.0f} instructions per request "
                f"(the event loop's thread {res['loop_per_request']:,.0f}, the others "
                f"{res['per_request'] - res['loop_per_request']:,.0f})",
                flush=True,
            )
            if args.cache_sim:
                print(
                    "  "
                    + ", ".join(
                        f"{k[: -len('_per_request')]} {v:,.0f}"
                        for k, v in res.items()
                        if k.endswith("_per_request") and k not in ("per_request", "loop_per_request")
                    )
                )
    base = results[0][1]
    for i, (src, res) in enumerate(results[1:], start=1):
        others = (res["per_request"] - res["loop_per_request"]) / max(
            base["per_request"] - base["loop_per_request"], 1
        )
        print(
            f"{src} over {results[0][0]}: instructions per request {res['per_request'] / base['per_request']:.3f} "
            f"(the event loop's thread {res['loop_per_request'] / max(base['loop_per_request'], 1):.3f}, "
            f"the others {others:.3f})"
        )
        if args.cache_sim:
            ratios = {k: res[k] / base[k] for k in res
                      if k.endswith("_per_request") and k != "loop_per_request" and base.get(k)}  # fmt: skip
            print("  " + ", ".join(f"{k[: -len('_per_request')]} {v:.3f}" for k, v in ratios.items()))
        if args.functions:
            _print_moved(out, i, base, res, args.functions)


def _print_moved(out: Path, i: int, base: dict[str, float], res: dict[str, float], top: int) -> None:
    """:func:`_moved` of tree ``i`` against the first, on the event loop's thread."""
    a, b = _loop_dump(str(out / "tree0")), _loop_dump(str(out / f"tree{i}"))
    if a is None or b is None:
        print("  (no loop-thread dump to compare)")
        return
    print(f"  own instructions a request on the event loop's thread, tree0 -> tree{i} (top {top} moved):")
    for delta, x, y, name in _moved((a, max(base["requests"], 1)), (b, max(res["requests"], 1)), top):
        print(f"    {delta:+9.0f} {x:9.0f} {y:9.0f}  {name[:100]}")


if __name__ == "__main__":
    main()
