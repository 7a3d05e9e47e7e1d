"""Sheet 004 (gopuram) against preset ``gopuram``: the sample stream's shape (a
role-only first chunk, the content, ``delta: {}`` with the ``finish_reason``, the usage
chunk with ``cost``, ``[DONE]``), ``gen-…`` ids in ``X-Gopuram-Request-Id``, the error
frame with ``type: "api_error"`` and ``code: "provider_error"``, and usage always."""

from __future__ import annotations

from typing import Any

from tests.e2e.sheets.support import ONE_SLOT, raw_data, slot_held
from tests.support.env import Env
from tests.support.errors import assert_error_envelope
from tests.support.sse import collect_sse

FAIL_AFTER_3 = {"fail_after_tokens": 3, "output_tokens": 10}
HI = [{"role": "user", "content": "hi"}]


def _data(kinds: list[str]) -> list[str]:
    return [k for k in kinds if not k.startswith("c:")]


def _deltas(res: Any) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in res.content_chunks]


def test_the_sample_stream_shape(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 4, "sim": {"output_tokens": 3}})
    assert _data(res.kinds()) == ["data"] * 5 + ["usage", "DONE"], res.kinds()
    chunks = res.chunks
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                     "finish_reason": None}], chunks[0]  # fmt: skip
    for c in chunks[1:4]:
        assert set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None, c
    assert chunks[4]["choices"][0]["delta"] == {} and chunks[4]["choices"][0]["finish_reason"] == "stop"
    usage = chunks[5]
    assert usage["choices"] == [] and usage["usage"]["cost"] > 0, usage
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    # read by hand: one data line per event, in the sample's order
    assert raw_data(res.raw) == [*chunks, "[DONE]"]


def test_reasoning_and_tool_calls_keep_the_shape(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 4, "sim": {"output_tokens": 2, "reasoning": True}})
    deltas = _deltas(res)
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}, deltas
    assert all(set(d) == {"reasoning"} for d in deltas[1:7]), deltas
    # not streamed, the message is whole
    r = env.post("/v1/chat/completions", {"model": "gopuram", "messages": HI, "seed": 4,
                                          "sim": {"output_tokens": 2}})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text


def test_gen_ids_in_x_gopuram_request_id(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 4})
    rid = res.headers["x-gopuram-request-id"]
    assert rid.startswith("gen-") and rid == res.headers["x-request-id"], dict(res.headers)
    assert {c["id"] for c in res.chunks} == {rid}
    r = env.post("/v1/chat/completions", {"model": "gopuram", "messages": HI})
    assert r.json()["id"] == r.headers["x-gopuram-request-id"] == r.headers["x-request-id"]
    assert r.json()["id"].startswith("gen-")
    assert env.get(f"/v1/usage/{rid}").json()["id"] == rid
    # an error before the stream carries it too
    bad = env.post("/v1/chat/completions", {"model": "gopuram", "messages": HI, "max_tokens": 10**6})
    assert_error_envelope(bad, 400)
    assert bad.headers["x-gopuram-request-id"] == bad.headers["x-request-id"]
    assert bad.headers["x-request-id"].startswith("gen-")


def test_mid_stream_error_frame_is_the_sheets(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 2, "sim": FAIL_AFTER_3})
    assert res.kinds()[-2:] == ["error", "DONE"], res.kinds()
    frame = res.chunks[-1]
    assert frame["choices"] == [{"index": 0, "delta": {}, "finish_reason": "error"}], frame
    assert set(frame["error"]) == {"message", "type", "code"}, frame
    assert frame["error"]["type"] == "api_error" and frame["error"]["code"] == "provider_error", frame
    assert frame["id"] == res.headers["x-gopuram-request-id"]
    r = env.post("/v1/chat/completions", {"model": "gopuram", "messages": HI, "sim": FAIL_AFTER_3})
    err = assert_error_envelope(r, 502, "provider_error", should_retry="false")  # after output: not again
    assert err["type"] == "api_error"


def test_usage_always_also_when_failing_before_the_first_token(env: Env) -> None:
    if env.kind == "sim":  # the in-process engine fails for good before any output
        res = collect_sse(env, {"model": "gopuram", "seed": 2, "sim": {"fail_after_tokens": 0}})
        assert _data(res.kinds()) == ["usage", "error", "DONE"], res.kinds()
        assert res.chunks[0]["usage"]["cost"] == 0, res.chunks[0]
    with slot_held(env, ONE_SLOT["gopuram"]):
        res = collect_sse(env, {"model": ONE_SLOT["gopuram"], "timeout": 0.3})
    assert _data(res.kinds()) == ["usage", "error", "DONE"], res.kinds()
    assert res.chunks[0]["receipt"]["outcome"] == "timeout", res.chunks[0]
    assert res.chunks[1]["error"]["code"] == "book_timeout", res.chunks[1]
