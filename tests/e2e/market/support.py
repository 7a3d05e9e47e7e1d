"""Helpers of the market tests: the market views, orders held open in background
threads (raw SSE), slot holders released on demand, and the queue frames parsed."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.bodies import USER
from tests.support.env import Env
from tests.support.sse import Frame, SSEResult, open_sse

QUEUED_BID = re.compile(r"^queued bid=(\d+(?:\.\d+)?)$")
QUEUED_LEVEL = re.compile(r"^queued level=(\d+(?:\.\d+)?) position=(\d+)(?: wait_s=(\d+\.\d\d))?$")
REQUEUED = "requeued (transient backend failure), waiting"

HOLD_FOREVER = {"ttft_ms": 30_000, "output_tokens": 2}
"""sim settings of a request that keeps its slot until its client leaves (within 30 s, the bound of a request's ttft_ms)."""


# -- views -----------------------------------------------------------------------------


def market(env: Env, product: str) -> dict[str, Any]:
    r = env.get(f"/v1/market/{product}")
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def market_list_entry(env: Env, product: str) -> dict[str, Any]:
    r = env.get("/v1/market")
    assert r.status_code == 200, r.text
    [entry] = [m for m in r.json()["data"] if m["product"] == product]
    out: dict[str, Any] = entry
    return out


def model_entry(env: Env, product: str) -> dict[str, Any]:
    r = env.get("/v1/models")
    assert r.status_code == 200, r.text
    [entry] = [m for m in r.json()["data"] if m["id"] == product]
    out: dict[str, Any] = entry
    return out


def wait_market(
    env: Env, product: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 5.0, what: str = ""
) -> dict[str, Any]:
    """Poll GET /v1/market/{product} until ``pred`` holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        view = market(env, product)
        if pred(view):
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"market view of {product!r} never showed {what or pred}: {view}")
        time.sleep(0.01)


def wait_waiting(env: Env, product: str, n: int, timeout: float = 5.0) -> dict[str, Any]:
    return wait_market(env, product, lambda v: v["waiting"] == n, timeout, f"waiting == {n}")


def busy_by_deployment(view: dict[str, Any]) -> dict[str, int]:
    return {d["name"]: d["busy"] for d in view["deployments"]}


# -- orders in the background --------------------------------------------------------------


@dataclass
class BgOrder:
    """A streamed request read in a background thread. Frame times are absolute
    (``time.monotonic()``); :meth:`disconnect` makes the reader leave at its next
    frame (queued orders get one every quiet interval) and close the connection."""

    url: str
    body: dict[str, Any]
    headers: dict[str, str]
    status: int | None = None
    response_headers: httpx.Headers | None = None
    frames: list[Frame] = field(default_factory=list)
    body_json: Any = None
    error: BaseException | None = None
    sent_at: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _head: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> BgOrder:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sent_at = time.monotonic()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with open_sse(self.url, self.body, headers=self.headers, timeout=60) as s:
                self.status = s.status
                self.response_headers = s.headers
                self._head.set()
                if not s.headers.get("content-type", "").startswith("text/event-stream"):
                    s.response.read()
                    self.body_json = json.loads(s.response.content)
                    return
                for f in s.frames():
                    f.t += s.t0
                    self.frames.append(f)
                    if self._stop.is_set():
                        break
        except BaseException as exc:  # reported by the test, never raised in the thread
            self.error = exc
        finally:
            self._head.set()

    def wait_head(self, timeout: float = 10.0) -> None:
        assert self._head.wait(timeout), "no response head"
        assert self.error is None, self.error

    def disconnect(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float = 20.0) -> BgOrder:
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the stream did not end within {timeout} s: {self.kinds()}"
        assert self.error is None, repr(self.error)
        return self

    # -- reading ----------------------------------------------------------------------

    @property
    def request_id(self) -> str:
        self.wait_head()
        assert self.response_headers is not None
        rid: str = self.response_headers["x-request-id"]
        return rid

    def result(self) -> SSEResult:
        assert self.status is not None and self.response_headers is not None
        return SSEResult(self.status, self.response_headers, list(self.frames), b"", self.body_json)

    def kinds(self) -> list[str]:
        return self.result().kinds() if self.status is not None else []

    def comments(self) -> list[str]:
        return [f.comment for f in self.frames if f.comment is not None]

    def queue_frames(self) -> list[tuple[float, int]]:
        """(level, position) of every ``: queued level=… position=…`` frame, in order."""
        out = []
        for c in self.comments():
            m = QUEUED_LEVEL.match(c)
            if m:
                out.append((float(m.group(1)), int(m.group(2))))
        return out

    def content_times(self) -> list[float]:
        return [
            f.t
            for f in self.frames
            if f.data is not None and not f.is_done and json.loads(f.data).get("choices")
        ]

    def first_content_at(self) -> float:
        times = self.content_times()
        assert times, self.kinds()
        return times[0]

    def usage_chunk(self) -> dict[str, Any]:
        [u] = [c for c in self.result().chunks if c.get("choices") == [] and "usage" in c]
        return u

    def x_market(self) -> dict[str, Any]:
        xm: dict[str, Any] = self.usage_chunk()["usage"]["x_market"]
        return xm


def order(
    env: Env,
    product: str,
    bid: float | None,
    *,
    key: str | None = None,
    sim: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> BgOrder:
    """Start a streamed order (usage chunk requested) in the background."""
    body: dict[str, Any] = {
        "model": product,
        "messages": USER,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if bid is not None:
        body["max_price"] = bid
    if sim is not None:
        body["sim"] = sim
    auth = {"authorization": f"Bearer {key}"} if key else env.auth
    return BgOrder(env.url, body, {**auth, **(headers or {})}).start()


@contextmanager
def holding_slot(env: Env, product: str, bid: float = 50.0, *, key: str | None = None) -> Iterator[BgOrder]:
    """An order that takes one slot of ``product`` at once and keeps it until released
    (``.disconnect()``) or the ``with`` ends."""
    before = market(env, product)
    h = order(env, product, bid, key=key, sim=HOLD_FOREVER)
    wait_market(
        env,
        product,
        lambda v: v["admitted_total"] > before["admitted_total"] and v["waiting"] == before["waiting"],
        what="the holder admitted",
    )
    try:
        yield h
    finally:
        if h._thread is not None and h._thread.is_alive():
            h.disconnect()
