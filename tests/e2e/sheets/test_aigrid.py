"""Sheet 002 (aigrid) against preset ``aigrid``: its sample run unchanged (every chunk
has a choice: the usage block rides on the terminal chunk), the invocation id in
``X-AIGrid-Invocation`` and on every frame, the mid-stream error frame
``{"error": {"code": "provider_failed", "message": …}, "id": …}``, usage always (also
when nothing was generated), and a stream without a usage block kept ``reconciling``."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.sheets.support import AIGRID, ONE_SLOT, raw_data, run_sample, slot_held
from tests.support.env import Env
from tests.support.errors import assert_error_envelope
from tests.support.sse import collect_sse

FAIL_AFTER_3 = {"fail_after_tokens": 3, "output_tokens": 10}


def _data(kinds: list[str]) -> list[str]:
    return [k for k in kinds if not k.startswith("c:")]


def test_the_sample_runs_unchanged(env: Env) -> None:
    out = run_sample("aigrid_stream", env, {"client": env.client()})
    assert out.strip(), out


def test_the_terminal_chunk_carries_the_last_choice_and_the_usage(env: Env) -> None:
    res = collect_sse(env, {"model": AIGRID, "seed": 4})
    assert res.kinds()[-1] == "DONE"
    chunks = res.chunks
    assert all(c.get("choices") for c in chunks), [c.get("choices") for c in chunks]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
    assert last["usage"]["completion_tokens"] == len(chunks), last
    assert last["usage"]["cost_micros"] > 0 and last["receipt"]["outcome"] == "completed", last
    assert all("usage" not in c for c in chunks[:-1])
    events = raw_data(res.raw)
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1]), events


def test_the_invocation_id_is_a_header_and_every_frame_id(env: Env) -> None:
    res = collect_sse(env, {"model": AIGRID, "seed": 4})
    rid = res.headers["x-aigrid-invocation"]
    assert rid == res.headers["x-request-id"]
    assert {c["id"] for c in res.chunks} == {rid}
    r = env.post("/v1/chat/completions", {"model": AIGRID, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["x-aigrid-invocation"] == r.json()["id"], r.headers


def test_mid_stream_error_frame_is_the_sheets(env: Env) -> None:
    res = collect_sse(env, {"model": AIGRID, "seed": 2, "sim": FAIL_AFTER_3})
    assert res.kinds()[-2:] == ["error", "DONE"], res.kinds()
    frame = res.chunks[-1]
    rid = res.headers["x-aigrid-invocation"]
    assert frame == {"error": {"code": "provider_failed", "message": frame["error"]["message"]}, "id": rid}
    assert frame["error"]["message"], frame
    # the usage (always) rides on a chunk that still has a choice, before the error
    usage = res.chunks[-2]
    assert usage["choices"] and usage["usage"]["completion_tokens"] == 3, usage


def test_a_non_streamed_provider_failure_is_provider_failed(env: Env) -> None:
    r = env.post(
        "/v1/chat/completions",
        {"model": AIGRID, "messages": [{"role": "user", "content": "hi"}], "sim": FAIL_AFTER_3},
    )
    assert_error_envelope(r, 502, "provider_failed", should_retry="false")  # after output: not again
    assert r.headers["x-aigrid-invocation"] == r.headers["x-request-id"]


def test_the_sdk_raises_on_the_error_frame(env: Env) -> None:
    stream = env.client().chat.completions.create(
        model=AIGRID,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_body={"sim": FAIL_AFTER_3},
    )
    with pytest.raises(openai.APIError, match="after 3 tokens"):
        for _ in stream:
            pass


def test_usage_always_also_when_failing_before_the_first_token(env: Env) -> None:
    if env.kind == "sim":  # the in-process engine fails for good before any output
        res = collect_sse(env, {"model": AIGRID, "seed": 2, "sim": {"fail_after_tokens": 0}})
        assert _data(res.kinds()) == ["data", "error", "DONE"], res.kinds()
        assert res.chunks[0]["usage"]["completion_tokens"] == 0, res.chunks[0]
        assert res.chunks[0]["choices"], res.chunks[0]
    with slot_held(env, ONE_SLOT["aigrid"]):
        res = collect_sse(env, {"model": ONE_SLOT["aigrid"], "timeout": 0.3})
    assert _data(res.kinds()) == ["data", "error", "DONE"], res.kinds()
    usage, err = res.chunks
    assert usage["choices"] and usage["usage"]["cost_micros"] == 0, usage
    assert usage["receipt"]["outcome"] == "timeout", usage
    assert err["error"]["code"] == "book_timeout", err


def test_a_stream_that_ends_without_usage_is_kept_reconciling(env: Env) -> None:
    """ "A stream that ends without a usage block (a provider that stops mid-answer)
    retains its reservation as Reconciling": the provider fails after 3 chunks."""
    res = collect_sse(env, {"model": AIGRID, "seed": 2, "sim": {**FAIL_AFTER_3, "omit_usage": True}})
    assert res.kinds()[-2:] == ["error", "DONE"], res.kinds()
    rid = res.headers["x-request-id"]
    record = env.get(f"/v1/usage/{rid}").json()
    assert record["outcome"] == "reconciling", record
    holds = env.gateway.admin("GET", "/admin/holds", params={"state": "reconciling", "limit": "1000"}).json()
    assert rid in {h["request_id"] for h in holds["data"]}, holds
