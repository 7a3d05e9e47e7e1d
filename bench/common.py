"""Shared helpers for the benchmarks: free ports, processes, waiting for health."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

ADMIN_KEY = "bk_admin_bench"


GATEWAY_SITE = Path(__file__).with_name("gateway_site")
"""The benchmarks' hooks inside a gateway process (put on its PYTHONPATH; see its
``sitecustomize.py``): soak's tracemalloc, bench.calls' cProfile."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout_s: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with status {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become healthy")


def pinned(args: list[str], cpu: int | None) -> list[str]:
    """``args`` prefixed with ``taskset -c cpu`` when the machine has two cores or more."""
    if cpu is not None and (os.cpu_count() or 1) >= 2 and _has("taskset"):
        return ["taskset", "-c", str(cpu), *args]
    return args


@contextlib.contextmanager
def process(
    args: list[str],
    health: str,
    env: dict[str, str] | None = None,
    cpu: int | None = None,
    log: Path | None = None,
    health_timeout_s: float = 20.0,
    cwd: str | Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A process (taskset exec's it, so ``proc.pid`` is the process itself), healthy
    before it is yielded; SIGINT then SIGKILL on exit. Its output goes to ``log``
    (default: discarded; a pipe nobody reads would stall a process that logs)."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        pinned(args, cpu), env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, cwd=cwd
    )
    try:
        try:
            wait_healthy(health, health_timeout_s, proc)
        except RuntimeError as exc:
            tail = ""
            if log is not None:
                tail = "; last output: " + log.read_text(errors="replace")[-600:].strip()
            raise RuntimeError(f"{exc}{tail}") from None
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        if log is not None:
            out.close()  # type: ignore[union-attr]


def _has(cmd: str) -> bool:
    return any((Path(p) / cmd).exists() for p in os.environ.get("PATH", "").split(":"))


@contextlib.contextmanager
def sim_upstream(cpu: int | None = None) -> Iterator[str]:
    port = free_port()
    with process(
        [sys.executable, "-m", "bourse", "sim-upstream", "--port", str(port)],
        f"http://127.0.0.1:{port}/healthz",
        cpu=cpu,
    ):
        yield f"http://127.0.0.1:{port}/v1"


@contextlib.contextmanager
def gateway(config: str, cpu: int | None = None, database: str | None = None) -> Iterator[tuple[str, str]]:
    """A ``bourse serve`` process with ``config``; yields (base URL, a funded API key)."""
    with gateway_process(config, cpu=cpu, database=database) as (base, key, _proc):
        yield base, key


@contextlib.contextmanager
def gateway_process(
    config: str,
    cpu: int | None = None,
    database: str | None = None,
    log: Path | None = None,
    extra_args: Sequence[str] = (),
    data_dir: Path | None = None,
) -> Iterator[tuple[str, str, subprocess.Popen[bytes]]]:
    """Like :func:`gateway`, also yielding the process (for its pid). ``data_dir``: the
    gateway's data folder (its SQLite file, for a tool that reads it), else a temporary one.

    ``BOURSE_BENCH_SRC`` (a checkout's ``src`` folder) serves bourse from that tree
    instead of the installed one: the same harness measures two commits, e.g. a
    change and its parent (``git worktree add /tmp/base BASE`` then
    ``BOURSE_BENCH_SRC=/tmp/base/src bash bench/run.sh --only a,b,d --out base.md``)."""
    port = free_port()
    env = {"BOURSE_ADMIN_KEY": ADMIN_KEY, "BOURSE_DRAIN_GRACE_S": "0"}  # stopped at once between runs
    src = os.environ.get("BOURSE_BENCH_SRC")
    if src:
        # the tree first; the bench's gateway hooks (bench/gateway_site) stay if set
        hooks = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p == str(GATEWAY_SITE)]
        env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()), *hooks])
    with tempfile.TemporaryDirectory(prefix="bourse-bench-") as tmp:
        d = str(data_dir or tmp)
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(config)
        args = [
            sys.executable,
            "-m",
            "bourse",
            "serve",
            "--config",
            str(cfg),
            "--port",
            str(port),
            "--data-dir",
            d,
        ]
        if database:
            args += ["--database", database]
        args += extra_args
        with process(args, f"http://127.0.0.1:{port}/healthz", env=env, cpu=cpu, log=log) as proc:
            base = f"http://127.0.0.1:{port}"
            yield base + "/v1", funded_key(base), proc


def funded_key(base: str, timeout_s: float = 30.0) -> str:
    """A gateway's account ``bench`` (credited $1M, through the admin API) and a new API
    key for it."""
    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    httpx.post(
        base + "/admin/accounts", json={"id": "bench", "credit_usd": 1e6}, headers=h, timeout=timeout_s
    ).raise_for_status()
    key: str = httpx.post(
        base + "/admin/keys", json={"account": "bench"}, headers=h, timeout=timeout_s
    ).json()["key"]
    return key


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def tree_arguments(ap: argparse.ArgumentParser, *, conns: int, seconds: float, out: str) -> None:
    """The arguments of a tool that measures one gateway per source tree, in turn (the
    trees, the load's connections and seconds, the product's upstream, wrk or streams,
    the output folder and each tree's observing); :func:`observe_per_tree` reads ``--observe``."""
    ap.add_argument("srcs", nargs="+", help="each tree's src folder (the first is the base)")
    ap.add_argument("--conns", type=int, default=conns)
    ap.add_argument("--seconds", type=float, default=seconds)
    ap.add_argument("--upstream", default="fast", choices=("fast", "delay"), help="the product's upstream")
    ap.add_argument(
        "--sse", action="store_true", help="streamed requests (bench/sse_load.py, 16 chunks each), not wrk"
    )
    ap.add_argument("--out", default=out, help="where the dumps and logs go")
    ap.add_argument(
        "--observe",
        default="",
        help="metrics and access log of each tree in order, on or off (default: all on)",
    )


def observe_per_tree(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[bool]:
    """``--observe on,off,...`` (see :func:`tree_arguments`): metrics and the access log
    on or off for each tree in order (empty: all on); a usage error otherwise."""
    spec, trees = args.observe, len(args.srcs)
    words = [w.strip() for w in spec.split(",")] if spec else ["on"] * trees
    if len(words) != trees or not set(words) <= {"on", "off"}:
        ap.error(f"--observe takes one of on/off per tree ({trees}), not {spec!r}")
    return [w == "on" for w in words]


def report(
    res: dict[str, object], lines: list[str], heading: str, out: str | None, json_path: str | None
) -> None:
    """A scenario's end: its raw results to ``json_path``, its section (``lines``, under
    ``heading``) into the RESULTS.md ``out`` (the rest of the file kept), and printed."""
    import json

    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1))
    if out:
        from bench.market import write_section

        write_section(Path(out), lines, heading)
    print("\n".join(lines))


CLOCK = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the children of each of its threads)."""
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out += process_tree(int(k))
    return out


def cpu_s(pid: int | None) -> float:
    """User + system seconds of the process and its descendants (every thread); 0
    without a pid or a live process."""
    if pid is None:
        return 0.0
    try:
        tree = process_tree(pid)
    except OSError:
        return 0.0
    total = 0
    for p in tree:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK
