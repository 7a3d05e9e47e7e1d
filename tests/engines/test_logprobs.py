"""Log probabilities from a real engine (llama-cpp-python's server, the packaged Gemma 3
270M) through the gateway's ``openai`` engine, for a client that did not stream: the
legacy completion's ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
``text_offset``) and the chat completion's ``logprobs.content`` are the engine's own,
as the engine answers the same request asked of it directly, whether the gateway asked
the engine for one answer (the default) or for a stream it folded back into one
(``always_stream = true``).

The engine here is started with ``--chat_format gemma``: with its default (it falls back
to ``llama-2`` for this GGUF) the model ends every chat answer at once, empty."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway import Gateway, running_gateway
from tests.support.real_engines import RealEngine, llama_cpp_python_server

PRODUCTS = ("whole", "streamed")
"""``whole``: the engine is asked for one answer; ``streamed``: ``always_stream``, the
gateway folds the engine's stream back into one answer."""
PROMPT = "The capital of France is"
LEGACY = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2}
CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 3,
    "temperature": 0,
    "logprobs": True,
    "top_logprobs": 2,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    folder: Path = tmp_path_factory.mktemp("logprobs-engine")
    with llama_cpp_python_server(
        folder, interrupt_requests=False, extra_args=("--chat_format", "gemma")
    ) as e:
        yield e


@pytest.fixture(scope="module")
def gw(engine: RealEngine) -> Iterator[Gateway]:
    config = "".join(
        f"""
[products.{name}]
[[products.{name}.deployments]]
engine = "openai"
base_url = "{engine.base_url}"
model = "{engine.model}"
slots = 1
always_stream = {"true" if name == "streamed" else "false"}
"""
        for name in PRODUCTS
    )
    with running_gateway(config) as g:
        yield g


def _direct(engine: RealEngine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's own non-streamed answer to ``body``, as it answers it again right after.
    Asked twice: llama-cpp-python keeps the previous request's evaluated tokens and
    evaluates only what a new prompt adds, so the first ask after another prompt is
    evaluated in one batch and a repeat of it token by token from the shared prefix, and
    the logprobs of the two differ in the second decimal (-1.271 vs -1.320 here). The
    gateway's request, which follows, is such a repeat."""
    for _ in range(2):
        r = httpx.post(engine.base_url + path, json={**body, "model": engine.model}, timeout=120)
        assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.mark.parametrize("product", PRODUCTS)
def test_a_non_streamed_legacy_completion_carries_the_engines_logprobs(
    engine: RealEngine, gw: Gateway, product: str
) -> None:
    own = _direct(engine, "/completions", LEGACY)["choices"][0]
    assert own["logprobs"]["tokens"], own  # the engine does give them
    doc = gw.client().completions.create(model=product, **LEGACY)  # type: ignore[call-overload]
    choice = doc.choices[0]
    assert choice.text == own["text"]
    lp = choice.logprobs
    assert lp is not None, doc
    assert lp.tokens == own["logprobs"]["tokens"]
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == own["logprobs"]["text_offset"]
    assert lp.token_logprobs == pytest.approx(own["logprobs"]["token_logprobs"], rel=1e-5)
    assert lp.top_logprobs is not None
    assert [sorted(t) for t in lp.top_logprobs] == [sorted(t) for t in own["logprobs"]["top_logprobs"]]
    assert doc.usage is not None and doc.usage.completion_tokens == len(lp.tokens)


@pytest.mark.parametrize("product", PRODUCTS)
def test_a_non_streamed_chat_completion_carries_the_engines_logprobs(
    engine: RealEngine, gw: Gateway, product: str
) -> None:
    own = _direct(engine, "/chat/completions", CHAT)["choices"][0]
    own_tokens = [t["token"] for t in own["logprobs"]["content"]]
    assert own_tokens, own  # the engine does give them
    doc = gw.client().chat.completions.create(model=product, **CHAT)  # type: ignore[call-overload]
    choice = doc.choices[0]
    assert choice.message.content == own["message"]["content"]
    assert choice.logprobs is not None and choice.logprobs.content is not None, doc
    content = choice.logprobs.content
    assert [t.token for t in content] == own_tokens
    assert "".join(own_tokens) == choice.message.content
    assert [t.logprob for t in content] == pytest.approx(
        [t["logprob"] for t in own["logprobs"]["content"]], rel=1e-5
    )
    assert [[a.token for a in t.top_logprobs] for t in content] == [
        [a["token"] for a in t["top_logprobs"]] for t in own["logprobs"]["content"]
    ]
