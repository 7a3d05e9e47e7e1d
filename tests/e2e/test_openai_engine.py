"""The ``openai`` engine seen from the upstream's side, through the served gateway and a
sim upstream on a real port: what the upstream receives, and an unreachable upstream
handled as a transient failure."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from bourse.engines.sim import SimSettings
from bourse.engines.sim_server import create_sim_app
from tests.support.bodies import USER
from tests.support.dead_upstream import DyingUpstream
from tests.support.env import INTERNAL_MODEL, UPSTREAM_MODEL
from tests.support.gateway import Gateway, running_gateway
from tests.support.servers import serve_app_in_thread
from tests.support.sse import collect_sse


@dataclass
class Recorder:
    """An ASGI wrapper around the sim upstream that keeps every request body it gets."""

    app: Any
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        self.bodies.append(json.loads(raw))
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


@pytest.fixture(scope="module")
def setup() -> Iterator[tuple[Gateway, Recorder]]:
    rec = Recorder(create_sim_app(SimSettings()))
    with DyingUpstream(INTERNAL_MODEL) as dying, serve_app_in_thread(rec) as up:
        dead = dying.base_url
        config = f"""
[products.remote]
sim_overrides = true
[[products.remote.deployments]]
engine = "openai"
name = "remote-main"
base_url = "{up}/v1"
model = "{INTERNAL_MODEL}"
api_key_env = "UPSTREAM_KEY"

[products.capped]
sim_overrides = true
max_output_tokens = 8
[[products.capped.deployments]]
engine = "openai"
name = "capped-main"
base_url = "{up}/v1"
model = "{INTERNAL_MODEL}"

[products.streamed]
sim_overrides = true
[[products.streamed.deployments]]
engine = "openai"
name = "streamed-main"
base_url = "{up}/v1"
model = "{INTERNAL_MODEL}"
always_stream = true

[products.fallback]
sim_overrides = true
[[products.fallback.deployments]]
engine = "openai"
name = "fallback-dead"
base_url = "{dead}"
model = "{INTERNAL_MODEL}"
floor = 0.01
connect_timeout_s = 2
breaker_threshold = 1000
probe_interval_s = 0  # probed at start only (it passes); then its requests meet it dead
[[products.fallback.deployments]]
engine = "openai"
name = "fallback-alive"
base_url = "{up}/v1"
model = "{INTERNAL_MODEL}"
floor = 0.02
"""
        with running_gateway(config, env={"UPSTREAM_KEY": "sk-upstream-secret"}) as gw:
            dying.refuse()
            yield gw, rec


def test_upstream_gets_internal_name_and_one_answer_for_a_non_streamed_client(
    setup: tuple[Gateway, Recorder],
) -> None:
    gw, rec = setup
    n = len(rec.bodies)
    whole = gw.client().chat.completions.create(
        model="remote", messages=USER, seed=3, extra_body={"sim": {"output_tokens": 9}}
    )
    assert whole.model == "remote"
    sent = rec.bodies[n]
    assert sent["model"] == INTERNAL_MODEL
    assert sent["stream"] is False  # one answer asked of the upstream, not a stream
    assert "stream_options" not in sent  # OpenAI refuses stream_options without stream
    assert rec.headers[n].get("authorization") == "Bearer sk-upstream-secret"
    assert rec.headers[n].get("accept") == "application/json"
    # the same answer and exact usage as the streamed request gets
    streamed = collect_sse(
        gw,
        {
            "model": "remote",
            "seed": 3,
            "sim": {"output_tokens": 9},
            "stream_options": {"include_usage": True},
        },
    )
    assert rec.bodies[n + 1]["stream"] is True
    assert rec.bodies[n + 1]["stream_options"]["include_usage"] is True
    assert whole.choices[0].message.content == "".join(
        c["choices"][0]["delta"].get("content") or "" for c in streamed.chunks if c.get("choices")
    )
    assert whole.usage is not None and whole.usage.completion_tokens == 9
    assert streamed.chunks[-1]["usage"]["completion_tokens"] == 9
    assert whole.usage.prompt_tokens == streamed.chunks[-1]["usage"]["prompt_tokens"]


def test_always_stream_asks_for_a_stream_even_for_a_non_streamed_client(
    setup: tuple[Gateway, Recorder],
) -> None:
    gw, rec = setup
    n = len(rec.bodies)
    whole = gw.client().chat.completions.create(model="streamed", messages=USER, seed=3)
    assert whole.choices[0].message.content
    sent = rec.bodies[n]
    assert sent["stream"] is True
    assert sent["stream_options"]["include_usage"] is True
    assert rec.headers[n].get("accept") == "text/event-stream"


def test_upstream_gets_usage_request_but_client_gets_no_usage_chunk(setup: tuple[Gateway, Recorder]) -> None:
    gw, rec = setup
    n = len(rec.bodies)
    res = collect_sse(gw, {"model": "remote", "seed": 3})
    assert rec.bodies[n]["stream_options"]["include_usage"] is True
    assert [c for c in res.chunks if c.get("choices") == []] == []
    for hidden in (INTERNAL_MODEL, UPSTREAM_MODEL, "sk-upstream-secret"):
        assert hidden.encode() not in res.raw


def test_fields_the_gateway_does_not_own_are_forwarded_unchanged(setup: tuple[Gateway, Recorder]) -> None:
    gw, rec = setup
    n = len(rec.bodies)
    gw.client().chat.completions.create(
        model="remote",
        messages=USER,
        seed=3,
        temperature=0.25,
        extra_body={
            "top_k": 7,
            "repetition_penalty": 1.1,
            "chat_template_kwargs": {"enable_thinking": False},
            "sim": {"output_tokens": 4},
            "max_price": 1.0,
            "timeout": 30,
        },
    )
    sent = rec.bodies[n]
    assert sent["top_k"] == 7
    assert sent["repetition_penalty"] == 1.1
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["sim"] == {"output_tokens": 4}
    assert sent["temperature"] == 0.25
    assert sent["seed"] == 3
    assert sent["messages"] == USER
    # the gateway's own extensions stay at the gateway
    assert "max_price" not in sent and "timeout" not in sent


@pytest.mark.parametrize("stream", [False, True])
def test_the_product_output_limit_reaches_the_upstream_when_the_client_sets_none(
    setup: tuple[Gateway, Recorder], stream: bool
) -> None:
    """The quote counted the product's output limit (8): without a max_tokens of the
    client's, the upstream is told that limit, so it cannot generate past what was held
    (tokens past the hold would be free: the charge is capped at the hold)."""
    gw, rec = setup
    n = len(rec.bodies)
    body = {"model": "capped", "messages": USER, "seed": 3, "sim": {"output_tokens": 40}}
    if stream:
        res = collect_sse(gw, {**body, "stream_options": {"include_usage": True}})
        usage = res.chunks[-1]["usage"]
        finish = [c["choices"][0].get("finish_reason") for c in res.chunks if c.get("choices")][-1]
    else:
        whole = gw.client().chat.completions.create(
            model="capped", messages=USER, seed=3, extra_body={"sim": {"output_tokens": 40}}
        )
        assert whole.usage is not None
        usage = whole.usage.model_dump()
        finish = whole.choices[0].finish_reason
    assert rec.bodies[n]["max_tokens"] == 8
    assert "max_completion_tokens" not in rec.bodies[n]
    assert usage["completion_tokens"] <= 8
    assert finish == "length"


def test_the_clients_own_output_limit_is_sent_unchanged(setup: tuple[Gateway, Recorder]) -> None:
    gw, rec = setup
    n = len(rec.bodies)
    gw.client().chat.completions.create(
        model="capped",
        messages=USER,
        seed=3,
        max_completion_tokens=5,
        extra_body={"sim": {"output_tokens": 40}},
    )
    assert rec.bodies[n].get("max_completion_tokens") == 5
    assert "max_tokens" not in rec.bodies[n]


def test_unreachable_upstream_is_transient_and_requeued(setup: tuple[Gateway, Recorder]) -> None:
    gw, _ = setup
    res = collect_sse(
        gw, {"model": "fallback", "seed": 3, "max_price": 1.0, "stream_options": {"include_usage": True}}
    )
    assert res.status == 200
    kinds = res.kinds()
    assert "c:requeued (transient backend failure), waiting" in kinds, kinds
    assert "error" not in kinds
    assert kinds[-2:] == ["usage", "DONE"]
    x_market = res.chunks[-1]["usage"]["x_market"]
    assert x_market["deployment"] == "fallback-alive"
    assert x_market["requeues"] == 1
    # the upstream's address never reaches the client
    assert b"127.0.0.1" not in res.raw
