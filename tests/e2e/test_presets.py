"""The policy presets of SPEC section 12, each difference from ``default`` shown through
the served gateway, for both engine kinds; and the knobs set one by one on a product."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import ENGINE_KINDS, Env, start_env
from tests.support.sse import collect_sse, open_sse

FAIL_AFTER_3 = {"fail_after_tokens": 3, "output_tokens": 10}
DRAINABLE = {"tokens_per_s": 20, "output_tokens": 16}  # ~0.75 s of generation
REASONING_TOKENS = 6  # bourse.engines.sim.REASONING_TOKENS


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    products = [
        Product("def", [Dep("def-a")], {"policy": "default"}),
        Product("hips", [Dep("hips-a")], {"policy": "hips"}),
        Product("openfill", [Dep("openfill-a")], {"policy": "openfill"}),
        Product("aigrid", [Dep("aigrid-a")], {"policy": "aigrid"}),
        Product("gopuram", [Dep("gopuram-a")], {"policy": "gopuram"}),
        Product(
            "knobs",
            [Dep("knobs-a")],
            {
                "policy": "default",
                "usage_chunk": "always",
                "done_after_error": False,
                "error_frame": "envelope",
                "error_finish_reason": True,
                "reasoning_field": "reasoning",
                "on_disconnect": "drain",
            },
        ),
    ]
    with start_env(request.param, products, server={"quiet_interval_s": 0.2}) as e:
        yield e


def _data_kinds(kinds: list[str]) -> list[str]:
    return [k for k in kinds if not k.startswith("c:")]


def _disconnect_after_two_chunks(env: Env, product: str) -> None:
    with open_sse(env, {"model": product, "seed": 3, "sim": DRAINABLE}) as s:
        s.read_content(2)


def _assert_drained(env: Env, product: str) -> None:
    dep = product + "-a"
    before = env.stats(dep)
    _disconnect_after_two_chunks(env, product)
    stats, waited = env.wait_stats(dep, lambda s: s["completed"] > before["completed"], timeout=4.0)
    assert stats["completed"] == before["completed"] + 1, (
        f"not drained to the end after {waited:.2f}s: {stats}"
    )
    assert stats["cancelled"] == before["cancelled"], stats


def _assert_cancelled(env: Env, product: str) -> None:
    dep = product + "-a"
    before = env.stats(dep)
    _disconnect_after_two_chunks(env, product)
    stats, waited = env.wait_stats(dep, lambda s: s["cancelled"] > before["cancelled"], timeout=1.0)
    assert stats["cancelled"] == before["cancelled"] + 1, f"no cancellation after {waited:.2f}s: {stats}"
    assert stats["completed"] == before["completed"], stats


def _reasoning_chunks(res: Any) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in res.content_chunks[:REASONING_TOKENS]]


# -- default, for contrast ------------------------------------------------------------------------


def test_default_error_frame_is_the_error_without_choices_then_done(env: Env) -> None:
    res = collect_sse(env, {"model": "def", "seed": 2, "sim": FAIL_AFTER_3})
    assert _data_kinds(res.kinds()) == ["data", "data", "data", "error", "DONE"]
    assert set(res.chunks[-1]) == {"id", "object", "created", "model", "error"}, res.chunks[-1]


def test_default_usage_chunk_only_when_asked_and_receipt_named_receipt(env: Env) -> None:
    assert "usage" not in collect_sse(env, {"model": "def", "seed": 2}).kinds()
    res = collect_sse(env, {"model": "def", "seed": 2, "stream_options": {"include_usage": True}})
    u = res.chunks[-1]
    assert u["choices"] == [] and "receipt" in u and "hips" not in u


def test_default_reasoning_arrives_as_reasoning_content(env: Env) -> None:
    res = collect_sse(env, {"model": "def", "seed": 2, "sim": {"reasoning": True}})
    deltas = _reasoning_chunks(res)
    assert all(d.get("reasoning_content") for d in deltas), deltas
    assert all("reasoning" not in d for c in res.content_chunks for d in [c["choices"][0]["delta"]])
    # non-streamed: the message carries reasoning_content
    whole = env.client().chat.completions.create(
        model="def", messages=USER, seed=2, extra_body={"sim": {"reasoning": True}}
    )
    extra = whole.choices[0].message.model_extra or {}
    assert extra.get("reasoning_content") == "".join(d["reasoning_content"] for d in deltas)
    assert "reasoning" not in extra
    assert whole.choices[0].message.content == res.text()


def test_default_disconnect_cancels(env: Env) -> None:
    _assert_cancelled(env, "def")


# -- hips ---------------------------------------------------------------------------------------


def test_hips_error_frame_is_bare_envelope_without_done(env: Env) -> None:
    res = collect_sse(env, {"model": "hips", "seed": 2, "sim": FAIL_AFTER_3})
    assert res.status == 200
    kinds = _data_kinds(res.kinds())
    assert kinds == ["data", "data", "data", "error"], res.kinds()
    assert "DONE" not in res.kinds()
    assert b"[DONE]" not in res.raw
    frame = res.chunks[-1]
    assert set(frame) == {"error"}, frame
    assert "finish_reason" not in res.data_frames[-1].data  # type: ignore[operator]
    assert frame["error"]["code"] == "upstream_error"
    assert frame["error"]["message"]


def test_hips_sdk_raises_on_the_bare_error(env: Env) -> None:
    stream = env.client().chat.completions.create(
        model="hips", messages=USER, seed=2, stream=True, extra_body={"sim": FAIL_AFTER_3}
    )
    got = 0
    with pytest.raises(openai.APIError):
        for chunk in stream:
            got += sum(1 for ch in chunk.choices if ch.delta.content)
    assert got == 3


def test_hips_usage_chunk_receipt_is_named_hips(env: Env) -> None:
    res = collect_sse(env, {"model": "hips", "seed": 2, "stream_options": {"include_usage": True}})
    usage_chunks = [c for c in res.chunks if c.get("choices") == []]
    assert len(usage_chunks) == 1
    u = usage_chunks[0]
    assert "hips" in u and "receipt" not in u, u
    assert isinstance(u["hips"]["latency_ms"], int | float)
    assert u["usage"]["completion_tokens"] == len(res.content_chunks)
    assert res.kinds()[-1] == "DONE"  # a completed answer still ends with [DONE]


def test_hips_usage_chunk_is_still_opt_in(env: Env) -> None:
    assert "usage" not in collect_sse(env, {"model": "hips", "seed": 2}).kinds()


def test_hips_non_streamed_receipt_is_named_hips(env: Env) -> None:
    raw = env.client().chat.completions.with_raw_response.create(model="hips", messages=USER, seed=2)
    doc = raw.http_response.json()
    assert "hips" in doc and "receipt" not in doc, doc


# -- openfill -----------------------------------------------------------------------------------


def test_openfill_disconnect_drains_the_engine(env: Env) -> None:
    _assert_drained(env, "openfill")


def test_openfill_usage_chunk_is_opt_in(env: Env) -> None:
    assert "usage" not in collect_sse(env, {"model": "openfill", "seed": 2}).kinds()


# -- aigrid -------------------------------------------------------------------------------------


def test_aigrid_usage_without_asking_on_the_terminal_chunk(env: Env) -> None:
    res = collect_sse(env, {"model": "aigrid", "seed": 2})
    assert all(c.get("choices") for c in res.chunks), res.kinds()
    usage_chunks = [c for c in res.chunks if "usage" in c]
    assert usage_chunks == [res.chunks[-1]]
    assert usage_chunks[0]["usage"]["completion_tokens"] == len(res.content_chunks)
    assert usage_chunks[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert res.kinds()[-1] == "DONE"


def test_aigrid_disconnect_drains_the_engine(env: Env) -> None:
    _assert_drained(env, "aigrid")


# -- gopuram ------------------------------------------------------------------------------------


def test_gopuram_usage_chunk_without_asking(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 2})
    usage_chunks = [c for c in res.chunks if c.get("choices") == []]
    assert len(usage_chunks) == 1
    assert res.kinds()[-2:] == ["usage", "DONE"]
    assert usage_chunks[0]["receipt"]["outcome"] == "completed"


def test_gopuram_reasoning_arrives_as_reasoning(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 2, "sim": {"reasoning": True}})
    assert res.content_chunks[0]["choices"][0]["delta"] == {"role": "assistant"}  # the role alone first
    deltas = [c["choices"][0]["delta"] for c in res.content_chunks[1 : REASONING_TOKENS + 1]]
    assert all(d.get("reasoning") for d in deltas), deltas
    for c in res.content_chunks:
        assert "reasoning_content" not in c["choices"][0]["delta"], c
    whole = env.client().chat.completions.create(
        model="gopuram", messages=USER, seed=2, extra_body={"sim": {"reasoning": True}}
    )
    extra = whole.choices[0].message.model_extra or {}
    assert extra.get("reasoning") == "".join(d["reasoning"] for d in deltas)
    assert "reasoning_content" not in extra
    # the same reasoning text as the default policy gives under the other name
    default = collect_sse(env, {"model": "def", "seed": 2, "sim": {"reasoning": True}})
    assert [d["reasoning_content"] for d in _reasoning_chunks(default)] == [d["reasoning"] for d in deltas]


def test_gopuram_error_frame_has_finish_reason_then_done(env: Env) -> None:
    res = collect_sse(env, {"model": "gopuram", "seed": 2, "sim": FAIL_AFTER_3})
    kinds = _data_kinds(res.kinds())
    # the usage chunk may precede the error frame (usage always); error then [DONE] end it
    assert kinds[:3] == ["data", "data", "data"]
    assert kinds[-2:] == ["error", "DONE"], res.kinds()
    frame = res.chunks[-1]
    assert frame["choices"] == [{"index": 0, "delta": {}, "finish_reason": "error"}]
    assert frame["error"]["code"] == "provider_error" and frame["error"]["type"] == "api_error"


def test_gopuram_disconnect_cancels(env: Env) -> None:
    _assert_cancelled(env, "gopuram")


# -- knobs set one by one on a default product ------------------------------------------------


def test_knobs_override_the_preset(env: Env) -> None:
    err = collect_sse(env, {"model": "knobs", "seed": 2, "sim": FAIL_AFTER_3})
    assert _data_kinds(err.kinds())[-1] == "error"
    assert "DONE" not in err.kinds()
    assert set(err.chunks[-1]) == {"choices", "error"}
    assert err.chunks[-1]["choices"][0]["finish_reason"] == "error"
    ok = collect_sse(env, {"model": "knobs", "seed": 2, "sim": {"reasoning": True}})
    assert ok.kinds()[-2:] == ["usage", "DONE"]
    assert all(d.get("reasoning") for d in _reasoning_chunks(ok))


def test_knob_on_disconnect_drain(env: Env) -> None:
    _assert_drained(env, "knobs")
