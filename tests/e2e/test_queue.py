"""Admission with slots through the served gateway: the queue frames of SPEC section 4
while an order waits, and the book timeout (408 ``book_timeout``)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import openai
import pytest
from openai.types.chat import ChatCompletion

from tests.e2e.market.support import wait_waiting
from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import Env, start_env
from tests.support.errors import assert_error_envelope
from tests.support.sse import SSEResult, collect_sse

QUEUED_LEVEL = re.compile(r"^queued level=(\d+(?:\.\d+)?) position=(\d+)(?: wait_s=(\d+\.\d\d))?$")


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    products = [Product("one", [Dep("one-a", slots=1, floor=0.05)])]
    with start_env("sim", products, server={"quiet_interval_s": 0.1}) as e:
        yield e


def _hold_slot(env: Env, pool: ThreadPoolExecutor, sim: dict[str, object]) -> Future[ChatCompletion]:
    """Start a non-streamed request that occupies the only slot; wait until it has it."""
    before = env.stats("one-a")["started"]
    fut = pool.submit(
        env.client().chat.completions.create, model="one", messages=USER, seed=1, extra_body={"sim": sim}
    )
    stats, _ = env.wait_stats("one-a", lambda s: s["started"] > before, timeout=5)
    assert stats["started"] == before + 1
    return fut


def _positions(res: SSEResult) -> list[int]:
    out = []
    for c in res.comments:
        m = QUEUED_LEVEL.match(c)
        if m:
            out.append(int(m.group(2)))
    return out


# -- 10. queue frames -------------------------------------------------------------------------


def test_queue_frames_then_waiting_then_chunks(env: Env) -> None:
    with ThreadPoolExecutor(3) as pool:
        holder = _hold_slot(env, pool, {"tokens_per_s": 10, "output_tokens": 9})  # ~0.8 s
        b = pool.submit(collect_sse, env, {"model": "one", "seed": 2, "sim": {"ttft_ms": 500}})
        wait_waiting(env, "one", 1)  # C arrives after B is in the book
        c = pool.submit(collect_sse, env, {"model": "one", "seed": 3})
        rb: SSEResult = b.result(timeout=15)
        rc: SSEResult = c.result(timeout=15)
        holder.result(timeout=15)

    for res in (rb, rc):
        assert res.status == 200
        kinds = res.kinds()
        # `: queued bid=…` first, at once
        assert kinds[0] == "c:queued bid=0.05", kinds
        assert res.frames[0].t < 0.5, res.frames[0].t
        first_data = kinds.index("data")
        before_data = kinds[:first_data]
        assert all(k.startswith("c:") for k in before_data), kinds
        # after the data began, no queue or waiting frames
        assert all(not k.startswith(("c:queued", "c:waiting")) for k in kinds[first_data:]), kinds
        # queued frames precede waiting frames
        waiting_idx = [i for i, k in enumerate(before_data) if k == "c:waiting"]
        queued_idx = [i for i, k in enumerate(before_data) if k.startswith("c:queued level=")]
        if waiting_idx and queued_idx:
            assert max(queued_idx) < min(waiting_idx), kinds
        for k in before_data[1:]:
            assert QUEUED_LEVEL.match(k[2:]) or k == "c:waiting", k
        # positions never increase
        pos = _positions(res)
        assert pos == sorted(pos, reverse=True), pos
        assert kinds[-1] == "DONE"

    # B: first in line behind the running A: position 0, repeated; then `: waiting`
    # during its 500 ms to the first token
    pb = _positions(rb)
    assert len(pb) >= 2, rb.kinds()
    assert set(pb) == {0}, pb
    assert rb.kinds().count("c:waiting") >= 2, rb.kinds()
    # C: behind B (position 1), later first in line (position 0)
    pc = _positions(rc)
    assert 1 in pc and 0 in pc, pc
    assert len(rc.content_chunks) > 0


def test_queue_frame_level_is_a_price(env: Env) -> None:
    with ThreadPoolExecutor(2) as pool:
        holder = _hold_slot(env, pool, {"tokens_per_s": 10, "output_tokens": 5})  # ~0.4 s
        res = collect_sse(env, {"model": "one", "seed": 2, "max_price": 0.2})
        holder.result(timeout=15)
    assert res.kinds()[0] == "c:queued bid=0.2"
    levels = [float(m.group(1)) for c in res.comments if (m := QUEUED_LEVEL.match(c))]
    assert levels, res.kinds()
    assert all(0.05 <= lv <= 0.2 for lv in levels), levels


def test_bid_from_x_max_price_header(env: Env) -> None:
    res = collect_sse(env, {"model": "one", "seed": 2}, headers={"X-Max-Price": "0.3"})
    assert res.kinds()[0] == "c:queued bid=0.3"
    assert res.frames[-1].is_done


# -- 11. book timeout ------------------------------------------------------------------------------


def test_book_timeout_non_streamed_is_http_408(env: Env) -> None:
    with ThreadPoolExecutor(2) as pool:
        holder = _hold_slot(env, pool, {"ttft_ms": 1300, "output_tokens": 3})
        started = env.stats("one-a")["started"]
        t0 = time.monotonic()
        r = env.post("/v1/chat/completions", {"model": "one", "messages": USER, "timeout": 0.3})
        took = time.monotonic() - t0
        err = assert_error_envelope(r, 408, "book_timeout")
        assert err["message"]
        assert 0.25 <= took < 1.2, took

        # the SDK raises APIStatusError 408, and the X-Book-Timeout header works too
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            env.client().chat.completions.create(
                model="one", messages=USER, extra_headers={"X-Book-Timeout": "0.3"}
            )
        took = time.monotonic() - t0
        assert info.value.status_code == 408
        assert isinstance(info.value.body, dict) and info.value.body.get("code") == "book_timeout"
        assert info.value.response.headers.get("x-request-id")
        assert 0.25 <= took < 1.2, took
        # neither reached the engine
        assert env.stats("one-a")["started"] == started
        holder.result(timeout=15)


@pytest.mark.parametrize("how", ["body", "header"])
def test_book_timeout_streamed_is_in_band_error_then_done(env: Env, how: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        holder = _hold_slot(env, pool, {"ttft_ms": 900, "output_tokens": 3})
        started = env.stats("one-a")["started"]
        body: dict[str, object] = {"model": "one", "seed": 2}
        headers = None
        if how == "body":
            body["timeout"] = 0.3
        else:
            headers = {"X-Book-Timeout": "0.3"}
        res = collect_sse(env, body, headers=headers)
        assert res.status == 200
        kinds = res.kinds()
        assert kinds[0].startswith("c:queued bid=")
        data = [k for k in kinds if not k.startswith("c:")]
        assert data == ["error", "DONE"], kinds
        frame = res.chunks[-1]
        assert frame["error"]["code"] == "book_timeout"
        assert "choices" not in frame, frame  # the default frame: every client raises on it
        assert frame["id"] == res.headers["x-request-id"]
        assert frame["model"] == "one"
        t_err = res.data_frames[0].t
        assert 0.25 <= t_err < 0.85, t_err
        assert env.stats("one-a")["started"] == started
        holder.result(timeout=15)


def test_book_timeout_sdk_stream_raises(env: Env) -> None:
    with ThreadPoolExecutor(2) as pool:
        holder = _hold_slot(env, pool, {"ttft_ms": 800, "output_tokens": 3})
        stream = env.client().chat.completions.create(
            model="one", messages=USER, stream=True, extra_body={"timeout": 0.3}
        )
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                pass
        assert "book" in info.value.message.lower() or info.value.code == "book_timeout"
        holder.result(timeout=15)
