"""Failures that stay one client's (issue 34), through the served gateway:

- one request that fails on every attempt counts once on its deployment's breaker:
  the next client is served, not told the product is cooling down;
- a non-streamed request that timed out is not sent again to the engine that may
  still be running it (the upstream receives it once; 504, ``x-should-retry: false``);
- a non-streamed failure after output (the upstream answered 500, or failed mid-stream
  under ``always_stream``) says ``x-should-retry: false``: the official openai SDK
  with its default retries sends it once, and under ``gopuram`` one usage record is
  written, not three.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Message, Receive, Scope, Send

from bourse.engines.sim import SimSettings
from bourse.engines.sim_server import create_sim_app
from tests.support.gateway import Gateway, breaker_openings, running_gateway
from tests.support.servers import serve_app_in_thread
from tests.support.sse import collect_sse

MESSAGES = [{"role": "user", "content": "Tell me about the market."}]


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@dataclass
class Upstream:
    """An ASGI upstream that counts the POSTs it gets: answers each after ``delay_s``
    with ``status`` and ``body``, or hands it to ``app`` (the sim upstream)."""

    status: int = 200
    body: bytes = b"{}"
    delay_s: float = 0.0
    app: Any = None
    posts: list[dict[str, Any]] = field(default_factory=list)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The gateway's probes (GET /v1/models): the sim upstream's answer, else a list
        that serves the model ``m`` these tests configure."""
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        body = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await self._models(scope, receive, send)
            return
        if not scope["path"].endswith("/completions"):  # the flavour probe's routes: not found
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.posts.append(json.loads(raw))
        if self.app is not None:
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": raw, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await asyncio.sleep(self.delay_s)
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": self.body})


def usage_records(gw: Gateway, key: str) -> list[dict[str, Any]]:
    r = httpx.get(gw.v1 + "/usage", headers={"authorization": f"Bearer {key}"}, timeout=30)
    r.raise_for_status()
    data: list[dict[str, Any]] = r.json()["data"]
    return data


# -- one failing request does not open the breaker ----------------------------------------


@pytest.fixture(scope="module")
def guarded() -> Iterator[Gateway]:
    config = """
[products.guarded]
sim_overrides = true
[[products.guarded.deployments]]
engine = "sim"
breaker_threshold = 3
cooldown_s = 60
"""
    with running_gateway(config) as gw:
        yield gw


def test_one_request_failing_on_every_attempt_leaves_the_product_up(guarded: Gateway) -> None:
    body = {"model": "guarded", "messages": MESSAGES, "max_tokens": 4}
    bad = httpx.post(
        guarded.v1 + "/chat/completions", headers=guarded.headers, timeout=30,
        json={**body, "sim": {"fail_before_output": -1}},
    )  # fmt: skip
    assert bad.status_code == 502, bad.text
    assert "on every attempt" in bad.json()["error"]["message"]
    other = guarded.new_key()  # another client
    ok = httpx.post(
        guarded.v1 + "/chat/completions", headers={"authorization": f"Bearer {other}"}, json=body, timeout=30
    )
    assert ok.status_code == 200, ok.text
    assert breaker_openings(guarded) == 0


# -- a non-streamed timeout is not sent again ---------------------------------------------


def test_a_timed_out_non_streamed_request_is_sent_to_the_engine_once() -> None:
    slow = Upstream(delay_s=3.0, body=b'{"choices": []}')
    with serve_app_in_thread(slow) as up:
        config = f"""
[products.slow]
[[products.slow.deployments]]
engine = "openai"
base_url = "{up}/v1"
model = "m"
first_byte_timeout_s = 0.5
read_timeout_s = 0.5
"""
        with running_gateway(config) as gw:
            r = httpx.post(
                gw.v1 + "/chat/completions", headers=gw.headers, timeout=30,
                json={"model": "slow", "messages": MESSAGES, "max_tokens": 4},
            )  # fmt: skip
            assert r.status_code == 504, (r.status_code, r.text, len(slow.posts))
            assert r.headers["x-should-retry"] == "false"
            assert r.json()["error"]["code"] == "upstream_timeout"
            assert "not sent again" in r.json()["error"]["message"]
            time.sleep(1.0)  # a requeue (there must be none) would have reached it by now
            assert len(slow.posts) == 1


# -- a non-streamed failure after output is not retried by the SDK ------------------------


def test_the_sdk_does_not_resend_a_non_streamed_answer_the_upstream_failed() -> None:
    failing = Upstream(status=500, body=b'{"error": {"message": "the generation failed after 12 tokens"}}')
    with serve_app_in_thread(failing) as up:
        config = f"""
[products.fails]
policy = "gopuram"
[[products.fails.deployments]]
engine = "openai"
base_url = "{up}/v1"
model = "m"
"""
        with running_gateway(config) as gw:
            sdk = gw.client(max_retries=2)  # the SDK's default
            with pytest.raises(openai.APIStatusError) as info:
                sdk.chat.completions.create(model="fails", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
            seen = (len(failing.posts), len(usage_records(gw, gw.api_key)))
            assert info.value.status_code == 502
            assert seen == (1, 1), "upstream requests, usage records"
            assert info.value.response.headers["x-should-retry"] == "false"


def test_the_sdk_does_not_resend_a_non_streamed_request_that_failed_after_output() -> None:
    """``always_stream``: the upstream streams, fails after 3 tokens; the client, not
    streamed, gets 502. Under ``gopuram`` the 3 tokens are charged, once."""
    sim = Upstream(app=create_sim_app(SimSettings()))
    with serve_app_in_thread(sim) as up:
        config = f"""
[products.cut]
policy = "gopuram"
sim_overrides = true
[[products.cut.deployments]]
engine = "openai"
base_url = "{up}/v1"
model = "m"
always_stream = true
"""
        with running_gateway(config) as gw:
            sdk = gw.client(max_retries=2)
            with pytest.raises(openai.APIStatusError) as info:
                sdk.chat.completions.create(
                    model="cut", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                    extra_body={"sim": {"fail_after_tokens": 3}},
                )  # fmt: skip
            records = usage_records(gw, gw.api_key)
            assert (len(sim.posts), len(records)) == (1, 1), "upstream requests, usage records"
            assert info.value.status_code == 502
            assert info.value.response.headers["x-should-retry"] == "false"
            [record] = records
            assert record["usage"]["completion_tokens"] == 3


# -- an empty 200 stream after a prompt over the engine's context --------------------------


@pytest.fixture(scope="module")
def empty() -> Iterator[tuple[Gateway, Upstream]]:
    """An upstream that answers every request 200 and closes the stream empty, as
    llama-cpp-python's server answers a streamed prompt over its ``n_ctx``."""
    upstream = Upstream(status=200, body=b"")
    with serve_app_in_thread(upstream) as up:
        config = f"""
[products.small]
context_length = 64
[[products.small.deployments]]
engine = "openai"
base_url = "{up}/v1"
model = "m"
breaker_threshold = 3
cooldown_s = 60
"""
        with running_gateway(config) as gw:
            yield gw, upstream


def test_an_empty_stream_after_a_prompt_over_the_context_is_the_clients_400(
    empty: tuple[Gateway, Upstream],
) -> None:
    gw, upstream = empty
    seen = len(upstream.posts)
    # 500 bytes: past the pre-check (500 / 8 = 62 < 64), over the context by the estimate (130)
    messages = [{"role": "user", "content": "word " * 100}]
    streamed = collect_sse(gw, {"model": "small", "stream": True, "messages": messages})
    [frame] = [c for c in streamed.chunks if "error" in c]
    assert frame["error"]["code"] == "context_length_exceeded", frame
    assert "about 130 tokens" in frame["error"]["message"], frame  # the gateway's estimate
    assert len(upstream.posts) - seen == 1  # a refusal: not requeued
    assert breaker_openings(gw) == 0


def test_an_empty_stream_after_a_prompt_the_engine_counts_over_its_context_is_a_400(
    empty: tuple[Gateway, Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine with its own tokenizer (a TokenCounter): its count decides. (Here its
    count fits at the pre-check, 5 of 10 tokens, as when the product's pre-check counted
    on another deployment's engine; after the stream closed empty it says 11.)"""
    gw, upstream = empty
    engine = gw.engine("small/0")
    counted: list[int] = []

    async def count_prompt_tokens(kind: str, body: dict[str, Any]) -> int:
        counted.append(1)
        return 5 if len(counted) == 1 else 11

    monkeypatch.setattr(type(engine), "context_length", property(lambda self: 10))
    monkeypatch.setattr(engine, "count_prompt_tokens", count_prompt_tokens, raising=False)
    seen = len(upstream.posts)
    streamed = collect_sse(
        gw, {"model": "small", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    [frame] = [c for c in streamed.chunks if "error" in c]
    assert frame["error"]["code"] == "context_length_exceeded", frame
    assert "is 11 tokens" in frame["error"]["message"] and "context of 10" in frame["error"]["message"]
    assert counted and len(upstream.posts) - seen == 1  # a refusal: not requeued


def test_an_empty_stream_after_a_prompt_that_fits_is_transient_and_counted_once(
    empty: tuple[Gateway, Upstream],
) -> None:
    gw, upstream = empty
    seen = len(upstream.posts)
    streamed = collect_sse(
        gw, {"model": "small", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    [frame] = [c for c in streamed.chunks if "error" in c]
    assert frame["error"]["code"] == "upstream_error" and "on every attempt" in frame["error"]["message"]
    assert len(upstream.posts) - seen == 4  # the first attempt and max_requeues = 3
    assert breaker_openings(gw) == 0  # one request: one failure


# -- an interrupted generation is an error, charged by charge_on_error --------------------


def _sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


@pytest.mark.parametrize(("policy", "charged"), [("default", False), ("gopuram", True)])
def test_done_without_a_finish_reason_is_an_error_charged_by_charge_on_error(
    policy: str, charged: bool
) -> None:
    """What llama-cpp-python's server sends a stream it interrupts: content, then
    ``[DONE]`` with no ``finish_reason``."""
    chunk = {
        "id": "up", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Once upon"}, "finish_reason": None}],
    }  # fmt: skip
    cut = Upstream(status=200, body=_sse(chunk, chunk))
    with serve_app_in_thread(cut) as up:
        config = f"""
[products.cut]
policy = "{policy}"
[[products.cut.deployments]]
engine = "openai"
base_url = "{up}/v1"
model = "m"
floor = 10.0
"""
        with running_gateway(config) as gw:
            res = collect_sse(gw, {"model": "cut", "stream": True, "messages": MESSAGES})
            assert res.status == 200
            assert res.text() == "Once uponOnce upon"
            [frame] = [c for c in res.chunks if "error" in c]
            assert "interrupted" in frame["error"]["message"], frame
            assert res.kinds()[-1] == "DONE"
            [record] = usage_records(gw, gw.api_key)
            assert record["outcome"] == "error", record
            assert (record["receipt"]["cost_micros"] > 0) is charged, record
            assert len(cut.posts) == 1
