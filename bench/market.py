"""The market under overload (issue 16): Poisson arrivals at 5x and 19x the capacity,
ten bid levels, half streamed, with book timeouts and cancels, on the in-process
book (one gateway) and on the Redis book (two replicas), 20 s each, and on Redis
with one replica stopped (SIGSTOP) for 4.5 s in a 60 s run; then bursty arrivals
with short and long runs mixed at 5x on both books (issue 38,
``bench/market_arrivals.py``), and bursty arrivals at 0.8x for 200 s on the in-process
book (a book with lulls, where deadline orders can wait out a burst: issue 38, item 3);
writes its section of bench/RESULTS.md (the rest of the file is kept). About 10
minutes in all.

    .venv/bin/python -m bench.market [--quick] [--seconds 20] [--runs 1,5] [--seeds 1] [--out bench/RESULTS.md]

Also run by ``bash bench/run.sh`` (scenario h of bench/harness.py).

Setup: one upstream process (bourse's sim app, wrapped to record when each
generation starts and ends, by the order number in its prompt), ``bourse serve`` gateways whose one
product has 4 slots on that upstream (floor 0.1), an asyncio client in this
process. A request asks for 20-60 tokens at 20 tokens/s (2 s on average), so the
capacity is 2 requests/s. Each order bids one of ten levels (0.1 ... 1.0), has a
book timeout of 3-10 s, and one in ten gives up (disconnects) after 0.5-4 s if it
has not started (an unary one may be running: then it is cut). Replicas take
requests alternately; each has its own SQLite ledger
(the book is what is measured). Everything runs on one 2-core machine, shared. One
order in five is a deadline order (``deadline_s``, its planned bid the ceiling) and one
next to it its control (a fixed bid at that ceiling, the deadline its timeout), both streamed
and never cancelled (``bench/market_deadline.py``); half an order a second asks a
quote first (``bench/market_forecast.py``).

What is measured (every time on the one wall clock of this machine):

- an order is *in the book* from its arrival to its leaving, each known within an
  interval (``_arrival``, ``_leaving``: the ``: queued bid=`` frame, the engine start
  upstream, ``x_market.queued_ms``, the wait a 408 states, the client's own times);
  it is *eligible* while certainly in the book unless its replica is stopped (from
  the SIGSTOP to 0.2 s after the SIGCONT);
- **inversions**: admissions (engine starts) while an eligible order with a higher
  bid certainly waited (a deadline order at the bid it had then: at least the last it
  was seen to bid before, ``market_deadline.lo``; an admitted one at its receipt's) (over ``TOL_S`` on each side of the start: the client's and
  the upstream's view of an instant differ by that much under load); **FIFO
  violations**: while an eligible order of the same bid waited that certainly
  arrived first (its arrival interval, below, wholly before the other's);
- **utilisation while an eligible order waits**: engine-seconds running upstream
  over slot-seconds, over the time at least one eligible order waited (a slot
  cleared but whose engine has not started counts as idle);
- **cleared ≤ bid** and **second-price violations**: the cleared price of each
  admission (``x_market``) against its bid, and against the rule min(bid,
  max(floor, best other bid in the book)) reconstructed at its start (a price that
  is the floor, the bid, or a bid in the book within ``TOL_S`` is consistent);
- **position**: each ``: queued … position=p`` frame against the bounds
  reconstructed from the orders ahead (certainly in the book over all of, or
  possibly at some instant of, the ``POS_TOL_S`` before the client read the frame:
  the gateway wrote it within that), and Spearman's rho of ``p`` against the wait
  left;
- **wait estimate**: each frame's ``wait_s`` against the wait that followed, for
  orders that started: median absolute error, share within a factor of 2, rho;
- **slot freed → engine start**: for each generation that ended while an eligible
  order waited, the time to the next engine start;
- **408 lateness**: a timed-out order's answer against its deadline (arrival + book
  timeout; for a stopped replica's order whose deadline fell in the stop, against
  the SIGCONT: it cannot answer before).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench import market_arrivals, market_deadline, market_forecast
from bench.common import free_port, gateway_process, pct, process

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 4
FLOOR = 0.1
TOKENS_PER_S = 20.0
TOKENS = (20, 60)
CAPACITY_PER_S = SLOTS / ((TOKENS[0] + TOKENS[1]) / 2 / TOKENS_PER_S)
BIDS = [round(0.1 * i, 1) for i in range(1, 11)]
TIMEOUT_S = (3.0, 10.0)
CANCEL_SHARE = 0.1
CANCEL_AFTER_S = (0.5, 4.0)
TOL_S = 0.1
POS_TOL_S = 0.5
"""A ``: queued`` frame was computed at most this long before the client read it."""
REVIVE_S = 0.2
PAUSE_S = 4.5
LEASE_S = 2.0
HEADING = "## (h) the market under overload (bench/market.py)"
SEED_STEP = 1000
"""With several seeds (``--seeds``), a scenario's k-th plan is seeded this much times k
after its first."""


def log(msg: str) -> None:
    print(f"[market {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- upstream


ORDER_NO = re.compile(rb"order (\d+)")


def upstream_app() -> Any:
    """bourse's sim upstream, recording (order number, start, end) of each generation
    (the number is read from the prompt: a client gone before its answer's head never
    learns the request id)."""
    from bourse.engines.sim import SimSettings
    from bourse.engines.sim_server import create_sim_app

    inner = create_sim_app(SimSettings())
    records: list[tuple[int, float, float]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path == "/bench/log":
            body = json.dumps(records).encode()
            if scope["method"] == "POST":
                records.clear()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "http" or path != "/v1/chat/completions":
            await inner(scope, receive, send)
            return
        t0 = time.time()
        got = bytearray()

        async def tee() -> Any:
            msg = await receive()
            got.extend(msg.get("body", b""))
            return msg

        try:
            await inner(scope, tee, send)
        finally:
            m = ORDER_NO.search(bytes(got))
            records.append((int(m.group(1)) if m else -1, t0, time.time()))

    return app


def serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(upstream_app(), host="127.0.0.1", port=port, log_level="warning")


@contextlib.contextmanager
def upstream() -> Iterator[str]:
    port = free_port()
    with process(
        [sys.executable, "-m", "bench.market", "--upstream-port", str(port)],
        f"http://127.0.0.1:{port}/healthz",
        cwd=ROOT,
    ):
        yield f"http://127.0.0.1:{port}"


# --------------------------------------------------------------------------- scenario


@dataclass(frozen=True)
class Scenario:
    name: str
    redis: bool
    load: float
    """Arrivals per second, as a multiple of the capacity."""
    pause: bool = False
    bursty: bool = False
    """On/off modulated arrivals of the same mean rate (``bench/market_arrivals.py``)."""
    mixed: bool = False
    """Short and long runs mixed (``bench/market_arrivals.py``)."""
    longer: float = 1.0
    """Its arrivals last this many times the other runs' (the stop's run: as long as the
    issue's experiment, 60 s by default)."""


SCENARIOS = [
    Scenario("in-process book, 5x", False, 5.0),
    Scenario("in-process book, 19x", False, 19.0),
    Scenario("Redis book, 2 replicas, 5x", True, 5.0),
    Scenario("Redis book, 2 replicas, 19x", True, 19.0),
    Scenario("Redis book, 2 replicas, 19x, one stopped 4.5 s", True, 19.0, pause=True, longer=3.0),
    Scenario("in-process book, 5x, bursty, short and long runs", False, 5.0, bursty=True, mixed=True),
    Scenario("Redis book, 2 replicas, 5x, bursty, short and long runs", True, 5.0, bursty=True, mixed=True),
    # mean load under the capacity, bursts at 2.4x it and lulls between: where a deadline buys
    # time-shifting (a bid under the ceiling waits out a burst and starts in the lull);
    # long enough for some 50 deadline orders and their controls (bench/market_deadline.py)
    Scenario("in-process book, 0.8x, bursty", False, 0.8, bursty=True, longer=10.0),
]
LULLS = SCENARIOS[-1]


def config(upstream_url: str, redis_url: str | None, prefix: str) -> str:
    cluster = ""
    if redis_url:
        cluster = f'[cluster]\nredis_url = "{redis_url}"\nkey_prefix = "{prefix}"\nlease_s = {LEASE_S}\n'
    return f"""
[server]
log_level = "warning"
quiet_interval_s = 1.0
{cluster}
[products.p]
max_output_tokens = 256
sim_overrides = true
[[products.p.deployments]]
engine = "openai"
base_url = "{upstream_url}/v1"
model = "sim"
slots = {SLOTS}
floor = {FLOOR}
breaker_threshold = 1000
"""


@dataclass
class Order:
    n: int
    replica: int
    bid: float
    stream: bool
    timeout: float
    tokens: int
    cancel_after: float | None
    sent: float = 0.0
    rid: str = ""
    queued_at: float | None = None
    frames: list[tuple[float, int, float | None]] = field(default_factory=list)
    ended: float = 0.0
    status: int = 0
    outcome: str = ""
    """completed | timeout | cancel | error"""
    code: str | None = None
    x_market: dict[str, Any] | None = None
    began: bool = False
    """Its first content arrived (a streamed order is not cancelled after that)."""
    start: float | None = None
    """Engine start upstream."""
    message: str = ""
    arrival: float = 0.0
    """Its arrival in the book (best estimate); certainly in [arr_lo, arr_hi]."""
    arr_lo: float = 0.0
    arr_hi: float = 0.0
    arrival_known: bool = True
    leave: float = 0.0
    """When it left the book (best estimate); certainly in [leave_lo, leave_hi]."""
    leave_lo: float = 0.0
    leave_hi: float = 0.0
    quote_s: float | None = None
    """Asks a quote to start within this many seconds first, and bids it (bench.market_forecast)."""
    quoted: dict[str, Any] | None = None
    role: str = ""
    """deadline | control (its fixed-bid twin at the ceiling) | "" (bench.market_deadline)"""
    twin: int | None = None
    factor: float = 1.0
    """A deadline order's deadline over the wait the fixed orders of the level ``below`` its ceiling had."""
    below: int = 1
    """How many levels under its ceiling a deadline order's deadline is drawn from (bench.market_deadline)."""
    deadline_s: float | None = None
    """A deadline order's deadline (``bid`` is its ceiling; ``timeout`` is this too)."""
    first_bid: float | None = None
    """The bid its ``: queued bid=`` frame said (a deadline order's start bid)."""
    bids: list[tuple[float, float]] = field(default_factory=list)
    """(read, bid) of each ``: queued level=… bid=`` frame (a deadline order's bid then)."""
    bid_points: list[tuple[float, float, float]] = field(default_factory=list)
    floor: float = FLOOR


def plan(
    seconds: float, load: float, replicas: int, rng: random.Random, sc: Scenario | None = None, seed: int = 0
) -> list[tuple[float, Order]]:
    """(offset from the start, order): arrivals at ``load`` x the capacity, Poisson or
    bursty, runs short or mixed (``sc``; ``bench/market_arrivals.py``)."""
    bursty, mixed = (sc.bursty, sc.mixed) if sc is not None else (False, False)
    rate = load * market_arrivals.capacity_per_s(SLOTS, TOKENS, TOKENS_PER_S, mixed)
    out: list[tuple[float, Order]] = []
    for n, t in enumerate(market_arrivals.arrival_times(seconds, rate, bursty, rng, seed * 13 + 5)):
        cancel = rng.uniform(*CANCEL_AFTER_S) if rng.random() < CANCEL_SHARE else None
        out.append((t, Order(n, n % replicas, rng.choice(BIDS), rng.random() < 0.5,
                             round(rng.uniform(*TIMEOUT_S), 2), rng.randint(*TOKENS), cancel)))  # fmt: skip
    if mixed:
        market_arrivals.long_runs([o for _, o in out], seed * 17 + 9)
    return out


async def place(
    http: aiohttp.ClientSession, base: str, key: str, o: Order, seen: market_deadline.Seen | None = None
) -> None:
    body = {"model": "p", "messages": [{"role": "user", "content": f"order {o.n}"}], "stream": o.stream,
            "max_price": o.bid, "timeout": o.timeout, "max_tokens": o.tokens,
            "sim": {"output_tokens": o.tokens, "tokens_per_s": TOKENS_PER_S}}  # fmt: skip
    if o.deadline_s is not None:  # a deadline order: its deadline is its timeout
        body["deadline_s"] = o.deadline_s
        del body["timeout"]
    if o.stream:
        body["stream_options"] = {"include_usage": True}
    if o.quote_s is not None:
        await market_forecast.ask_quote(http, base, o)
        body["max_price"] = o.bid
    o.sent = time.time()
    task = asyncio.ensure_future(_exchange(http, base, key, body, o))
    if o.cancel_after is not None:
        done, _ = await asyncio.wait([task], timeout=o.cancel_after)
        if not done and not o.began:
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if task.cancelled():
        o.outcome, o.ended = "cancel", time.time()
    if seen is not None:
        seen.add(o)


async def _exchange(http: aiohttp.ClientSession, base: str, key: str, body: dict[str, Any], o: Order) -> None:
    try:
        async with http.post(base + "/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:  # fmt: skip
            o.status = r.status
            o.rid = r.headers.get("x-request-id", "")
            if o.stream and r.status == 200:
                await _read_stream(r, o)
            else:
                _read_unary(json.loads(await r.read()), o)
    except (aiohttp.ClientError, TimeoutError) as exc:
        o.outcome, o.code = "error", type(exc).__name__
    o.ended = time.time()


async def _read_stream(r: aiohttp.ClientResponse, o: Order) -> None:
    async for raw in r.content:
        now = time.time()
        line = raw.decode().rstrip("\r\n")
        if line.startswith(": queued bid="):
            o.queued_at = now
            o.first_bid = float(line.split("=", 1)[1])
        elif line.startswith(": queued level="):
            p, w, b = _position(line)
            o.frames.append((now, p, w))
            if b is not None:
                o.bids.append((now, b))
        elif line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                o.outcome, o.code = "error", chunk["error"].get("code")
                o.message = chunk["error"].get("message", "")
            elif chunk.get("usage"):
                o.x_market = chunk["usage"].get("x_market")
            elif chunk.get("choices"):
                o.began = True
    if not o.outcome:
        o.outcome = "completed"
    if o.code == "book_timeout":
        o.outcome = "timeout"


def _position(line: str) -> tuple[int, float | None, float | None]:
    """position, wait_s, bid (a deadline order's bid now)"""
    fields = dict(p.split("=", 1) for p in line[2:].split()[1:])
    w, b = fields.get("wait_s"), fields.get("bid")
    return int(fields["position"]), None if w is None else float(w), None if b is None else float(b)


def _read_unary(doc: dict[str, Any], o: Order) -> None:
    if "error" in doc:
        o.code = doc["error"].get("code")
        o.message = doc["error"].get("message", "")
        o.outcome = "timeout" if o.code == "book_timeout" else "error"
        return
    o.outcome = "completed"
    o.x_market = doc.get("usage", {}).get("x_market")


@dataclass
class Stop:
    """The stop of one replica (wall clock)."""

    replica: int
    at: float
    until: float


async def drive(
    bases: list[tuple[str, str]], orders: list[tuple[float, Order]], pause: tuple[int, int, float] | None
) -> tuple[Stop | None, list[float]]:
    """Send every order at its time; ``pause``: (pid, replica, offset) to stop one
    replica. Also how late this client's own event loop ran (every 50 ms)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.time() + 0.5
        tasks = []
        stop: Stop | None = None
        stopper = None
        if pause is not None:
            stopper = asyncio.create_task(_stop(pause, t0))
        lags: list[float] = []
        watch = asyncio.create_task(_lag(lags))
        seen = market_deadline.Seen()
        by_n = {o.n: o for _, o in orders}
        for offset, o in orders:
            delay = t0 + offset - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            base, key = bases[o.replica]
            market_deadline.prepare(o, seen, by_n)
            tasks.append(asyncio.create_task(place(http, base, key, o, seen)))
        await asyncio.gather(*tasks)
        watch.cancel()
        if stopper is not None:
            stop = await stopper
    return stop, lags


async def _lag(lags: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.05)
        lags.append(loop.time() - t - 0.05)


async def _stop(pause: tuple[int, int, float], t0: float) -> Stop:
    pid, replica, offset = pause
    await asyncio.sleep(max(0.0, t0 + offset - time.time()))
    at = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(PAUSE_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    return Stop(replica, at, time.time())


# --------------------------------------------------------------------------- analysis


WAITED = re.compile(r"waited (\d+\.\d) s")


def attach(orders: list[Order], records: list[list[Any]], stop: Stop | None) -> list[tuple[float, float]]:
    """Engine starts onto the orders; each order's arrival and leaving; the upstream's
    (start, end) intervals."""
    by_n = {o.n: o for o in orders}
    spans = []
    for n, start, end in records:
        spans.append((float(start), float(end)))
        o = by_n.get(int(n))
        if o is not None and o.start is None:
            o.start = float(start)
    for o in orders:
        o.leave = o.start if o.start is not None else o.ended
        _arrival(o, stop)
        _leaving(o)
    market_deadline.bid_points(orders, FLOOR, POS_TOL_S)
    return spans


def _leaving(o: Order) -> None:
    """When the book let the order go: admitted up to ``TOL_S`` before its engine
    started; a 408 at its deadline (the client reads it later); a cancelled order up
    to ``POS_TOL_S`` after its client left (the gateway sees the disconnect later)."""
    if o.start is not None:
        o.leave_lo, o.leave_hi = o.start - TOL_S, o.start
    elif o.outcome == "timeout":
        o.leave = min(o.ended, o.arrival + o.timeout)
        o.leave_lo, o.leave_hi = o.leave - TOL_S, o.ended
    elif o.outcome == "cancel":
        o.leave_lo, o.leave_hi = o.ended, o.ended + POS_TOL_S
    else:
        o.leave_lo, o.leave_hi = o.ended - POS_TOL_S, o.ended


def _arrival(o: Order, stop: Stop | None) -> None:
    """When the order entered the book (its place in it: when the book script ran):
    at most ``POS_TOL_S`` before its ``: queued bid=`` frame reached the client
    (streamed); at most ``POS_TOL_S`` after the instant its gateway built it, which is
    its engine start less its ``queued_ms``, or its 408 less the wait the 408 states
    (0.1 s resolution); else somewhere between its sending (or the end of its
    replica's stop) and its leaving. A gateway working off a backlog (a replica just
    let go on) takes that long between building an order and resting it."""
    xm = o.x_market or {}
    waited = WAITED.search(o.message) if o.code == "book_timeout" else None
    if o.queued_at is not None:
        o.arrival = o.arr_hi = o.queued_at
        o.arr_lo = max(o.sent, o.queued_at - POS_TOL_S)
    elif o.start is not None and xm.get("queued_ms") is not None:
        o.arrival = o.arr_lo = o.start - float(xm["queued_ms"]) / 1000.0
        o.arr_hi = min(o.start, o.arr_lo + POS_TOL_S)
    elif waited is not None:
        o.arrival = o.ended - float(waited.group(1))
        o.arr_lo, o.arr_hi = o.arrival - 0.05, o.arrival + 0.05 + POS_TOL_S
    else:
        o.arr_lo = o.sent
        if stop is not None and o.replica == stop.replica and stop.at <= o.sent < stop.until:
            o.arr_lo = stop.until
        o.arrival = o.arr_lo
        o.arr_hi = o.leave
        o.arrival_known = False


def _stopped(o: Order, t: float, stop: Stop | None) -> bool:
    return stop is not None and o.replica == stop.replica and stop.at <= t < stop.until + REVIVE_S


def eligible(o: Order, t: float, stop: Stop | None) -> bool:
    """Certainly in the book at ``t`` and admissible (its replica not stopped)."""
    return o.arr_hi <= t < o.leave_lo and not _stopped(o, t, stop)


def possibly(o: Order, t: float, stop: Stop | None) -> bool:
    """Possibly in the book at ``t`` and admissible: a stopped replica's order counts
    until its lease has lapsed (the book cannot tell a stop sooner)."""
    silent = stop is not None and o.replica == stop.replica and stop.at + LEASE_S + 0.2 <= t < stop.until
    return o.arr_lo <= t < o.leave_hi and not silent


def _throughout(z: Order, a: float, b: float, stop: Stop | None) -> bool:
    """Certainly in the book, admissible, over all of [a, b]."""
    if not (z.arr_hi <= a and b < z.leave_lo):
        return False
    return stop is None or z.replica != stop.replica or b < stop.at or a >= stop.until + REVIVE_S


def _sometime(z: Order, a: float, b: float, stop: Stop | None) -> bool:
    """Possibly in the book at some instant of [a, b] (a stopped replica's order counts
    until its lease has lapsed)."""
    if not (z.arr_lo <= b and a < z.leave_hi):
        return False
    if stop is None or z.replica != stop.replica:
        return True
    return a < stop.at + LEASE_S + 0.2 or b >= stop.until


def certainly_waiting(o: Order, t: float, stop: Stop | None) -> bool:
    """Eligible over the whole of [t - TOL_S, t + TOL_S]."""
    return eligible(o, t - TOL_S, stop) and eligible(o, t + TOL_S, stop)


def ahead_of(z: Order, y: Order, a: float, t: float, y_bid: tuple[float, float], *, surely: bool) -> bool:
    """``z`` ranks before ``y`` at an instant of [a, t] when ``y`` bid within ``y_bid``
    (``surely``: whatever their arrivals within their bounds, and their bids then within
    theirs: a deadline order's rises, :mod:`bench.market_deadline`)."""
    if surely:
        zb = market_deadline.lo(z, a)
        return zb > y_bid[1] or (zb >= y_bid[1] and z.arr_hi < y.arr_lo)
    zb = market_deadline.hi(z, t)
    return zb > y_bid[0] or (zb >= y_bid[0] and z.arr_lo < y.arr_hi)


def priority(orders: list[Order], stop: Stop | None) -> dict[str, int]:
    """Inversions and FIFO violations among the admissions, each order judged at the bid
    it had then (a deadline order's: at least the last bid seen certainly before the
    admission; the admitted one's: the bid it cleared at). An inversion: an order
    certainly bidding more waited; a FIFO violation: one that certainly arrived first
    waited, bidding at least as much (so a deadline order whose bid may have been
    higher, but is not known to, counts here)."""
    started = sorted((o for o in orders if o.start is not None), key=lambda o: o.start or 0.0)
    inv = fifo = with_deadline = 0
    for x in started:
        t = x.start or 0.0
        xb = market_deadline.cleared_bid(x, t)
        waiting = [y for y in orders if y is not x and certainly_waiting(y, t, stop)]
        bids = [(y, market_deadline.lo(y, t - TOL_S)) for y in waiting]
        with_deadline += x.role == "deadline" or any(y.role == "deadline" for y in waiting)
        if any(b > xb for _, b in bids):
            inv += 1
        if any(b == xb and y.arr_hi < x.arr_lo for y, b in bids):
            fifo += 1
    return {
        "admissions": len(started),
        "inversions": inv,
        "fifo": fifo,
        "judged_with_deadline": with_deadline,
    }


def _events(
    orders: list[Order], spans: list[tuple[float, float]], stop: Stop | None
) -> list[tuple[float, int]]:
    """(t, 0 end | 1 start | 2 other), in time order (ends first at one instant)."""
    events: list[tuple[float, int]] = []
    for s, e in spans:
        events += [(s, 1), (e, 0)]
    for o in orders:
        events += [(o.arr_hi, 2), (o.leave_lo, 2)]
    if stop is not None:
        events += [(stop.at, 2), (stop.until + REVIVE_S, 2)]
    return sorted(events)


def sweep(orders: list[Order], spans: list[tuple[float, float]], stop: Stop | None) -> dict[str, Any]:
    """Utilisation while an eligible order waits, and slot freed -> engine start."""
    events = _events(orders, spans, stop)
    running, used, total, owed = 0, 0.0, 0.0, 0
    pending: list[float] = []
    lat: list[float] = []
    last = events[0][0] if events else 0.0
    for t, kind in events:
        dt = t - last
        if dt > 0 and _any_waiting(orders, last + dt / 2, stop):
            used += min(running, SLOTS) * dt
            total += SLOTS * dt
        last = t
        if kind == 0:
            running -= 1
            if owed:  # its slot was given back before the upstream saw it end
                owed -= 1
            elif _any_waiting(orders, t, stop):
                pending.append(t)
        elif kind == 1:
            if running >= SLOTS:
                owed += 1
            elif pending:
                lat.append(t - pending.pop(0))
            running += 1
        elif pending and not _any_waiting(orders, t + 1e-6, stop):
            pending.clear()
    return {"utilisation": used / total if total else float("nan"), "free_to_start_s": lat}


def _any_waiting(orders: list[Order], t: float, stop: Stop | None) -> bool:
    return any(eligible(o, t, stop) for o in orders)


def prices(orders: list[Order], stop: Stop | None) -> dict[str, int]:
    above = inconsistent = exact = n = 0
    for x in orders:
        xm = x.x_market or {}
        price = xm.get("cleared_price")
        if x.start is None or price is None:
            continue
        n += 1
        price = float(price)
        t = x.start
        xb = market_deadline.cleared_bid(x, t)
        if price > xb + 1e-12:
            above += 1
        others = [y for y in orders if y is not x and eligible(y, t - TOL_S / 4, stop)]
        runner = max((market_deadline.lo(y, t - TOL_S / 4) for y in others), default=0.0)
        if price == min(xb, max(FLOOR, runner)):
            exact += 1
        # the bids possibly in the book then (a deadline order's: any it can have had)
        near = [
            (market_deadline.lo(y, t - TOL_S), market_deadline.hi(y, t + TOL_S))
            for y in orders
            if y is not x and (possibly(y, t - TOL_S, stop) or possibly(y, t, stop))
        ]
        if price not in {FLOOR, xb} and not any(a <= price <= b for a, b in near):
            inconsistent += 1
    return {"cleared": n, "above_bid": above, "second_price_violations": inconsistent, "exact": exact}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(xs) < 3:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def frames(orders: list[Order], stop: Stop | None) -> dict[str, Any]:
    """The positions and wait estimates the ``: queued`` frames showed."""
    inside = total = 0
    pos_x: list[float] = []
    pos_y: list[float] = []
    errs: list[float] = []
    within2 = 0
    est: list[float] = []
    act: list[float] = []
    for y in orders:
        seen = dict(y.bids)
        for t, p, w in y.frames:
            total += 1
            a = t - POS_TOL_S
            b = seen.get(t)  # a deadline order's frame says its bid then
            yb = (b, b) if b is not None else (market_deadline.lo(y, a), market_deadline.hi(y, t))
            lo = sum(
                1
                for z in orders
                if z is not y and _throughout(z, a, t, stop) and ahead_of(z, y, a, t, yb, surely=True)
            )
            hi = sum(
                1
                for z in orders
                if z is not y and _sometime(z, a, t, stop) and ahead_of(z, y, a, t, yb, surely=False)
            )
            inside += lo <= p <= hi
            if y.start is None or y.start < t:
                continue
            left = y.start - t
            pos_x.append(p)
            pos_y.append(left)
            if w is not None:
                est.append(w)
                act.append(left)
                errs.append(abs(w - left))
                within2 += left / 2 <= w <= 2 * left
    return {
        "frames": total,
        "in_bounds": inside / total if total else float("nan"),
        "rho_position": spearman(pos_x, pos_y),
        "estimates": len(est),
        "wait_mae_s": statistics.median(errs) if errs else float("nan"),
        "wait_within_2x": within2 / len(est) if est else float("nan"),
        "rho_wait": spearman(est, act),
    }


def lateness(orders: list[Order], stop: Stop | None) -> dict[str, Any]:
    late: list[float] = []
    for o in orders:
        if o.outcome != "timeout":
            continue
        due = o.arrival + o.timeout
        if stop is not None and o.replica == stop.replica and stop.at <= due < stop.until:
            due = stop.until  # it could not answer while stopped
        elif not o.arrival_known:
            continue
        late.append(o.ended - due)
    return {"timeouts": len(late), "max_late_s": max(late) if late else 0.0,
            "over_half_s": sum(1 for x in late if x > 0.5)}  # fmt: skip


def analyse(orders: list[Order], records: list[list[Any]], stop: Stop | None) -> dict[str, Any]:
    spans = attach(orders, records, stop)
    res: dict[str, Any] = {"orders": len(orders)}
    for k in ("completed", "timeout", "cancel", "error"):
        res[k] = sum(1 for o in orders if o.outcome == k)
    res["errors"] = sorted({str(o.code) for o in orders if o.outcome == "error"})
    res.update(priority(orders, stop))
    sw = sweep(orders, spans, stop)
    res["utilisation"] = sw["utilisation"]
    lat = sw["free_to_start_s"]
    res["free_to_start_p50_ms"] = pct(lat, 50) * 1000 if lat else float("nan")
    res["free_to_start_p99_ms"] = pct(lat, 99) * 1000 if lat else float("nan")
    res["free_to_start_n"] = len(lat)
    res.update(prices(orders, stop))
    res.update(frames(orders, stop))
    res.update(market_forecast.per_order(orders))
    res.update(market_forecast.quotes(orders))
    res.update(market_deadline.summary(orders))
    res.update(lateness(orders, stop))
    res["peak_running"] = _peak(spans)
    return res


def _peak(spans: list[tuple[float, float]]) -> int:
    ev = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    peak = cur = 0
    for _, d in ev:
        cur += d
        peak = max(peak, cur)
    return peak


# --------------------------------------------------------------------------- runs


def run(sc: Scenario, seconds: float, up: str, redis_url: str, seed: int) -> dict[str, Any]:
    prefix = "benchmkt" + os.urandom(4).hex()
    cfg = config(up, redis_url if sc.redis else None, prefix)
    replicas = 2 if sc.redis else 1
    seconds *= sc.longer
    rng = random.Random(seed)
    orders = plan(seconds, sc.load, replicas, rng, sc, seed)
    capacity = market_arrivals.capacity_per_s(SLOTS, TOKENS, TOKENS_PER_S, sc.mixed)
    market_forecast.mark_quote_orders([o for _, o in orders], seed * 7 + 1, sc.load * capacity)
    market_deadline.mark([o for _, o in orders], seed * 11 + 3)
    with contextlib.ExitStack() as es:
        gws = [es.enter_context(gateway_process(cfg)) for _ in range(replicas)]
        bases = [(base, key) for base, key, _ in gws]
        asyncio.run(market_arrivals.warm_up(bases, TOKENS, TOKENS_PER_S))
        httpx.post(up + "/bench/log", timeout=10)  # reset: the warm-up is not measured
        pause = (gws[1][2].pid, 1, seconds * 0.3) if sc.pause else None
        log(f"{sc.name}: {len(orders)} orders over {seconds:g} s")
        stop, lags = asyncio.run(drive(bases, [(t, o) for t, o in orders], pause))
        left = _leftover(bases[0][0])
        scores = market_forecast.gateway_scores([b for b, _ in bases])
        records = httpx.get(up + "/bench/log", timeout=30).json()
    dump = os.environ.get("BENCH_MARKET_DUMP")
    if dump:
        Path(f"{dump}-{seed}.json").write_text(
            json.dumps({"orders": [o.__dict__ for _, o in orders], "records": records,
                        "stop": None if stop is None else stop.__dict__}, default=str)
        )  # fmt: skip
    res = analyse([o for _, o in orders], records, stop)
    res["left_in_book"] = left
    res["gateway_forecast"] = scores
    res.update(market_forecast.gateway_summary(scores))
    res["client_lag_p99_ms"] = pct(lags, 99) * 1000 if lags else float("nan")
    res["client_lag_max_ms"] = max(lags) * 1000 if lags else float("nan")
    res["name"] = sc.name
    res["seconds"] = seconds
    if sc.redis:
        _cleanup(redis_url, prefix)
    log(f"  {_summary(res)}")
    return res


def _leftover(base: str) -> dict[str, int]:
    """What the book holds once every client is done (waited for a few seconds)."""
    view: dict[str, Any] = {}
    for _ in range(100):
        view = httpx.get(base + "/market/p", timeout=10).json()
        if view["waiting"] == 0 and view["slots"]["busy"] == 0 and view.get("parked", 0) == 0:
            break
        time.sleep(0.1)
    return {"waiting": view["waiting"], "busy": view["slots"]["busy"], "parked": view.get("parked", 0)}


def _cleanup(url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    try:
        for pattern in (f"{{{prefix}:*", f"{prefix}:*"):
            for k in r.scan_iter(match=pattern, count=1000):
                r.delete(k)
    finally:
        r.close()


def _summary(r: dict[str, Any]) -> str:
    return (
        f"util {r['utilisation']:.4f} inv {r['inversions']} fifo {r['fifo']} "
        f"free->start p50 {r['free_to_start_p50_ms']:.1f} ms p99 {r['free_to_start_p99_ms']:.1f} ms "
        f"pos in bounds {r['in_bounds']:.4f} max 408 late {r['max_late_s']:.2f} s left {r['left_in_book']}; "
        f"estimate: frames within 2x {r['wait_within_2x']:.3f} error/median {r['wait_error_of_median']:.2f}, "
        f"gateway {r['gw_orders']} scored within 2x {r['gw_within_2x']:.3f} mae {r['gw_mae_s']:.2f} s "
        f"of median {r['gw_median_wait_s']:.2f} s; quotes {r['quote_hits']}/{r['quoted']} hit; "
        f"deadline met {r['deadline_met']}/{r['deadline_orders']} vs control {r['control_met']}/"
        f"{r['control_orders']}, mean price {r['deadline_mean_price']:.3f} vs {r['control_mean_price']:.3f}"
    )


def scenario(
    quick: bool = False,
    seconds: float | None = None,
    redis_url: str | None = None,
    runs: str | None = None,
    seeds: int = 1,
) -> dict[str, Any]:
    """The scenarios (``runs``: their numbers, 1-based, comma-separated; default all);
    the rows of the table (what the harness calls). ``seeds``: each scenario is run
    with this many plans (the first the default one), a row each, and its deadline
    orders pooled in a row of the deadline table (:func:`market_deadline.pooled`)."""
    secs = seconds if seconds is not None else (8.0 if quick else 20.0)
    url = redis_url or os.environ.get("BOURSE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    started = time.time()
    rows = []
    with _every_core(), upstream() as up:
        wanted = {int(x) for x in runs.split(",")} if runs else set(range(1, len(SCENARIOS) + 1))
        for i, sc in enumerate(SCENARIOS):
            if i + 1 not in wanted:
                continue
            done = []
            for k in range(seeds):
                seed = 16 + i + SEED_STEP * k
                name = sc.name if seeds == 1 else f"{sc.name}, seed {seed}"
                try:
                    done.append(run(sc, secs, up, url, seed=seed))
                    done[-1]["name"] = name
                except Exception as exc:
                    log(f"{name}: failed: {type(exc).__name__}: {exc}")
                    rows.append({"name": name, "failed": f"{type(exc).__name__}: {exc}"[:300]})
            rows += done
            if len(done) > 1:
                rows.append(market_deadline.pooled(f"{sc.name}, {len(done)} seeds pooled", done))
    return {"rows": rows, "seconds": secs, "minutes": (time.time() - started) / 60, "load": _load()}


@contextlib.contextmanager
def _every_core() -> Iterator[None]:
    """The harness pins itself to one core; the gateways here (its children) may use all."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    try:
        yield
    finally:
        os.sched_setaffinity(0, was)


def _load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


# --------------------------------------------------------------------------- report


def _f(x: Any, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and x != x) else format(x, fmt)


def section_lines(res: dict[str, Any]) -> list[str]:
    """The RESULTS.md section of this bench."""
    L = [HEADING, ""]
    L.append(
        f"Poisson arrivals at 5x and 19x the capacity ({SLOTS} slots, {TOKENS[0]}-{TOKENS[1]} tokens at "
        f"{TOKENS_PER_S:g} tokens/s: {CAPACITY_PER_S:g} requests/s) for {res['seconds']:g} s each (the run with "
        f"a stopped replica {res['seconds'] * max(sc.longer for sc in SCENARIOS if sc.pause):g} s, as in the issue; "
        f"the {LULLS.load:g}x bursty run {res['seconds'] * LULLS.longer:g} s, for some 50 deadline orders and their controls in a "
        f"book with lulls, where a deadline buys time-shifting); the *bursty* runs' arrivals are on/off "
        f"modulated Poisson of the same mean (on {market_arrivals.BURST_ON_S:g} s, off "
        f"{market_arrivals.BURST_OFF_S:g} s on average), and in their *short and long runs* one order in "
        f"{1 / market_arrivals.LONG_SHARE:g} asks {market_arrivals.LONG_TOKENS[0]}-{market_arrivals.LONG_TOKENS[1]} "
        f"tokens (capacity {market_arrivals.capacity_per_s(SLOTS, TOKENS, TOKENS_PER_S, True):g} requests/s; "
        f"`bench/market_arrivals.py`). Before each run, {market_arrivals.WARMUP_ORDERS} short orders per replica "
        f"over {market_arrivals.WARMUP_SPAN_S:g} s, not measured (a gateway just started has seen no run to "
        f"predict from). Bids of ten "
        f"levels ({BIDS[0]}-{BIDS[-1]}), half streamed, book timeouts {TIMEOUT_S[0]:g}-{TIMEOUT_S[1]:g} s, one "
        f"order in ten cancelled after {CANCEL_AFTER_S[0]:g}-{CANCEL_AFTER_S[1]:g} s (deadline orders and their "
        f"controls, below, are streamed and not cancelled); Redis replicas with "
        f"`lease_s = {LEASE_S:g}` and the default `take_up_s` (0.5 s); the stopped replica gets SIGSTOP at 30 % "
        f"of the run for {PAUSE_S:g} s. Run time {res['minutes']:.1f} min; load average at the end "
        f"{res['load']} (the machine was shared with other work, so latencies are high and noisy). "
        f"Definitions in the docstring of `bench/market.py`; tolerance {TOL_S * 1000:.0f} ms. Peak running "
        f"is counted upstream, where a generation ends when its last write returns: that can be a millisecond "
        f"after the gateway read it and gave the slot on (a 5 on 4 slots is such an overlap). Command: "
        f"`PYTHONPATH=src:. .venv/bin/python -m bench.market{res.get('args', '')}`."
    )
    L.append("")
    rows = [r for r in res["rows"] if "failed" not in r and "pooled" not in r]
    L += [f"- {r['name']}: failed: {r['failed']}" for r in res["rows"] if "failed" in r]
    L += [
        "| run | orders | started | 408 | cancelled | errors | inversions | FIFO violations "
        "| utilisation while an eligible order waits | cleared > bid | second-price violations (exact) | peak running |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        L.append(
            f"| {r['name']} | {r['orders']} | {r['admissions']} | {r['timeout']} | {r['cancel']} | {r['error']} "
            f"| {r['inversions']} | {r['fifo']} | {_f(r['utilisation'] * 100, '.2f')} % | {r['above_bid']} "
            f"| {r['second_price_violations']} of {r['cleared']} ({r['exact']} exact) | {r['peak_running']} |"
        )
    L += [
        "",
        "| run | frames | position in bounds | rho(position, wait left) | wait estimate: median error s "
        "| within 2x | rho(estimate, wait) | slot freed → engine start p50 / p99 ms | 408s > 0.5 s late (max s) "
        "| client loop lag p99 / max ms | left in book |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        left = r["left_in_book"]
        L.append(
            f"| {r['name']} | {r['frames']} | {_f(r['in_bounds'] * 100, '.2f')} % | {_f(r['rho_position'], '.2f')} "
            f"| {_f(r['wait_mae_s'], '.2f')} | {_f(r['wait_within_2x'] * 100, '.0f')} % | {_f(r['rho_wait'], '.2f')} "
            f"| {_f(r['free_to_start_p50_ms'], '.1f')} / {_f(r['free_to_start_p99_ms'], '.1f')} "
            f"| {r['over_half_s']} of {r['timeouts']} ({_f(r['max_late_s'], '.2f')}) "
            f"| {_f(r.get('client_lag_p99_ms'), '.0f')} / {_f(r.get('client_lag_max_ms'), '.0f')} "
            f"| {left['waiting']} waiting, {left['busy']} busy, {left['parked']} parked |"
        )
    L.append("")
    L += market_forecast.section_lines(rows)
    L += market_deadline.section_lines(res["rows"])
    paused = [r for r in rows if "stopped" in r["name"]]
    if paused:
        r = paused[0]
        checks = [
            ("utilisation ≥ 98 %", r["utilisation"] >= 0.98, f"{r['utilisation'] * 100:.2f} %"),
            ("zero inversions", r["inversions"] == 0, str(r["inversions"])),
            ("zero FIFO violations", r["fifo"] == 0, str(r["fifo"])),
            ("no 408 later than 0.5 s past its timeout", r["over_half_s"] == 0,
             f"{r['over_half_s']} of {r['timeouts']} (max {r['max_late_s']:.2f} s)"),
        ]  # fmt: skip
        L += [
            "Targets with one replica stopped 4.5 s (issue 16):",
            "",
            "| target | measured | met |",
            "|---|---|---|",
        ]
        L += [f"| {name} | {got} | {'**met**' if ok else '**missed**'} |" for name, ok, got in checks]
        L.append("")
    errors = sorted({e for r in res["rows"] for e in r.get("errors", [])})
    if errors:
        L.append(f"Error codes seen by clients: {', '.join(errors)}.")
        L.append("")
    return L


def write_section(path: Path, lines: list[str], heading: str = HEADING) -> None:
    """Put the section headed ``heading`` into ``path`` in place of an earlier one
    (before the targets table if it is new); the rest of the file is kept."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    block = "\n".join(lines).rstrip("\n") + "\n\n"
    if heading in text:
        start = text.index(heading)
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + block + (text[nxt + 1 :] if nxt >= 0 else "")
    elif "## Targets (" in text:
        i = text.index("## Targets (")
        text = text[:i] + block + text[i:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 s runs")
    ap.add_argument("--seconds", type=float, help="arrivals per run (default 20)")
    ap.add_argument("--redis", default=None)
    ap.add_argument("--runs", default=None, help="which scenarios, e.g. 1,5 (default all)")
    ap.add_argument(
        "--seeds", type=int, default=1, help="plans per scenario, the deadline orders pooled (default 1)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.upstream_port:
        serve_upstream(args.upstream_port)
        return
    res = scenario(args.quick, args.seconds, args.redis, args.runs, args.seeds)
    res["args"] = "".join(
        f" {flag}" if value is True else f" {flag} {value}"
        for flag, value in (
            ("--quick", args.quick),
            ("--seconds", args.seconds),
            ("--runs", args.runs),
            ("--seeds", args.seeds if args.seeds > 1 else None),
        )
        if value
    )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    write_section(Path(args.out), section_lines(res))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
