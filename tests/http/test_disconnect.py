"""A client that leaves (SPEC section 7), from the app in process: mid-stream, each
preset cancels or drains the engine and charges the generated tokens; before the first
token the engine call is cancelled and nothing charged; while queued the order leaves
the book without reaching the engine. Nothing is written once the client is gone.

Each is run twice: the client's ``http.disconnect`` heard by the relay's listener (any
ASGI server), and the connection's watch in the scope, as bourse's own server has it
(the relay then hears of it from the watch, with no listener). On the latter, a
quiet-interval frame being written when the client leaves ends with the response."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from starlette.types import Message

from bourse.engines.sim import SimEngine
from tests.support.asgi import ConnectionWatch, InProcessGateway
from tests.support.bodies import USER
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

DRAINS = {"openfill", "aigrid"}
PRODUCTS = ["default", "hips", "openfill", "aigrid", "gopuram", "knobs"]
PACED = {"output_tokens": 20, "tokens_per_s": 400}
"""About 50 ms of generation: still running when the client leaves after two chunks."""
WATCHED = pytest.mark.parametrize("watched", [False, True], ids=["listener", "watch"])


def _stats(gw: InProcessGateway, product: str) -> dict[str, int]:
    """The counters of the product's sim engine (generations started, completed, cancelled)."""
    engine = gw.container.engines[f"{product}-a"]
    assert isinstance(engine, SimEngine)
    return dict(engine.stats)


async def _record(gw: InProcessGateway, request_id: str) -> dict[str, Any]:
    """The usage record, once settlement (detached from the client) wrote it."""

    async def written() -> dict[str, Any] | None:
        r = await gw.get(f"/v1/usage/{request_id}")
        return r.json() if r.status_code == 200 else None

    return await await_until(written, what=f"the usage record of {request_id}")


@WATCHED
@pytest.mark.parametrize("product", PRODUCTS)
async def test_leaving_mid_stream_cancels_or_drains_and_charges_what_was_generated(
    gw: InProcessGateway, product: str, watched: bool
) -> None:
    before = _stats(gw, product)
    role_first = product == "gopuram"  # sheet 004: a role-only first chunk, then content
    frames = 3 if role_first else 2
    res = await gw.sse_leaving(
        {"model": product, "seed": 3, "sim": PACED}, data_frames=frames, watched=watched
    )
    assert res.status == 200
    assert [k for k in res.kinds() if not k.startswith("c:")] == ["data"] * frames, res.kinds()
    rec = await _record(gw, res.headers["x-request-id"])
    after = _stats(gw, product)
    usage = rec["usage"]
    assert rec["outcome"] == "disconnected", rec
    if product in DRAINS:  # the engine ran to its end, unread
        assert (after["completed"], after["cancelled"]) == (before["completed"] + 1, before["cancelled"])
        assert usage["completion_tokens"] == PACED["output_tokens"], usage
    else:  # the engine stopped at once
        assert (after["completed"], after["cancelled"]) == (before["completed"], before["cancelled"] + 1)
        assert 2 <= usage["completion_tokens"] < PACED["output_tokens"], usage  # 2 content frames read
    assert usage["cost_micros"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0, usage


@WATCHED
async def test_leaving_before_the_first_token_cancels_the_engine_and_charges_nothing(
    gw: InProcessGateway, watched: bool
) -> None:
    before = _stats(gw, "default")
    res = await gw.sse_leaving({"model": "default", "sim": {"ttft_ms": 50}}, data_frames=0, watched=watched)
    assert res.kinds() == ["c:queued bid=1"], res.kinds()
    rec = await _record(gw, res.headers["x-request-id"])
    after = _stats(gw, "default")
    assert after["started"] == before["started"] + 1
    assert after["cancelled"] == before["cancelled"] + 1
    assert rec["usage"]["cost_micros"] == 0, rec
    assert rec["usage"]["completion_tokens"] == 0, rec


@WATCHED
async def test_leaving_while_queued_never_reaches_the_engine(gw: InProcessGateway, watched: bool) -> None:
    account = "leaver-" + os.urandom(4).hex()
    key = await gw.new_account(account, 1.0)
    auth = {"authorization": f"Bearer {key}"}
    holder = await gw.post(
        "/v1/jobs",
        {"endpoint": "/v1/chat/completions", "body": {"model": "single", "messages": USER, "max_tokens": 400,
                                                      "sim": {"output_tokens": 400, "tokens_per_s": 50}}},
        headers=auth,
    )  # fmt: skip
    assert holder.status_code == 202, holder.text
    job_id = holder.json()["id"]

    async def holder_running() -> bool:
        return bool((await gw.get(f"/v1/jobs/{job_id}", headers=auth)).json()["status"] == "running")

    await await_until(holder_running, what="the job holding the only slot")
    before = _stats(gw, "single")
    res = await gw.sse_leaving({"model": "single"}, data_frames=0, watched=watched)
    assert res.kinds() == ["c:queued bid=1"], res.kinds()
    rec = await _record(gw, res.headers["x-request-id"])
    assert rec["usage"]["cost_micros"] == 0 and rec["usage"]["x_market"]["deployment"] is None, rec
    assert _stats(gw, "single")["started"] == before["started"]
    assert (await gw.post(f"/v1/jobs/{job_id}/cancel", headers=auth)).json()["status"] == "canceled"
    view = (await gw.get("/v1/account", headers=auth)).json()
    assert view["open_holds_micros"] == 0, view


def _relay_tasks(tasks: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Those of ``tasks`` still running a coroutine of the relay (a frame, a listener)."""
    return {
        t
        for t in tasks
        if not t.done() and getattr(t.get_coro(), "__qualname__", "").startswith("RunResponse.")
    }


STUCK = [("default-slow", {"ttft_ms": 5000}), ("openfill-slow", {"ttft_ms": 300, "output_tokens": 3})]
"""A product whose client leaves while admitted and the engine's answer: cancelled (the
first token would take 5 s), or drained to its end (``openfill``)."""


class _StuckClient:
    """The client of a stream on bourse's own server (the watch in the scope) whose
    window fills at the first ``: waiting`` frame: it leaves while that frame is being
    written, the write stuck until cancelled (then, ``linger_s``: slow to give up)."""

    def __init__(
        self, gw: InProcessGateway, product: str, sim: dict[str, Any], linger_s: float = 0.0
    ) -> None:
        self.product = product
        self.drains = product.split("-")[0] in DRAINS
        self.watch = ConnectionWatch()
        self.scope, self._raw = gw.stream_scope({"model": product, "sim": sim}, watch=self.watch)
        self.linger_s = linger_s
        self.requested = False
        self.listened = False
        self.writers: list[asyncio.Task[Any]] = []
        """The task writing the stuck frame."""
        self.giving_up = asyncio.Event()
        self.head: dict[bytes, bytes] = {}
        self.received = bytearray()
        self.late: list[Message] = []

    async def receive(self) -> Message:
        if not self.requested:
            self.requested = True
            return {"type": "http.request", "body": self._raw, "more_body": False}
        self.listened = True
        await asyncio.Event().wait()  # the relay hears of the client from the watch
        raise AssertionError

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.head.update(message["headers"])
            return
        if self.writers:
            self.late.append(message)
            return
        body = message.get("body", b"")
        if b": waiting" in body:
            task = asyncio.current_task()
            assert task is not None
            self.writers.append(task)
            self.watch.lose()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.giving_up.set()
                if self.linger_s:
                    await asyncio.sleep(self.linger_s)
                raise
        self.received.extend(body)

    def frame_task(self) -> asyncio.Task[Any]:
        """The task that wrote the stuck frame: not the relay's own."""
        assert len(self.writers) == 1, self.received  # the frame was being written when the client left
        assert self.writers[0] is not asyncio.current_task()
        return self.writers[0]

    async def settled_as_left(self, gw: InProcessGateway, before: dict[str, int]) -> None:
        """Heard from the watch alone; nothing written once gone, no token before; the
        engine stopped before its first token, or drained to its end; settled
        ``disconnected``."""
        assert self.watch.watchers == 1 and not self.listened
        assert not self.late and b"data: " not in self.received, (self.late, self.received)
        after = _stats(gw, self.product)
        rec = await _record(gw, self.head[b"x-request-id"].decode())
        assert rec["outcome"] == "disconnected", rec
        if self.drains:
            assert (after["completed"], after["cancelled"]) == (before["completed"] + 1, before["cancelled"])
            assert rec["usage"]["completion_tokens"] == 3, rec
        else:
            assert (after["started"], after["cancelled"]) == (before["started"] + 1, before["cancelled"] + 1)
            assert rec["usage"]["completion_tokens"] == 0, rec


@pytest.mark.parametrize(("product", "sim"), STUCK)
async def test_leaving_while_a_quiet_interval_frame_is_written_leaves_no_task_behind(
    gw: InProcessGateway, product: str, sim: dict[str, Any]
) -> None:
    """On bourse's own server the ``: waiting`` frame is written by a task of its own,
    not in a task group: the client leaves while that write is stuck (its window full),
    the engine is stopped (or drained, nothing written), and the frame's task is
    cancelled and done before the response returns; no task of the relay is left."""
    before = _stats(gw, product)
    client = _StuckClient(gw, product, sim)
    tasks_before = asyncio.all_tasks()
    async with asyncio.timeout(5):  # the engine would wait 5 s for its first token
        await gw.app(client.scope, client.receive, client.send)
    tick = client.frame_task()
    assert tick.done() and tick.cancelled()
    assert not _relay_tasks(asyncio.all_tasks() - tasks_before)
    await client.settled_as_left(gw, before)


@pytest.mark.parametrize(("product", "sim"), STUCK)
async def test_a_relay_cancelled_while_its_frame_task_ends_is_cancelled_once_that_task_is_done(
    gw: InProcessGateway, product: str, sim: dict[str, Any]
) -> None:
    """The relay waits for the quiet-interval frame's task it cancelled (as a task
    group's exit would); a cancellation of the relay itself meanwhile (a server
    shutting down) is not swallowed: the relay ends cancelled, after that task. (A
    drained run's relay ends with no cancellation of its own to carry this one.)"""
    before = _stats(gw, product)
    client = _StuckClient(gw, product, sim, linger_s=0.2)

    async def respond() -> None:
        await gw.app(client.scope, client.receive, client.send)

    relay = asyncio.create_task(respond())
    ended: list[bool] = []
    relay.add_done_callback(lambda _: ended.append(client.frame_task().done()))
    async with asyncio.timeout(5):
        await client.giving_up.wait()  # the client left; the frame's task was cancelled
    relay.cancel()
    await asyncio.wait({relay}, timeout=5)
    assert relay.cancelled(), relay
    assert ended == [True]
    await client.settled_as_left(gw, before)
