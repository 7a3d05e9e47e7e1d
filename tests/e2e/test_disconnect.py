"""Disconnect and cancellation (SPEC section 7) through the served gateway: a client
that leaves mid-stream cancels the engine within a second (the sim upstream counts a
cancellation), and one that leaves while queued never reaches the engine. The gateway
is served with bourse's own protocol: every relay, streamed or not, hears of its
client through the connection's watch, none through a listener (``relay_paths``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from bourse.http.relay import RunResponse, _watch_of
from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import ENGINE_KINDS, Env, start_env
from tests.support.sse import collect_sse, open_sse

SLOW = {"tokens_per_s": 20, "output_tokens": 60}  # about 3 s of generation


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    products = [
        Product("p", [Dep("p-a", slots=4)]),
        Product("one", [Dep("one-a", slots=1)]),
    ]
    with start_env(request.param, products, server={"quiet_interval_s": 0.1}) as e:
        yield e


@pytest.fixture(autouse=True)
def relay_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, bool]]]:
    """How each relay of the test heard of its client, and whether it streamed:
    ``("watch", stream)`` or ``("listener", stream)``; a listener fails the test."""
    paths: list[tuple[str, bool]] = []
    in_group, call = RunResponse._in_group, RunResponse.__call__

    async def spy_in_group(self: RunResponse, receive: Receive, send: Send) -> None:
        paths.append(("listener", self.run.stream))
        await in_group(self, receive, send)

    async def spy_call(self: RunResponse, scope: Scope, receive: Receive, send: Send) -> None:
        if _watch_of(scope) is not None:  # the relay is watched (it takes no listener then)
            paths.append(("watch", self.run.stream))
        await call(self, scope, receive, send)

    monkeypatch.setattr(RunResponse, "_in_group", spy_in_group)
    monkeypatch.setattr(RunResponse, "__call__", spy_call)
    yield paths
    assert paths and all(how == "watch" for how, _ in paths), paths


def _cancelled_within_one_second(env: Env, dep: str, before: dict[str, int]) -> dict[str, int]:
    stats, waited = env.wait_stats(dep, lambda s: s["cancelled"] > before["cancelled"], timeout=1.0)
    assert stats["cancelled"] == before["cancelled"] + 1, (
        f"no cancellation within 1 s ({waited:.3f}s): {stats}"
    )
    assert stats["completed"] == before["completed"], stats
    return stats


def test_sdk_disconnect_mid_stream_cancels_the_engine(env: Env, relay_paths: list[tuple[str, bool]]) -> None:
    before = env.stats("p-a")
    client = env.client()
    stream = client.chat.completions.create(
        model="p", messages=USER, seed=3, stream=True, extra_body={"sim": SLOW}
    )
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
        if got == 2:
            break
    stream.close()
    client.close()
    _cancelled_within_one_second(env, "p-a", before)
    assert relay_paths == [("watch", True)]
    # and it stays cancelled: the generation does not complete later
    time.sleep(0.3)
    after = env.stats("p-a")
    assert after["completed"] == before["completed"]
    assert after["started"] == before["started"] + 1


def test_raw_disconnect_mid_stream_cancels_the_engine(env: Env, relay_paths: list[tuple[str, bool]]) -> None:
    before = env.stats("p-a")
    with open_sse(env, {"model": "p", "seed": 4, "sim": SLOW}) as s:
        s.read_content(2)
    _cancelled_within_one_second(env, "p-a", before)
    assert relay_paths == [("watch", True)]


def test_a_client_that_stops_reading_has_not_left(env: Env) -> None:
    """Leaving a loop over an open stream's frames is not a disconnect (the test
    helpers' own contract, which the disconnect tests above rely on): the engine is not
    cancelled, the connection stays open, and reading on takes the rest of the answer."""
    before = env.stats("p-a")
    fast = {"tokens_per_s": 60, "output_tokens": 30}
    with open_sse(env, {"model": "p", "seed": 8, "sim": fast}) as s:
        for f in s.frames():  # a loop of the test's own, left as a client stops reading
            if f.data is not None and f.json.get("choices"):
                break
        stats, _ = env.wait_stats("p-a", lambda st: st["completed"] > before["completed"], timeout=5)
        assert stats["cancelled"] == before["cancelled"], stats
        rest = list(s.frames())
    assert rest and rest[-1].is_done, [f.data for f in rest[-3:]]
    chunks = [f for f in s.seen if f.data is not None and not f.is_done and f.json.get("choices")]
    assert len(chunks) >= 30, len(chunks)


def test_disconnect_before_the_first_token_cancels_the_engine(
    env: Env, relay_paths: list[tuple[str, bool]]
) -> None:
    """The engine is admitted but has produced nothing (an upstream that has not even sent
    its response head): the client leaving still reaches it within a second."""
    before = env.stats("p-a")
    with open_sse(env, {"model": "p", "seed": 6, "sim": {"ttft_ms": 30000}}) as s:
        env.wait_stats("p-a", lambda st: st["started"] > before["started"], timeout=5)
        for f in s.frames():
            assert f.data is None, "no token within 30 s"
            if f.comment == "waiting":
                break
    _cancelled_within_one_second(env, "p-a", before)
    assert relay_paths == [("watch", True)]


def test_disconnect_from_a_non_streamed_request_cancels_the_engine(env: Env) -> None:
    """A client that asked for one answer and leaves while it is generated (here: its
    read timeout) cancels the engine within a second, as a stream's client does."""
    before = env.stats("p-a")
    body = {"model": "p", "messages": USER, "seed": 7, "sim": SLOW}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(env.url + "/v1/chat/completions", json=body, headers=env.auth, timeout=0.5)
    _cancelled_within_one_second(env, "p-a", before)


def test_disconnect_frees_the_slot_for_the_next_order(env: Env) -> None:
    before = env.stats("one-a")
    with open_sse(env, {"model": "one", "seed": 4, "sim": SLOW}) as s:
        for f in s.frames():
            if f.data is not None:
                break
    t0 = time.monotonic()
    res = collect_sse(env, {"model": "one", "seed": 5, "sim": {"output_tokens": 5}})
    took = time.monotonic() - t0
    assert res.status == 200 and res.frames[-1].is_done
    assert len(res.content_chunks) == 5
    # the slow one would have held the only slot for ~3 s
    assert took < 1.5, took
    stats = env.stats("one-a")
    assert stats["cancelled"] == before["cancelled"] + 1


def test_disconnect_while_queued_never_reaches_the_engine(env: Env) -> None:
    before = env.stats("one-a")
    client = env.client()
    with ThreadPoolExecutor(1) as pool:
        # A holds the only slot for ~1 s
        holder = pool.submit(
            client.chat.completions.create,
            model="one",
            messages=USER,
            seed=1,
            extra_body={"sim": {"tokens_per_s": 20, "output_tokens": 20}},
        )
        env.wait_stats("one-a", lambda s: s["started"] > before["started"], timeout=5)
        # B waits in the book, then leaves
        with open_sse(env, {"model": "one", "seed": 2}) as s:
            comments = []
            for f in s.frames():
                assert f.data is None, "B must not be admitted while A holds the slot"
                if f.comment is not None:
                    comments.append(f.comment)
                if f.comment and f.comment.startswith("queued bid="):
                    break
            assert s.status == 200
        a = holder.result(timeout=10)
    assert a.choices[0].finish_reason in ("stop", "length")
    time.sleep(0.3)
    after_a = env.stats("one-a")
    assert after_a["started"] == before["started"] + 1, "B left while queued yet reached the engine"
    # C gets the freed slot at once, with nobody ahead of it in the book
    c = client.chat.completions.create(model="one", messages=USER, seed=3)
    assert c.choices[0].message.content
    after_c = env.stats("one-a")
    assert after_c["started"] == before["started"] + 2
    assert c.usage is not None and c.usage.model_extra is not None
    assert c.usage.model_extra["x_market"]["position_at_entry"] == 0
    assert after_c["cancelled"] == before["cancelled"]
