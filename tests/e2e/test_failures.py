"""Failures (SPEC sections 6 and 8) through the served gateway, both engine kinds:
an error after output is the error frame then [DONE]; a failure before output is
requeued onto another deployment; when every attempt fails the client gets 502 (or
the in-band error)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import ENGINE_KINDS, Env, start_env
from tests.support.errors import assert_error_envelope
from tests.support.sse import collect_sse

REQUEUED = "requeued (transient backend failure), waiting"


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    products = [
        Product("p", [Dep("p-a", slots=8)]),
        # the failing deployment has the lower floor, so the first attempt goes to it
        Product(
            "fallback",
            [
                Dep("fb-bad", floor=0.01, sim={"fail_before_output": -1}, extra={"breaker_threshold": 1000}),
                Dep("fb-good", floor=0.02),
            ],
        ),
        Product(
            "broken",
            [
                Dep("br-1", sim={"fail_before_output": -1}, extra={"breaker_threshold": 1000}),
                Dep("br-2", sim={"fail_before_output": -1}, extra={"breaker_threshold": 1000}),
            ],
            {"max_requeues": 2},
        ),
        Product("late", [Dep("late-a", extra={"breaker_threshold": 1000})]),
    ]
    with start_env(request.param, products, server={"quiet_interval_s": 0.2}) as e:
        yield e


# -- 5. error after output -----------------------------------------------------------------


def test_error_after_output_is_error_frame_then_done(env: Env) -> None:
    """The default error frame: the chunk's identity and the error, no ``choices`` (a frame
    with ``choices`` is read as a chunk by the AI SDK's openai provider, which then drops
    the error; tests/clients)."""
    body = {"model": "p", "seed": 2, "sim": {"fail_after_tokens": 3, "output_tokens": 10}}
    res = collect_sse(env, body)
    assert res.status == 200
    data_kinds = [k for k in res.kinds() if not k.startswith("c:")]
    assert data_kinds == ["data", "data", "data", "error", "DONE"], res.kinds()
    rid = res.headers["x-request-id"]
    frame = res.chunks[-1]
    assert frame["id"] == rid
    assert frame["model"] == "p"
    assert frame["object"] == "chat.completion.chunk"
    assert set(frame) == {"id", "object", "created", "model", "error"}, frame
    err = frame["error"]
    assert err["code"] == "upstream_error"
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    # what was delivered stays delivered: three tokens of content before the error
    assert all(c["choices"][0]["delta"].get("content") for c in res.chunks[:3])


def test_error_after_output_with_usage_still_ends_with_error_then_done(env: Env) -> None:
    body = {
        "model": "p",
        "seed": 2,
        "stream_options": {"include_usage": True},
        "sim": {"fail_after_tokens": 3, "output_tokens": 10},
    }
    res = collect_sse(env, body)
    kinds = [k for k in res.kinds() if not k.startswith("c:")]
    assert kinds[:3] == ["data", "data", "data"]
    assert kinds[-2:] == ["error", "DONE"], kinds
    assert res.chunks[-1]["error"]["code"] == "upstream_error"


def test_sdk_raises_after_yielding_the_earlier_chunks(env: Env) -> None:
    client = env.client()
    got: list[str] = []
    stream = client.chat.completions.create(
        model="p",
        messages=USER,
        seed=2,
        stream=True,
        extra_body={"sim": {"fail_after_tokens": 3, "output_tokens": 10}},
    )
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            for ch in chunk.choices:
                if ch.delta.content:
                    got.append(ch.delta.content)
    assert len(got) == 3
    assert info.value.message
    # the same three tokens as an uninterrupted answer starts with
    whole = (
        client.chat.completions.create(
            model="p", messages=USER, seed=2, extra_body={"sim": {"output_tokens": 10}}
        )
        .choices[0]
        .message.content
    )
    assert whole is not None and whole.startswith("".join(got))


def test_legacy_completion_error_after_output(env: Env) -> None:
    body = {"model": "p", "prompt": "Hi", "seed": 2, "sim": {"fail_after_tokens": 2, "output_tokens": 10}}
    res = collect_sse(env, body, path="/v1/completions")
    kinds = [k for k in res.kinds() if not k.startswith("c:")]
    assert kinds == ["data", "data", "error", "DONE"], res.kinds()
    frame = res.chunks[-1]
    assert frame["id"] == res.headers["x-request-id"]
    assert frame["object"] == "text_completion" and "choices" not in frame, frame
    assert frame["error"]["code"] == "upstream_error"


def test_non_streamed_error_after_output_is_http_502(env: Env) -> None:
    """The engine fails after output: final, no requeue. The openai engine asked its
    upstream for one answer, so the upstream says the failure with HTTP 502 (it ran the
    request and failed): final too, the engines agree (tests/e2e/test_sdk_contract.py).
    Sent again it would run (and, by its policy, be charged) again: ``x-should-retry:
    false``, which the SDKs obey."""
    started = env.stats("late-a")["started"]
    r = env.post(
        "/v1/chat/completions",
        {"model": "late", "messages": USER, "seed": 2, "sim": {"fail_after_tokens": 3}},
    )
    assert_error_envelope(r, 502, "upstream_error", should_retry="false")
    assert env.stats("late-a")["started"] - started == 1


# -- 7. failure before output: requeue ----------------------------------------------------------


def test_failure_before_output_requeues_to_healthy_deployment(env: Env) -> None:
    bad0 = env.stats("fb-bad")["started"]
    good0 = env.stats("fb-good")["started"]
    body = {"model": "fallback", "seed": 5, "max_price": 1.0, "stream_options": {"include_usage": True}}
    res = collect_sse(env, body)
    assert res.status == 200
    kinds = res.kinds()
    assert "c:" + REQUEUED in kinds, kinds
    requeue_at = kinds.index("c:" + REQUEUED)
    assert kinds.count("c:" + REQUEUED) == 1
    assert "data" in kinds[requeue_at:] and "data" not in kinds[:requeue_at]
    assert "error" not in kinds
    assert kinds[-2:] == ["usage", "DONE"]
    usage = res.chunks[-1]["usage"]
    assert usage["x_market"]["requeues"] == 1
    assert usage["x_market"]["deployment"] == "fb-good"
    assert res.chunks[-1]["receipt"]["outcome"] == "completed"
    assert res.text()
    assert env.stats("fb-bad")["started"] == bad0 + 1
    assert env.stats("fb-good")["started"] == good0 + 1


def test_failure_before_output_requeue_gives_same_text(env: Env) -> None:
    client = env.client()
    whole = client.chat.completions.create(model="p", messages=USER, seed=5)
    rescued = client.chat.completions.create(
        model="fallback", messages=USER, seed=5, extra_body={"max_price": 1.0}
    )
    assert rescued.choices[0].message.content == whole.choices[0].message.content
    assert rescued.usage is not None
    x_market = rescued.usage.model_extra["x_market"] if rescued.usage.model_extra else None
    assert x_market is not None and x_market["requeues"] == 1 and x_market["deployment"] == "fb-good"


def test_all_deployments_failing_non_streamed_is_502(env: Env) -> None:
    s1, s2 = env.stats("br-1")["started"], env.stats("br-2")["started"]
    r = env.post("/v1/chat/completions", {"model": "broken", "messages": USER})
    err = assert_error_envelope(r, 502, "upstream_error")
    assert "Traceback" not in err["message"]
    # one attempt and max_requeues = 2 more
    assert (env.stats("br-1")["started"] - s1) + (env.stats("br-2")["started"] - s2) == 3


def test_all_deployments_failing_sdk_raises_502(env: Env) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        env.client().chat.completions.create(model="broken", messages=USER)
    assert info.value.status_code == 502


def test_all_deployments_failing_streamed_is_in_band_error(env: Env) -> None:
    res = collect_sse(env, {"model": "broken"})
    assert res.status == 200
    kinds = res.kinds()
    assert kinds.count("c:" + REQUEUED) == 2, kinds
    assert "data" not in kinds
    assert kinds[-2:] == ["error", "DONE"], kinds
    frame = res.chunks[-1]
    assert frame["error"]["code"] in ("upstream_error", "no_capacity")
    assert "choices" not in frame, frame
    assert frame["id"] == res.headers["x-request-id"]
