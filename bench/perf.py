"""Where two trees' CPU goes, by thread, library and C symbol: ``perf record`` on both at once.

    .venv/bin/python -m bench.perf BASE_SRC CHANGED_SRC --sse --conns 32 [--rounds 3] [--seconds 6]
    .venv/bin/python -m bench.perf BASE_SRC CHANGED_SRC --conns 1 --top 30

Starts both trees' gateways as ``bench.ab`` does (nginx, the harness's config, both on
the gateway core) and loads them at the same time (``bench.ab --together``: whatever
disturbs the machine falls on both in the same seconds; ``--alone``: one after the
other, as bench.ab's alternate rounds) while ``perf record -e cpu-clock -C
GATEWAY_CORE`` samples that core (a software clock: this machine has no
hardware counters). It prints the µs a request (a stream, with ``--sse``) that each
gateway spent on its event loop's thread (``loop``) and its other threads (``other``:
the database's), split by library (``libpython``, the kernel, SQLite, uvloop, ...), and
the C symbols whose µs a request moved most, with B over A.

Unlike ``bench.calls`` (Python calls counted, not timed) and ``bench.callgrind``
(instructions, in a process alone under valgrind), this is time on the real machine,
caches and the other gateway included, so it says whether a change's extra CPU is the
interpreter's, the kernel's or a library's, and on which thread. A sample is 1/``--rate``
s of the core; about 1 % of a tree's samples a request is the round-to-round spread.
Needs Debian's ``linux-perf`` and the right to record a CPU (root, or
``perf_event_paranoid`` at 0 or below).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import signal
import subprocess
import tempfile
from pathlib import Path

from bench import ab
from bench import harness as H
from bench.common import pinned

_LINE = re.compile(r"\s*(\d+)/(\d+)\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")

Key = tuple[str, str, str]
"""A sample's thread (``loop`` or ``other``), library and symbol."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ab.pair_arguments(ap, rounds=3)
    ap.add_argument("--rate", type=int, default=2000, help="samples a second (perf record -F)")
    ap.add_argument("--top", type=int, default=30, help="symbols listed")
    ap.add_argument(
        "--alone", action="store_true", help="load A and B one after the other (bench.ab's alternate rounds)"
    )
    args = ap.parse_args()
    args.together, args.threads, args.preload = not args.alone, False, 0.0
    observe = [w.strip() for w in args.observe.split(",")]
    H.raise_nofile()
    H.LOGS.mkdir(parents=True, exist_ok=True)
    stack = H.Stack()
    served = {"A": 0.0, "B": 0.0}
    samples: dict[str, collections.Counter[Key]] = {"A": collections.Counter(), "B": collections.Counter()}
    with contextlib.ExitStack() as es, tempfile.TemporaryDirectory() as tmp:
        es.enter_context(H.nginx(stack))
        gws = ab._gateways(es, stack, args, observe)
        ab._round(gws, args, 0)  # a round to warm both up, not recorded
        pids = {gw.pid: n for n, gw in gws.items()}
        for i in range(args.rounds):
            data = Path(tmp) / f"perf.{i}"
            # the whole round, wrk's and the SSE client's warm-up second included, on both alike
            rec = subprocess.Popen(
                pinned(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(args.rate), "-C", str(H.GATEWAY_CPU),
                        "-o", str(data)], H.LOAD_CPU),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                done = ab._round(gws, args, i)
            finally:
                rec.send_signal(signal.SIGINT)
                rec.wait(timeout=60)
            for n, r in done:
                served[n] += float(r.get("requests", 0))
            print("round " + str(i) + ": " + ", ".join(f"{n} {r['rps']:.0f}/s" for n, r in done), flush=True)
            _read(data, pids, samples)
    _report(samples, served, args)


def _read(data: Path, pids: dict[int | None, str], into: dict[str, collections.Counter[Key]]) -> None:
    """Each sample of the gateways' processes in ``data``, by thread, library and symbol."""
    script = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "pid,tid,ip,sym,dso"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    for line in script.stdout.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid, tid = int(m[1]), int(m[2])
        name = pids.get(pid)
        if name is not None:
            into[name][("loop" if tid == pid else "other", m[4].rsplit("/", 1)[-1], m[3])] += 1


def _report(
    samples: dict[str, collections.Counter[Key]], served: dict[str, float], args: argparse.Namespace
) -> None:
    unit = "stream" if args.sse else "request"
    us = {n: 1e6 / args.rate / served[n] if served[n] else 0.0 for n in served}

    def table(key: int) -> dict[str, collections.Counter[tuple[str, ...]]]:
        out: dict[str, collections.Counter[tuple[str, ...]]] = {}
        for n, c in samples.items():
            out[n] = collections.Counter()
            for k, v in c.items():
                out[n][k[: key + 1]] += v
        return out

    print(f"\nµs a {unit} on the gateway core (A {args.a_src}: {served['A']:.0f} {unit}s; "
          f"B {args.b_src}: {served['B']:.0f}):")  # fmt: skip
    for title, t, top in (("by thread", table(0), 10), ("by thread and library", table(1), 16),
                          ("symbols that moved most", table(2), args.top)):  # fmt: skip
        print(f"  {title} (A, B, B-A, B/A):")
        keys = set(t["A"]) | set(t["B"])
        if title == "by thread":
            rows = sorted(keys)
            rows.append(("all",))
            t["A"][("all",)] = sum(samples["A"].values())
            t["B"][("all",)] = sum(samples["B"].values())
        else:
            rows = sorted(keys, key=lambda k: -abs(t["B"][k] * us["B"] - t["A"][k] * us["A"]))[:top]
        for k in rows:
            a, b = t["A"][k] * us["A"], t["B"][k] * us["B"]
            ratio = f"{b / a:6.3f}" if a else "     -"
            print(f"    {a:8.1f} {b:8.1f} {b - a:+8.1f} {ratio}  {' '.join(k)}")


if __name__ == "__main__":
    main()
