"""SSE load client: raw HTTP/1.1 over asyncio streams (uvloop when installed).

Two modes, both bounded in time and count, both print one JSON object as the last
line of stdout:

``run`` (default): ``--concurrency`` workers, each on one keep-alive connection,
issue streamed chat completions back to back for ``--duration`` seconds (or until
``--max-streams``). Per stream it records the time to first byte (status line),
the time to the first ``data:`` event, and the gap between consecutive ``data:``
events as the client sees them arrive.

    .venv/bin/python -m bench.sse_load --url http://127.0.0.1:8080/v1/chat/completions \\
        --header 'authorization: Bearer bk_…' --model bench --concurrency 32 --duration 10

``hold``: open ``--streams`` connections (at most ``--open-concurrency`` waiting for
their first chunk at once), keep them all reading, hold ``--hold-s`` seconds once all
are open (or ``--ramp-timeout`` passed), sample ``/proc/<--pid>/status`` (VmRSS,
VmHWM) meanwhile, then close everything.

    .venv/bin/python -m bench.sse_load --mode hold --streams 10000 --pid 1234 --url …
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

perf = time.perf_counter


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Target:
    host: str
    port: int
    request: bytes

    @classmethod
    def build(cls, url: str, headers: list[str], body: bytes) -> Target:
        u = urlsplit(url)
        host = u.hostname or "127.0.0.1"
        port = u.port or 80
        path = u.path + (f"?{u.query}" if u.query else "")
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}:{port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(body)}",
            *headers,
        ]
        return cls(host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)


class StreamError(Exception):
    pass


@dataclass
class Stream:
    """What one streamed answer looked like from the client."""

    t0: float = 0.0
    ttfb: float = 0.0
    ttft: float = -1.0
    total: float = 0.0
    events: int = 0
    done: bool = False
    status: int = 0
    gaps: list[float] = field(default_factory=list)
    keep_alive: bool = True


async def read_stream(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    target: Target,
    on_first: asyncio.Event | None = None,
) -> Stream:
    s = Stream(t0=perf())
    writer.write(target.request)
    status_line = await reader.readline()
    if not status_line:
        raise StreamError("connection closed before the status line")
    s.ttfb = perf() - s.t0
    parts = status_line.split(b" ", 2)
    s.status = int(parts[1])
    chunked = False
    length = -1
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif name == b"content-length":
            length = int(value)
        elif name == b"connection" and b"close" in value.lower():
            s.keep_alive = False
    buf = b""
    last = 0.0

    def feed(data: bytes) -> None:
        nonlocal buf, last
        now = perf()
        buf += data
        while True:
            i = buf.find(b"\n\n")
            if i < 0:
                break
            event, buf = buf[:i], buf[i + 2 :]
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    if line[5:].strip() == b"[DONE]":
                        s.done = True
                    else:
                        s.events += 1
                        if s.ttft < 0:
                            s.ttft = now - s.t0
                            if on_first is not None:
                                on_first.set()
                        else:
                            s.gaps.append(now - last)
                        last = now
                    break

    if chunked:
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise StreamError("connection closed inside a chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                break
            data = await reader.readexactly(size + 2)
            feed(data[:-2])
    elif length >= 0:
        feed(await reader.readexactly(length))
    else:
        s.keep_alive = False
        while chunk := await reader.read(65536):
            feed(chunk)
    s.total = perf() - s.t0
    return s


async def connect(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(target.host, target.port, limit=1 << 20)


async def mode_run(target: Target, concurrency: int, duration: float, max_streams: int) -> dict[str, object]:
    streams: list[Stream] = []
    errors: dict[str, int] = {}
    started = 0
    deadline = perf() + duration

    async def worker() -> None:
        nonlocal started
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while perf() < deadline and started < max_streams:
            started += 1
            try:
                if conn is None:
                    conn = await connect(target)
                s = await asyncio.wait_for(
                    read_stream(*conn, target), timeout=max(1.0, deadline - perf() + 30)
                )
                streams.append(s)
                if not s.keep_alive:
                    conn[1].close()
                    conn = None
            except (TimeoutError, OSError, StreamError, asyncio.IncompleteReadError, ValueError) as exc:
                key = type(exc).__name__ + (f": {exc}" if str(exc) else "")
                errors[key[:120]] = errors.get(key[:120], 0) + 1
                if conn is not None:
                    conn[1].close()
                conn = None
                await asyncio.sleep(0.01)
        if conn is not None:
            conn[1].close()

    t0 = perf()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = perf() - t0
    ok = [s for s in streams if s.status == 200 and s.done and s.ttft >= 0]
    bad_status: dict[str, int] = {}
    for s in streams:
        if s.status != 200:
            bad_status[str(s.status)] = bad_status.get(str(s.status), 0) + 1
        elif not s.done:
            bad_status["200 without [DONE]"] = bad_status.get("200 without [DONE]", 0) + 1
    gaps = [g * 1000 for s in ok for g in s.gaps]
    ttfb = [s.ttfb * 1000 for s in ok]
    ttft = [s.ttft * 1000 for s in ok]
    total = [s.total * 1000 for s in ok]
    return {
        "mode": "run",
        "concurrency": concurrency,
        "elapsed_s": elapsed,
        "streams_ok": len(ok),
        "streams_per_s": len(ok) / elapsed if elapsed else 0.0,
        "errors": {**errors, **bad_status},
        "events_per_stream": statistics.median([s.events for s in ok]) if ok else 0,
        "ttfb_p50_ms": pct(ttfb, 50),
        "ttfb_p99_ms": pct(ttfb, 99),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "total_p50_ms": pct(total, 50),
        "gap_p50_ms": pct(gaps, 50),
        "gap_p99_ms": pct(gaps, 99),
        "gap_max_ms": max(gaps) if gaps else float("nan"),
    }


def read_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])  # kB
    except OSError:
        pass
    return out


async def mode_hold(
    target: Target,
    n: int,
    open_concurrency: int,
    ramp_timeout: float,
    hold_s: float,
    pid: int | None,
) -> dict[str, object]:
    sem = asyncio.Semaphore(open_concurrency)
    open_now = 0
    max_open = 0
    first_chunk = 0
    finished = 0
    errors: dict[str, int] = {}
    writers: list[asyncio.StreamWriter] = []
    all_settled = asyncio.Event()
    settled = 0

    def settle() -> None:
        nonlocal settled
        settled += 1
        if settled >= n:
            all_settled.set()

    async def one() -> None:
        nonlocal open_now, max_open, first_chunk, finished
        first = asyncio.Event()
        got_first = False
        await sem.acquire()
        released = False
        try:
            reader, writer = await asyncio.wait_for(connect(target), 30)
            writers.append(writer)
            task = asyncio.ensure_future(read_stream(reader, writer, target, on_first=first))
            waiter = asyncio.ensure_future(first.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if first.is_set():
                got_first = True
                first_chunk += 1
                open_now += 1
                max_open = max(max_open, open_now)
                settle()
                sem.release()
                released = True
            waiter.cancel()
            s = await task
            if not got_first:
                raise StreamError(f"HTTP {s.status} without a data chunk")
            finished += 1
        except asyncio.CancelledError:
            raise
        except (TimeoutError, OSError, StreamError, asyncio.IncompleteReadError, ValueError) as exc:
            key = (type(exc).__name__ + (f": {exc}" if str(exc) else ""))[:120]
            errors[key] = errors.get(key, 0) + 1
            if not got_first:
                settle()
        finally:
            if got_first:
                open_now -= 1
            if not released:
                sem.release()

    samples: list[dict[str, int]] = []
    stop_sampling = False

    async def sampler() -> None:
        while not stop_sampling and pid is not None:
            samples.append(read_status(pid))
            await asyncio.sleep(0.25)

    before = read_status(pid) if pid else {}
    sampling = asyncio.ensure_future(sampler())
    t0 = perf()
    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(all_settled.wait(), ramp_timeout)
    ramp = perf() - t0
    open_at_ramp = open_now
    await asyncio.sleep(hold_s)
    open_after_hold = open_now
    end = read_status(pid) if pid else {}
    stop_sampling = True
    for w in writers:
        w.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await sampling
    rss = [s.get("VmRSS", 0) for s in samples]
    return {
        "mode": "hold",
        "streams": n,
        "first_chunk": first_chunk,
        "finished_early": finished,
        "open_at_ramp_end": open_at_ramp,
        "open_after_hold": open_after_hold,
        "max_open": max_open,
        "ramp_s": ramp,
        "hold_s": hold_s,
        "errors": errors,
        "rss_before_kb": before.get("VmRSS", 0),
        "rss_max_sampled_kb": max(rss) if rss else 0,
        "vmhwm_kb": end.get("VmHWM", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="full URL of the chat completions endpoint")
    ap.add_argument("--header", action="append", default=[], help="'Name: value', repeatable")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--body", help="request body (JSON); default: a streamed chat completion of --model")
    ap.add_argument("--mode", choices=("run", "hold"), default="run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--max-streams", type=int, default=1_000_000)
    ap.add_argument("--streams", type=int, default=10_000)
    ap.add_argument("--open-concurrency", type=int, default=256)
    ap.add_argument("--ramp-timeout", type=float, default=60.0)
    ap.add_argument("--hold-s", type=float, default=5.0)
    ap.add_argument("--pid", type=int)
    args = ap.parse_args()
    body = (
        args.body
        if args.body
        else json.dumps(
            {
                "model": args.model,
                "messages": [{"role": "user", "content": "benchmark"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    ).encode()
    target = Target.build(args.url, args.header, body)
    raise_nofile()
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    if args.mode == "run":
        result = asyncio.run(mode_run(target, args.concurrency, args.duration, args.max_streams))
    else:
        result = asyncio.run(
            mode_hold(target, args.streams, args.open_concurrency, args.ramp_timeout, args.hold_s, args.pid)
        )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
