"""The engine's own token counts, against llama-cpp-python's server (issue 34, item 5):
that server sends no usage on a stream, so the gateway counts the stream with the same
GGUF's tokenizer (a deployment's ``tokenizer``) and charges what the server itself
counts for the same request run non-streamed; and the context pre-check uses that
tokenizer and the server's ``n_ctx``, so a prompt over the engine's context is a 400
``context_length_exceeded`` that never reaches the engine and never opens its breaker."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.money.support import expected_cost
from tests.support.gateway import Gateway, running_gateway
from tests.support.real_engines import (
    RealEngine,
    llama_cpp_python_server,
    packaged_gguf,
)
from tests.support.sse import collect_sse

FLOOR = 0.37  # USD per 1M tokens: the charge's rounding shows every token
TIMEOUT_S = 180.0  # two CPU cores shared with other tests

CHAT = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Write a sentence about the sea."},
    ],
    "temperature": 0,
    "seed": 7,
    "max_tokens": 16,
}
LEGACY = {"prompt": "The capital of France is", "temperature": 0, "seed": 7, "max_tokens": 16}
EOS = {  # a legacy prompt the model ends at its end-of-sequence token (id 1, made likelier)
    "prompt": "The capital of France is",
    "temperature": 0,
    "seed": 7,
    "logit_bias": {"1": 6},
    "max_tokens": 200,  # room to spare: the end-of-sequence token ends it (after 42 tokens)
}


def _config(engine: RealEngine) -> str:
    return (
        _product("lcp", engine)
        + _product("review", engine, 'missing_usage = "reconcile"\n')
        + _product("streamed", engine, deployment="always_stream = true\n")
    )


def _product(product: str, engine: RealEngine, knobs: str = "", deployment: str = "") -> str:
    return f"""
[products.{product}]
{knobs}[[products.{product}.deployments]]
engine = "openai"
name = "{product}-main"
base_url = "{engine.base_url}"
model = "{engine.model}"
slots = 1
floor = {FLOOR}
tokenizer = "{packaged_gguf()}"
n_ctx = {engine.n_ctx}
first_byte_timeout_s = {TIMEOUT_S}
{deployment}"""


@pytest.fixture(scope="module")
def gw(llama_cpp_python: RealEngine) -> Iterator[Gateway]:
    with running_gateway(_config(llama_cpp_python)) as g:
        yield g


def _direct(engine: RealEngine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's own non-streamed answer to ``body``, asked directly."""
    r = httpx.post(engine.base_url + path, json={"model": engine.model, **body}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def _text(doc: dict[str, Any], chat: bool) -> str:
    choice = doc["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


@pytest.mark.parametrize(
    ("path", "body"),
    [("/chat/completions", CHAT), ("/completions", LEGACY), ("/completions", EOS)],
    ids=["chat-max-tokens", "legacy-max-tokens", "legacy-eos"],
)
def test_a_stream_is_charged_the_engines_own_count(
    gw: Gateway, llama_cpp_python: RealEngine, path: str, body: dict[str, Any]
) -> None:
    _assert_charged_as_the_engine_counts(gw, llama_cpp_python, "lcp", path, body)


def _assert_charged_as_the_engine_counts(
    gw: Gateway, engine: RealEngine, product: str, path: str, body: dict[str, Any]
) -> None:
    chat = path == "/chat/completions"
    _direct(engine, path, body)  # the engine's first run of a prompt may differ: warm it
    want = _direct(engine, path, body)
    res = collect_sse(
        gw,
        {"model": product, **body, "stream_options": {"include_usage": True}},
        path="/v1" + path,
        timeout=TIMEOUT_S,
    )
    assert res.status == 200, res.raw
    assert res.kinds()[-2:] == ["usage", "DONE"], res.kinds()
    # the same generation as the engine's own (else the counts could not be compared)
    assert res.text() == _text(want, chat)
    if "logit_bias" in body:  # the cases that end at the end-of-sequence token
        assert want["choices"][0]["finish_reason"] == "stop" and want["usage"]["completion_tokens"] > 0, want
    usage = res.chunks[-1]["usage"]
    engine_usage = want["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        engine_usage["prompt_tokens"],
        engine_usage["completion_tokens"],
    ), (usage, engine_usage)
    assert "usage_estimated" not in usage
    cost = expected_cost(engine_usage["prompt_tokens"] + engine_usage["completion_tokens"], FLOOR)
    assert usage["cost_micros"] == cost and res.chunks[-1]["receipt"]["cost_micros"] == cost
    # the usage record says the same
    rid = res.headers["x-request-id"]
    record = httpx.get(f"{gw.url}/v1/usage/{rid}", headers=gw.headers, timeout=30).json()
    assert record["usage"]["prompt_tokens"] == engine_usage["prompt_tokens"], record
    assert record["usage"]["completion_tokens"] == engine_usage["completion_tokens"], record
    assert not record["usage"].get("usage_estimated"), record
    assert record["usage"]["cost_micros"] == cost, record


STOPS: dict[
    str, dict[str, Any]
] = {  # legacy prompts cut at a client's stop string (bourse applies it: see StopParse)
    "one-token": {"prompt": "The capital of France is", "stop": ["."]},
    "two-tokens": {"prompt": "1, 2, 3,", "stop": [" 7", "zzzq"]},
    "never-met": {"prompt": "Once upon a time", "stop": "zzzq"},
}


@pytest.mark.parametrize("case", list(STOPS))
def test_a_stream_cut_at_a_stop_string_is_charged_the_engines_own_count(
    gw: Gateway, llama_cpp_python: RealEngine, case: str
) -> None:
    """The server counts the tokens that completed a stop string but never streams them:
    bourse applies the stop strings itself, so the stream carries every token, and
    charges what the server counts; the text and the finish reason are the server's."""
    body = {**STOPS[case], "temperature": 0, "seed": 7, "max_tokens": 40}
    _assert_charged_as_the_engine_counts(gw, llama_cpp_python, "lcp", "/completions", body)
    want = _direct(llama_cpp_python, "/completions", body)["choices"][0]["finish_reason"]
    res = collect_sse(gw, {"model": "lcp", **body, "stream": True}, path="/v1/completions", timeout=TIMEOUT_S)
    assert [c["choices"][0]["finish_reason"] for c in res.content_chunks][-1] == want
    assert want == ("length" if case == "never-met" else "stop")


GEMMA_EOS = {  # a chat the model ends at its end-of-sequence token (after 7 tokens)
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "seed": 7,
    "logit_bias": {"1": 6},
    "max_tokens": 100,
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, RealEngine]]:
    """The server started with ``--chat_format gemma`` (its chat answers have content), and
    a deployment that names that format."""
    folder = tmp_path_factory.mktemp("llama-cpp-python-gemma")
    with (
        llama_cpp_python_server(folder, extra_args=("--chat_format", "gemma")) as engine,
        running_gateway(_product("gemma", engine, deployment='chat_format = "gemma"\n')) as g,
    ):
        yield g, engine


@pytest.mark.parametrize("body", [CHAT, GEMMA_EOS], ids=["max-tokens", "eos"])
def test_a_stream_in_the_servers_chat_format_is_charged_its_own_count(
    gemma: tuple[Gateway, RealEngine], body: dict[str, Any]
) -> None:
    gw, engine = gemma
    _assert_charged_as_the_engine_counts(gw, engine, "gemma", "/chat/completions", body)


def test_a_non_streamed_request_streamed_upstream_is_charged_the_engines_own_count(
    gw: Gateway, llama_cpp_python: RealEngine
) -> None:
    """``always_stream = true``: the client asks for one answer, the upstream is asked for
    a stream (without usage, from this server): counted all the same."""
    _direct(llama_cpp_python, "/completions", LEGACY)
    want = _direct(llama_cpp_python, "/completions", LEGACY)
    r = httpx.post(
        gw.v1 + "/completions", json={"model": "streamed", **LEGACY}, headers=gw.headers, timeout=TIMEOUT_S
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["choices"][0]["text"] == want["choices"][0]["text"]
    usage = doc["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        want["usage"]["prompt_tokens"],
        want["usage"]["completion_tokens"],
    ), (usage, want["usage"])
    assert "usage_estimated" not in usage


def _posts(engine: RealEngine) -> int:
    """How many requests the engine has logged (uvicorn's access lines)."""
    return engine.output().count('"POST /v1/')


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_a_prompt_over_the_engines_context_is_refused_before_the_book(
    gw: Gateway, llama_cpp_python: RealEngine, stream: bool
) -> None:
    # ~4,900 tokens of text: under the product's 8,192-token context by the byte bound
    # (bytes / 8), over the engine's 2,048
    words = "hello there " * 2450
    body = {"model": "lcp", "messages": [{"role": "user", "content": words}], "max_tokens": 8}
    assert len(words.encode()) // 8 < 8192
    seen = _posts(llama_cpp_python)
    for _ in range(4):  # more than breaker_threshold (3)
        if stream:
            res = collect_sse(gw, body, timeout=TIMEOUT_S)
            status, error = res.status, res.raw
        else:
            r = httpx.post(gw.v1 + "/chat/completions", json=body, headers=gw.headers, timeout=TIMEOUT_S)
            status, error = r.status_code, r.content
        assert status == 400, error
        doc = httpx.Response(400, content=error).json()
        assert doc["error"]["code"] == "context_length_exceeded", doc
    assert _posts(llama_cpp_python) == seen, "the engine was sent the prompt"
    # the count in the message is the engine's own: it says the same when asked directly
    counted = int(doc["error"]["message"].split("The prompt is ", 1)[1].split(" ", 1)[0])
    assert 4800 < counted < 5000, counted
    r = httpx.post(
        llama_cpp_python.base_url + "/chat/completions",
        json={"model": llama_cpp_python.model, **body},
        timeout=TIMEOUT_S,
    )
    assert r.status_code == 400 and f"({counted} in the messages" in r.text, r.text
    # the deployment's breaker never counted a failure: it still serves
    market = gw.container.completions.markets["lcp"]
    assert all(b.failures == 0 for b in market._breakers)
    ok = collect_sse(gw, {"model": "lcp", **CHAT}, timeout=TIMEOUT_S)
    assert ok.status == 200 and ok.text(), ok.raw


def test_a_counted_stream_is_settled_not_sent_to_review(gw: Gateway, llama_cpp_python: RealEngine) -> None:
    """``missing_usage = "reconcile"`` holds a stream whose usage was estimated for an
    operator; a stream the gateway counted with the engine's tokenizer is charged at once."""
    res = collect_sse(
        gw,
        {"model": "review", **LEGACY, "stream_options": {"include_usage": True}},
        path="/v1/completions",
        timeout=TIMEOUT_S,
    )
    assert res.status == 200, res.raw
    assert res.chunks[-1]["receipt"]["outcome"] == "completed", res.chunks[-1]
    r = gw.admin("GET", "/admin/holds", params={"account": gw.account, "state": "reconciling"})
    assert r.status_code == 200 and r.json()["data"] == [], r.text


# -- llama.cpp's llama-server: it counts itself ------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [("/chat/completions", CHAT), ("/completions", LEGACY)], ids=["chat", "legacy"]
)
def test_a_llama_server_stream_is_charged_its_own_usage(
    llama_server: RealEngine, path: str, body: dict[str, Any]
) -> None:
    """llama-server sends usage on a stream when asked (``stream_options``), so a
    deployment in front of it needs no tokenizer: the charge is the engine's count."""
    config = f"""
[products.ls]
[[products.ls.deployments]]
engine = "openai"
base_url = "{llama_server.base_url}"
model = "{llama_server.model}"
slots = 1
floor = {FLOOR}
first_byte_timeout_s = {TIMEOUT_S}
"""
    want = _direct(llama_server, path, body)
    with running_gateway(config) as g:
        res = collect_sse(
            g,
            {"model": "ls", **body, "stream_options": {"include_usage": True}},
            path="/v1" + path,
            timeout=TIMEOUT_S,
        )
    assert res.status == 200, res.raw
    assert res.text() == _text(want, path == "/chat/completions") and res.text()
    usage = res.chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        want["usage"]["prompt_tokens"],
        want["usage"]["completion_tokens"],
    ), (usage, want["usage"])
    assert "usage_estimated" not in usage


def test_a_deployment_without_a_tokenizer_is_named_at_start(
    llama_cpp_python: RealEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """In front of a server that never sends usage on streams (found by the start
    probe), a deployment with no tokenizer is named in a WARNING at start, before any
    stream is charged an estimate; one with a tokenizer is not."""
    counted = _product("counted", llama_cpp_python)
    uncounted = _product("uncounted", llama_cpp_python).replace(f'tokenizer = "{packaged_gguf()}"\n', "")
    with caplog.at_level(logging.WARNING, "bourse.engines"), running_gateway(counted + uncounted):
        said = [r.getMessage() for r in caplog.records if "sends no usage on streams" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("uncounted-main:") and "llama-cpp-python" in said[0], said


def test_the_engines_own_context_bounds_the_product(llama_server: RealEngine) -> None:
    """llama-server says its context (``/props``: n_ctx 2048 a slot); the product's
    configured 8192 gives way to it: ``/v1/models`` lists 2048, and a prompt that
    cannot fit it by the gateway's own lower bound (bytes / 8) is a 400 before the book."""
    config = f"""
[products.ls]
context_length = 8192
[[products.ls.deployments]]
engine = "openai"
base_url = "{llama_server.base_url}"
model = "{llama_server.model}"
first_byte_timeout_s = {TIMEOUT_S}
"""
    with running_gateway(config) as g:
        model = httpx.get(g.v1 + "/models/ls", timeout=30).json()
        assert model["context_length"] == llama_server.n_ctx, model
        prompt = "The market opens at nine. " * 800  # 20,800 bytes: at least 2,600 tokens
        r = httpx.post(
            g.v1 + "/chat/completions", headers=g.headers, timeout=TIMEOUT_S,
            json={"model": "ls", "messages": [{"role": "user", "content": prompt}], "stream": True},
        )  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
