"""Sheet 001 (openfill) against preset ``openfill``: its Python sample run unchanged,
the error envelope ``data: {"error": {…}}`` exactly, followed by ``[DONE]``, and the
model's own refusal of a prompt longer than the context window (HTTP 400 when not
streamed, in band when streamed)."""

from __future__ import annotations

from tests.e2e.sheets.support import OPENFILL, raw_data, run_sample
from tests.support.env import Env
from tests.support.errors import assert_error_envelope
from tests.support.sse import collect_sse

FAIL_AFTER_3 = {"fail_after_tokens": 3, "output_tokens": 10}
LONG_PROMPT = [{"role": "user", "content": "word " * 9000}]
"""9,006 tokens as the sim counts them (9,000 words + 4 for the message + 2); the
products' context is 8,192; 45,000 bytes, so the gateway's own bound (bytes / 8) lets it in."""


def test_the_python_sample_runs_unchanged(env: Env) -> None:
    out = run_sample("openfill_stream", env)
    text, _, usage = out.partition("\n ")
    assert text.strip(), out
    assert "x_market" in usage and "cost_micros" in usage, out


def test_error_frame_is_the_envelope_exactly_then_done(env: Env) -> None:
    res = collect_sse(env, {"model": OPENFILL, "seed": 2, "sim": FAIL_AFTER_3})
    data = [k for k in res.kinds() if not k.startswith("c:")]
    assert data == ["data", "data", "data", "error", "DONE"], res.kinds()
    frame = res.chunks[-1]
    assert set(frame) == {"error"}, frame
    assert set(frame["error"]) == {"message", "type", "param", "code"}, frame
    assert raw_data(res.raw)[-2:] == [frame, "[DONE]"]


def test_a_prompt_longer_than_the_context_is_refused_by_the_model(env: Env) -> None:
    before = env.gateway.balance()
    r = env.post("/v1/chat/completions", {"model": OPENFILL, "messages": LONG_PROMPT, "max_tokens": 5})
    err = assert_error_envelope(r, 400, "context_length_exceeded")
    assert "8192" in err["message"], err
    res = collect_sse(env, {"model": OPENFILL, "messages": LONG_PROMPT, "max_tokens": 5})
    assert res.status == 200
    data = [k for k in res.kinds() if not k.startswith("c:")]
    assert data == ["error", "DONE"], res.kinds()
    frame = res.chunks[-1]
    assert set(frame) == {"error"}, frame
    assert frame["error"]["code"] == "context_length_exceeded", frame
    assert frame["error"]["type"] == "invalid_request_error", frame
    record = env.get(f"/v1/usage/{res.headers['x-request-id']}").json()
    assert record["outcome"] == "error" and record["usage"]["cost_micros"] == 0, record
    assert env.gateway.balance() == before
