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
import uuid
from typing import Any

import httpx

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
