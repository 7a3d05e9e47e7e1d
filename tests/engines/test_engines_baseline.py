"""What the real engines do on the wire today, pinned (docs/engines.md is the table of
it): the facts bourse's engine flavours rely on. These tests call the engines
directly, not through bourse, and assert the engines' own behaviour; one failing means
an engine changed (a new llama-cpp-python or llama.cpp) and the flavour that relies on
the fact must be looked at again.

Each engine serves the packaged Gemma 3 270M (a base model: llama-cpp-python's chat
answers are empty for it, so requests that need output use the legacy completions
route). Every request opens its own connection: llama-cpp-python closes the connection
under an over-long stream, and a reused one would fail the next request.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from tests.support import real_engines
from tests.support.real_engines import SERVED_MODEL, RealEngine

GEMMA_BOS = 2
"""Gemma's ``<bos>`` token id."""
HELLO_WORLD = [9259, 1902]
"""``"Hello world"`` in Gemma's vocabulary, without BOS."""
LONG_PROMPT = "hello there " * 2500
"""About 5,000 tokens: over an ``n_ctx`` of 2048."""


def _post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 120
) -> httpx.Response:
    with httpx.Client(timeout=timeout) as client:
        return client.post(url, json=body, headers=headers or {})


def _data(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an event stream, in order (``[DONE]`` included)."""
    return [line[len("data:") :].strip() for line in raw.decode().split("\n") if line.startswith("data:")]


def _chunks(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(d) for d in _data(raw) if d != "[DONE]"]


def _completion(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def _chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": SERVED_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


# --- llama-cpp-python's server ---------------------------------------------------------


def test_llama_cpp_python_refuses_a_request_id_that_is_not_a_uuid(llama_cpp_python: RealEngine) -> None:
    url = llama_cpp_python.base_url + "/chat/completions"
    refused = _post(url, _chat("hi", 1), {"x-request-id": "chatcmpl-0123456789abcdef"})
    assert (refused.status_code, refused.content) == (400, b"")  # empty body: no error envelope to read
    streamed = _post(url, _chat("hi", 1, stream=True), {"x-request-id": "chatcmpl-0123456789abcdef"})
    assert (streamed.status_code, streamed.content) == (400, b"")
    models = httpx.get(llama_cpp_python.base_url + "/models", headers={"x-request-id": "bad"}, timeout=30)
    assert models.status_code == 400  # every route, the probe's too

    rid = str(uuid.uuid4())
    accepted = _post(url, _chat("hi", 1), {"x-request-id": rid})
    assert accepted.status_code == 200
    assert accepted.headers["x-request-id"] == rid  # echoed back
    hex_id = uuid.uuid4().hex
    assert _post(url, _chat("hi", 1), {"x-request-id": hex_id}).headers["x-request-id"] == hex_id


def test_llama_cpp_python_sends_no_usage_on_a_stream_but_does_when_not_streamed(
    llama_cpp_python: RealEngine,
) -> None:
    url = llama_cpp_python.base_url + "/completions"
    prompt = "Write one sentence about the sea. " * 10
    raw = _post(url, _completion(prompt, 8, stream=True, stream_options={"include_usage": True})).content
    assert _data(raw)[-1] == "[DONE]"
    chunks = _chunks(raw)
    assert chunks and all("usage" not in c for c in chunks)  # include_usage is ignored
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    whole = _post(url, _completion(prompt, 8)).json()
    counted = _post(llama_cpp_python.root + "/extras/tokenize/count", {"input": prompt}).json()["count"]
    assert whole["usage"] == {"prompt_tokens": counted, "completion_tokens": 8, "total_tokens": counted + 8}


def test_llama_cpp_python_chat_stream_has_no_usage_either(llama_cpp_python: RealEngine) -> None:
    raw = _post(
        llama_cpp_python.base_url + "/chat/completions",
        _chat("hi", 4, stream=True, stream_options={"include_usage": True}),
    ).content
    chunks = _chunks(raw)
    assert chunks and all("usage" not in c for c in chunks)
    assert _data(raw)[-1] == "[DONE]"


def test_llama_cpp_python_tokenize_routes(llama_cpp_python: RealEngine) -> None:
    root = llama_cpp_python.root
    assert _post(root + "/extras/tokenize", {"input": "Hello world"}).json() == {
        "tokens": [GEMMA_BOS, *HELLO_WORLD]
    }
    assert _post(root + "/extras/tokenize", {"input": ""}).json() == {
        "tokens": [GEMMA_BOS]
    }  # BOS always added
    assert _post(root + "/extras/tokenize/count", {"input": "Hello world"}).json() == {"count": 3}
    assert _post(root + "/extras/detokenize", {"tokens": [GEMMA_BOS, *HELLO_WORLD]}).json() == {
        "text": "Hello world"
    }
    # the count is what a non-streamed answer reports as prompt_tokens
    usage = _post(llama_cpp_python.base_url + "/completions", _completion("Hello world", 1)).json()["usage"]
    assert usage["prompt_tokens"] == 3


def test_llama_cpp_python_routes_and_model_list(llama_cpp_python: RealEngine) -> None:
    models = httpx.get(llama_cpp_python.base_url + "/models", timeout=30)
    assert models.json() == {
        "object": "list",
        "data": [{"id": SERVED_MODEL, "object": "model", "owned_by": "me", "permissions": []}],
    }  # no context length anywhere
    for path in ("/health", "/props", "/slots", "/metrics", "/tokenize"):
        r = httpx.request("POST" if path == "/tokenize" else "GET", llama_cpp_python.root + path, timeout=30)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), path
    # a base URL without /v1: a 404 like any unknown route
    wrong = _post(llama_cpp_python.root + "/chat/completions", _chat("hi", 1))
    assert (wrong.status_code, wrong.json()) == (404, {"detail": "Not Found"})


def test_llama_cpp_python_context_too_long(llama_cpp_python: RealEngine) -> None:
    url = llama_cpp_python.base_url + "/chat/completions"
    refused = _post(url, _chat(LONG_PROMPT, 8))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "context_length_exceeded",
        "invalid_request_error",
        "messages",
    )
    assert "maximum context length is 2048 tokens" in error["message"]
    # streamed: 200, an event stream with not one byte in it
    for path, body in (
        (url, _chat(LONG_PROMPT, 8, stream=True)),
        (llama_cpp_python.base_url + "/completions", _completion(LONG_PROMPT, 8, stream=True)),
    ):
        streamed = _post(path, body)
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.content == b""


def test_llama_cpp_python_interrupts_a_running_stream_with_done_and_no_finish_reason(
    llama_cpp_python: RealEngine,
) -> None:
    url = llama_cpp_python.base_url + "/completions"
    first: dict[str, bytes] = {}
    started = threading.Event()

    def long_stream() -> None:
        body = _completion("Once upon a time, a dragon", 400, stream=True)
        with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as r:
            raw = b""
            for part in r.iter_bytes():
                raw += part
                if b'"text"' in raw:
                    started.set()
            first["raw"] = raw

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60), "the first stream sent no text"
    second = _post(url, _completion("Hello", 2, stream=True)).content
    t.join(120)
    chunks = _chunks(first["raw"])
    assert _data(first["raw"])[-1] == "[DONE]"
    assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut short, says nothing
    assert len(chunks) < 400
    assert _chunks(second)[-1]["choices"][0]["finish_reason"] == "length"


# --- llama.cpp's llama-server -----------------------------------------------------------


def test_llama_server_ignores_the_request_id(llama_server: RealEngine) -> None:
    url = llama_server.base_url + "/chat/completions"
    for rid in ("chatcmpl-0123456789abcdef", str(uuid.uuid4())):
        r = _post(url, _chat("hi", 1), {"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert "x-request-id" not in r.headers  # neither refused nor echoed


def test_llama_server_sends_usage_on_a_chat_stream_only_when_asked(llama_server: RealEngine) -> None:
    url = llama_server.base_url + "/chat/completions"
    content = "Write one sentence about the sea. " * 10
    raw = _post(url, _chat(content, 8, stream=True, stream_options={"include_usage": True})).content
    assert _data(raw)[-1] == "[DONE]"
    *_, finish, last = _chunks(raw)
    assert finish["choices"][0]["finish_reason"] == "length" and "usage" not in finish
    assert last["choices"] == []  # a chunk of its own, after the finish_reason
    assert {"usage", "timings"} <= last.keys()
    whole = _post(url, _chat(content, 8)).json()
    counted = {k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert {k: last["usage"][k] for k in counted} == counted  # the stream's usage is the engine's own count
    assert counted["completion_tokens"] == 8

    plain = _post(url, _chat(content, 2, stream=True)).content
    assert all("usage" not in c for c in _chunks(plain))  # not asked: none


def test_llama_server_sends_usage_on_every_legacy_stream(llama_server: RealEngine) -> None:
    raw = _post(llama_server.base_url + "/completions", _completion("Hello world", 2, stream=True)).content
    last = _chunks(raw)[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert (last["usage"]["prompt_tokens"], last["usage"]["completion_tokens"]) == (3, 2)  # BOS counted


def test_llama_server_capacity_and_context_length(llama_server: RealEngine) -> None:
    props = httpx.get(llama_server.root + "/props", timeout=30).json()
    assert props["total_slots"] == 1
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert props["model_alias"] == SERVED_MODEL
    slots = httpx.get(llama_server.root + "/slots", timeout=30).json()
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [(0, 2048, False)]
    model = httpx.get(llama_server.base_url + "/models", timeout=30).json()["data"][0]
    assert (model["id"], model["meta"]["n_ctx"], model["meta"]["n_ctx_train"]) == (SERVED_MODEL, 2048, 32768)


def test_llama_server_splits_its_context_between_slots(tmp_path: Path) -> None:
    with real_engines.llama_server(tmp_path, n_ctx=2048, parallel=2) as engine:
        props = httpx.get(engine.root + "/props", timeout=30).json()
        assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 1024)
        assert [s["n_ctx"] for s in httpx.get(engine.root + "/slots", timeout=30).json()] == [1024, 1024]
        assert httpx.get(engine.base_url + "/models", timeout=30).json()["data"][0]["meta"]["n_ctx"] == 1024


def test_llama_server_queues_instead_of_interrupting_and_says_so_in_metrics(llama_server: RealEngine) -> None:
    url = llama_server.base_url + "/completions"
    first: dict[str, bytes] = {}
    second: dict[str, bytes] = {}
    started = threading.Event()

    def long_stream() -> None:
        body = _completion("Once upon a time, a dragon", 40, stream=True)
        with httpx.Client(timeout=180) as client, client.stream("POST", url, json=body) as r:
            raw = b""
            for part in r.iter_bytes():
                raw += part
                if b'"text"' in raw:
                    started.set()
            first["raw"] = raw

    def short_stream() -> None:
        second["raw"] = _post(url, _completion("Hello", 2, stream=True), timeout=180).content

    a = threading.Thread(target=long_stream)
    a.start()
    assert started.wait(60), "the first stream sent no text"
    b = threading.Thread(target=short_stream)
    b.start()
    seen: set[tuple[float, float]] = set()
    while a.is_alive():
        metrics = _metrics(llama_server)
        seen.add((metrics["llamacpp:requests_processing"], metrics["llamacpp:requests_deferred"]))
        if (1, 1) in seen:
            break
        time.sleep(0.05)
    a.join(180)
    b.join(180)
    assert (1, 1) in seen  # one running, one waiting for the slot: the engine's own queue
    assert _chunks(first["raw"])[-1]["choices"][0]["finish_reason"] == "length"  # ran to the end
    assert _chunks(second["raw"])[-1]["choices"][0]["finish_reason"] == "length"


def _metrics(engine: RealEngine) -> dict[str, float]:
    text = httpx.get(engine.root + "/metrics", timeout=30).text
    pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def test_llama_server_refuses_a_prompt_over_its_context_streamed_or_not(llama_server: RealEngine) -> None:
    for url, body in (
        (llama_server.base_url + "/chat/completions", _chat(LONG_PROMPT, 8)),
        (llama_server.base_url + "/chat/completions", _chat(LONG_PROMPT, 8, stream=True)),
        (llama_server.base_url + "/completions", _completion(LONG_PROMPT, 8, stream=True)),
    ):
        r = _post(url, body)
        assert r.status_code == 400, body.get("stream")
        error = r.json()["error"]
        assert (error["type"], error["code"], error["n_ctx"]) == ("exceed_context_size_error", 400, 2048)
        assert error["n_prompt_tokens"] > 2048
        assert "exceeds the available context size" in error["message"]


def test_llama_server_tokenize_routes(llama_server: RealEngine) -> None:
    root = llama_server.root
    assert _post(root + "/tokenize", {"content": "Hello world"}).json() == {"tokens": HELLO_WORLD}  # no BOS
    with_bos = _post(root + "/tokenize", {"content": "Hello world", "add_special": True}).json()
    assert with_bos == {"tokens": [GEMMA_BOS, *HELLO_WORLD]}
    assert _post(root + "/tokenize", {"content": "<start_of_turn>"}).json() == {
        "tokens": [105]
    }  # specials parsed
    pieces = _post(root + "/tokenize", {"content": "Hello world", "with_pieces": True}).json()
    assert pieces == {"tokens": [{"id": 9259, "piece": "Hello"}, {"id": 1902, "piece": " world"}]}
    assert _post(root + "/detokenize", {"tokens": [GEMMA_BOS, *HELLO_WORLD]}).json() == {
        "content": "<bos>Hello world"
    }
    messages = [{"role": "user", "content": "hi"}]
    prompt = _post(root + "/apply-template", {"messages": messages}).json()["prompt"]
    assert (
        prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )  # ChatML: the GGUF has no template
    counted = _post(
        llama_server.base_url + "/chat/completions/input_tokens",
        {"model": SERVED_MODEL, "messages": messages},
    )
    usage = _post(llama_server.base_url + "/chat/completions", _chat("hi", 1)).json()["usage"]
    assert counted.json() == {"input_tokens": usage["prompt_tokens"], "object": "response.input_tokens"}
    tokens = _post(root + "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert (
        len(tokens) == usage["prompt_tokens"]
    )  # the template, tokenized with BOS, is the chat's prompt count


def test_llama_server_routes_and_model_list(llama_server: RealEngine) -> None:
    assert httpx.get(llama_server.root + "/health", timeout=30).json() == {"status": "ok"}
    listed = httpx.get(llama_server.base_url + "/models", timeout=30).json()
    assert [m["id"] for m in listed["data"]] == [SERVED_MODEL]
    assert listed["data"][0]["owned_by"] == "llamacpp"
    for path in ("/", "/v1", "/nope", "/extras/tokenize"):
        r = httpx.get(llama_server.root + path, timeout=30)
        assert r.status_code == 404, path
        assert r.json() == {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
    # a base URL without /v1 is served all the same
    assert _post(llama_server.root + "/chat/completions", _chat("hi", 1)).status_code == 200
    assert httpx.get(llama_server.root + "/models", timeout=30).status_code == 200


def test_llama_server_cancels_a_non_streamed_request_whose_client_left(llama_server: RealEngine) -> None:
    url = llama_server.base_url + "/completions"
    before = _metrics(llama_server)["llamacpp:tokens_predicted_total"]
    try:
        _post(url, _completion("Once upon a time", 300), timeout=2)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("300 tokens in under 2 s: make the request longer")
    # one slot: the next request runs only once the abandoned one is over, so it
    # finishes first either way; had that one run to its end, 300 tokens would be counted
    assert _post(url, _completion("Hello", 1)).json()["usage"]["completion_tokens"] == 1
    predicted = _metrics(llama_server)["llamacpp:tokens_predicted_total"] - before
    assert predicted < 300 + 1  # stopped when its client left, not finished
