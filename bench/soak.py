"""The soak: a mixed load on one ``bourse serve`` process for ``--minutes`` (default 15),
sampled every ``--every`` seconds (default 30) into a table.

The load is the fault suite's (``tests/faults/load.py``): streamed and non-streamed
answers, clients leaving mid-stream and while queued, every sim fault (failures
before and after output, stalls below and past ``stall_timeout_s``, missing usage),
book timeouts and jobs, over the default, openfill, aigrid and gopuram policies.
Each sample reads the gateway process (RSS and open file descriptors from
``/proc``), the SQLite WAL and database sizes, and the books straight from the
database: the money invariant (credits = balances + holds + revenue, to the
micro-USD) must be exact at every sample. After the load the books come to rest
and the last row checks the invariant at rest too (no hold open, every charge with
its usage record, the records adding up to the revenue).

The table (markdown) goes to stdout and to ``--out`` (default
``bench/soak_results.md``); the exit status is 1 when the invariant failed at any
sample or a client saw a 500. Run from the repository root::

    python -m bench.soak --minutes 15

To find what grows: ``--tracemalloc N`` runs the gateway under :mod:`tracemalloc`
(``N`` frames; ``bench/gateway_site/sitecustomize.py`` on its PYTHONPATH), takes a
snapshot at every sample and adds to the results the lines whose allocations grew
most from the first sample after warm-up to the one at rest. Tracing slows the
gateway several times and its own tables count in the RSS column: such a run finds
growers, it does not measure the RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

from tests.faults.ledger import Books, read_books
from tests.faults.load import Load, Tally, config
from tests.faults.served import ADMIN_KEY, Served
from tests.support.processes import serve_process

from bench.common import GATEWAY_SITE

MIB = 1024 * 1024
ACCOUNTS = 8
WARM_UP_SAMPLES = 2
"""Samples left out of the flatness summary (the first minute)."""
TOP_GROWERS = 15


@dataclass
class Sample:
    t_s: float
    requests: int
    rate: float
    rss: int
    fds: int
    wal: int
    db: int
    open_holds: int
    books: Books

    @property
    def gap(self) -> int:
        """credits - (balances + holds + revenue): 0 when the books balance."""
        b = self.books
        return b.credits - (b.balances + b.holds + b.revenue)


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class Tracing:
    """The gateway's tracemalloc snapshots (``--tracemalloc``): one asked for at each
    sample (SIGUSR1), written by ``bench/gateway_site/sitecustomize.py``."""

    def __init__(self, folder: Path, frames: int) -> None:
        self.folder = folder
        self.asked = 0
        folder.mkdir()
        os.environ["SOAK_TRACEMALLOC_DIR"] = str(folder)  # read by the gateway process only
        os.environ["SOAK_TRACEMALLOC_FRAMES"] = str(frames)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(GATEWAY_SITE), os.environ.get("PYTHONPATH")])
        )

    def ask(self, pid: int) -> None:
        os.kill(pid, signal.SIGUSR1)
        self.asked += 1

    def snapshot(self, k: int, timeout_s: float = 120.0) -> tracemalloc.Snapshot:
        path = self.folder / f"snap-{k}.pickle"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no tracemalloc snapshot {path}")
            time.sleep(0.2)
        return tracemalloc.Snapshot.load(str(path)).filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "*/sitecustomize.py")]
        )

    def report(self, first: int, last: int) -> str:
        """The lines whose live allocations grew most from snapshot ``first`` to ``last``."""
        old, new = self.snapshot(first), self.snapshot(last)
        total = [sum(s.size for s in snap.statistics("filename")) / MIB for snap in (old, new)]
        lines = [
            f"## Python allocations (tracemalloc), sample {first + 1} to the last",
            "",
            f"Traced: {total[0]:.2f} MiB to {total[1]:.2f} MiB. Top growers by line:",
            "",
            "| grew (KiB) | blocks | now (KiB) | where |",
            "|---:|---:|---:|---|",
        ]
        grown = sorted(
            (s for s in new.compare_to(old, "lineno") if s.size_diff > 0), key=lambda s: -s.size_diff
        )
        for st in grown[:TOP_GROWERS]:
            where = st.traceback[0]
            name = where.filename.split("/site-packages/")[-1].split("/src/")[-1]
            lines.append(
                f"| {st.size_diff / 1024:+.1f} | {st.count_diff:+d} | {st.size / 1024:.1f} | {name}:{where.lineno} |"
            )
        return "\n".join(lines)


class Soak:
    def __init__(self, gw: Served, pid: int, tally: Tally, tracing: Tracing | None = None) -> None:
        self.gw = gw
        self.pid = pid
        self.tally = tally
        self.tracing = tracing
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self._last = (self.t0, 0)

    def sample(self) -> Sample:
        now, done = time.monotonic(), self.tally.requests
        last_t, last_n = self._last
        self._last = (now, done)
        db = self.gw.data_dir / "bourse.db"
        books = read_books(self.gw.data_dir, self.gw.dsn)
        s = Sample(
            t_s=now - self.t0,
            requests=done,
            rate=(done - last_n) / max(now - last_t, 1e-9),
            rss=_rss(self.pid),
            fds=len(os.listdir(f"/proc/{self.pid}/fd")),
            wal=_size(Path(str(db) + "-wal")),
            db=_size(db),
            open_holds=len(books.ids("open")),
            books=books,
        )
        self.samples.append(s)
        if self.tracing is not None:
            self.tracing.ask(self.pid)  # snapshot k is taken just after sample k
        print(row(s), flush=True)
        return s

    async def every(self, period_s: float, stop: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), period_s)
                return
            except TimeoutError:
                await asyncio.to_thread(self.sample)


HEADER = (
    "| t (s) | requests | req/s | RSS (MiB) | fds | WAL (MiB) | DB (MiB) | holds open | invariant |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def row(s: Sample, note: str = "") -> str:
    inv = "exact" if s.gap == 0 else f"OFF by {s.gap} µUSD"
    return (
        f"| {s.t_s:.0f}{note} | {s.requests} | {s.rate:.1f} | {s.rss / MIB:.1f} | {s.fds} | "
        f"{s.wal / MIB:.2f} | {s.db / MIB:.2f} | {s.open_holds} | {inv} |"
    )


def summary(samples: list[Sample], tally: Tally, at_rest: Books, minutes: float) -> str:
    warm = samples[WARM_UP_SAMPLES:-1] or samples

    def spread(name: str, values: list[float], unit: str) -> str:
        return f"{name} {min(values):.1f} to {max(values):.1f} {unit}"

    lines = [
        f"{tally.requests} requests in {minutes:g} min; outcomes: "
        + ", ".join(f"{k} {n}" for k, n in sorted(tally.seen.items())),
        f"{len(tally.jobs)} jobs submitted; {len(tally.forbidden)} forbidden answers (500, trace, "
        f"internal_error); {tally.transport_errors} transport errors.",
        "After warm-up (from sample "
        + str(WARM_UP_SAMPLES + 1)
        + "): "
        + "; ".join(
            [
                spread("RSS", [s.rss / MIB for s in warm], "MiB"),
                spread("fds", [float(s.fds) for s in warm], ""),
                spread("WAL", [s.wal / MIB for s in warm], "MiB"),
            ]
        )
        + ".",
        "At rest: "
        + (
            "invariant exact"
            if at_rest.credits == at_rest.balances + at_rest.holds + at_rest.revenue
            else "OFF"
        )
        + f", {len(at_rest.ids('open'))} holds open, {len(at_rest.ids('reconciling'))} reconciling, "
        f"{len(at_rest.unrecorded)} charges without their usage record, "
        f"{len(at_rest.charged_twice)} requests charged twice, usage records "
        + (
            "= revenue"
            if at_rest.usage_cost == at_rest.revenue
            else f"{at_rest.usage_cost} != {at_rest.revenue}"
        )
        + ".",
    ]
    return "\n\n".join(lines)


async def _soak(
    gw: Served, pid: int, keys: list[str], args: argparse.Namespace, tracing: Tracing | None
) -> Soak:
    load = Load(gw.url, keys, seed=args.seed)
    soak = Soak(gw, pid, load.tally, tracing)
    stop = asyncio.Event()
    sampler = asyncio.create_task(soak.every(args.every, stop))
    seconds = args.minutes * 60
    await load.run(requests=10**9, concurrency=args.concurrency, seconds=seconds)
    stop.set()
    await sampler
    return soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--concurrency", type=int, default=50, help="clients at once (default 50)")
    p.add_argument("--database", default=None, help="postgresql://… (default: SQLite in a temporary folder)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("soak_results.md"))
    p.add_argument(
        "--tracemalloc", type=int, default=0, metavar="FRAMES",
        help="trace the gateway's Python allocations (FRAMES deep) and report the top growers",
    )  # fmt: skip
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bourse-soak-") as tmp:
        data_dir = Path(tmp) / "data"
        tracing = Tracing(Path(tmp) / "tracemalloc", args.tracemalloc) if args.tracemalloc else None
        with serve_process(Path(tmp), "soak", config(), data_dir, ADMIN_KEY, args.database, 60.0) as (
            url,
            proc,
        ):
            gw = Served(url, data_dir, args.database)
            keys = gw.accounts("soak", ACCOUNTS, 1000.0)
            print(HEADER, flush=True)
            soak = asyncio.run(_soak(gw, proc.pid, keys, args, tracing))
            try:
                at_rest = gw.at_rest(60.0)
            except AssertionError as exc:  # still written into the table: the last row shows it
                print(f"not at rest: {exc}", file=sys.stderr)
                at_rest = gw.books()
            last = soak.sample()
            growers = [] if tracing is None else [tracing.report(WARM_UP_SAMPLES, tracing.asked - 1), ""]
        text = "\n".join(
            [
                f"# Soak: {args.minutes:g} min, {args.concurrency} clients, "
                + ("PostgreSQL" if args.database else "SQLite"),
                "",
                f"`python -m bench.soak --minutes {args.minutes:g} --every {args.every:g} "
                f"--concurrency {args.concurrency}"
                + (f" --tracemalloc {args.tracemalloc}" if tracing else "")
                + f"`, {time.strftime('%Y-%m-%d %H:%M')}, "
                f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end.",
                "",
                HEADER,
                *(row(s, " (at rest)" if s is last else "") for s in soak.samples),
                "",
                summary(soak.samples, soak.tally, at_rest, args.minutes),
                "",
                *growers,
            ]
        )
    args.out.write_text(text)
    print("\n" + summary(soak.samples, soak.tally, at_rest, args.minutes))
    print(f"\nwritten to {args.out}")
    failed = (
        any(s.gap for s in soak.samples)
        or soak.tally.forbidden
        or at_rest.ids("open")
        or at_rest.charged_twice
        or at_rest.unrecorded
        or at_rest.usage_cost != at_rest.revenue
    )
    for line in soak.tally.forbidden[:5]:
        print("forbidden:", line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
