"""Sheet 000 (hips) against preset ``hips``: the keep-alive while the engine produces
nothing, and a failure as one ``data:`` line holding the error envelope, without
``[DONE]``, even when the request asked for usage."""

from __future__ import annotations

from tests.e2e.sheets.support import raw_data
from tests.support.env import Env
from tests.support.sse import collect_sse

FAIL_AFTER_3 = {"fail_after_tokens": 3, "output_tokens": 10}


def test_keep_alive_while_the_engine_produces_nothing_before_the_first_token(env: Env) -> None:
    """ "A comment line (``: keep-alive``) … while the engine produces nothing": also
    between admission and the first token (the default policy says ``: waiting`` there)."""
    res = collect_sse(env, {"model": "hips", "seed": 2, "sim": {"ttft_ms": 900, "output_tokens": 3}})
    before_first = []
    for f in res.frames:
        if f.data is not None:
            break
        if f.comment is not None:
            before_first.append(f.comment)
    quiet = [c for c in before_first if not c.startswith("queued")]
    assert quiet and set(quiet) == {"keep-alive"}, res.kinds()
    default = collect_sse(env, {"model": "def", "seed": 2, "sim": {"ttft_ms": 600, "output_tokens": 3}})
    assert "c:waiting" in default.kinds(), default.kinds()


def test_failure_is_one_data_line_holding_the_envelope_without_done(env: Env) -> None:
    res = collect_sse(env, {"model": "hips", "seed": 2, "sim": FAIL_AFTER_3})
    data = [k for k in res.kinds() if not k.startswith("c:")]
    assert data == ["data", "data", "data", "error"], res.kinds()
    assert set(res.chunks[-1]) == {"error"}
    assert set(res.chunks[-1]["error"]) == {"message", "type", "param", "code"}
    events = raw_data(res.raw)
    assert events[-1] == res.chunks[-1] and "[DONE]" not in events, events


def test_failure_with_include_usage_is_still_the_envelope_alone(env: Env) -> None:
    """With ``include_usage`` the failure is still "one data: line holding the error
    envelope" after the content: no usage chunk before it; the usage record shows the outcome."""
    body = {"model": "hips", "seed": 2, "sim": FAIL_AFTER_3, "stream_options": {"include_usage": True}}
    res = collect_sse(env, body)
    data = [k for k in res.kinds() if not k.startswith("c:")]
    assert data == ["data", "data", "data", "error"], res.kinds()
    assert set(res.chunks[-1]) == {"error"}
    record = env.get(f"/v1/usage/{res.headers['x-request-id']}").json()
    assert record["outcome"] == "error", record
