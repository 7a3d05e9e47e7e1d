"""An upstream answer the gateway cannot fold into its own is refused before money moves
(issue 35: validation before money).

The synchronous path (``Relay._unary``) folds the upstream's chunks into one answer and
writes it after the run settled. The audit asked whether that can fail after the
charge. Depth cannot (bodies and upstream chunks are bounded at 128 levels before the
hold and as they arrive; the answer adds a few); strings and numbers cannot (orjson
parsed them: valid UTF-8, no NaN, integers within 64 bits). Types could: an
OpenAI-compatible upstream whose ``delta.content`` (or ``refusal``, a tool call's
``arguments``, its ``index``) is not what the API says passed the parser, counted as
output and charged, then the fold failed: 500 ``internal_error`` (or a 502 and a
charge), the client charged for an answer it never got.

So could a usage block: a count past 64 bits (orjson reads it as a float, the
gateway took its ``int()``) failed the answer's writing after the charge; a negative
one was served.

Now the parser checks the type of every field the gateway folds, in streamed and
non-streamed answers alike, and the usage counts' range: a wrong one is the upstream's
malformed answer (a 502, or an error frame in a stream), and nothing is charged.
(Each deployment's breaker is set not to open: every request reaches its upstream.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.faults.served import ADMIN_KEY, Served
from tests.support.errors import assert_error_envelope
from tests.support.processes import serve_process
from tests.support.servers import serve_app_in_thread

USER = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
WRONG: dict[str, dict[str, Any]] = {
    "content-number": {"content": 5},
    "content-object": {"content": {"text": "hi"}},
    "refusal-list": {"refusal": ["no"]},
    "reasoning-number": {"reasoning_content": 7},
    "arguments-object": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                         "function": {"name": "f", "arguments": {"a": 1}}}]},
    "index-list": {"tool_calls": [{"index": [0], "id": "c1", "type": "function",
                                   "function": {"name": "f", "arguments": "{}"}}]},
    "usage-huge": {"content": "hi"},
    "usage-negative": {"content": "hi"},
}  # fmt: skip
"""The wrong field of each upstream (its deployment's model name), in its message or delta."""
WRONG_USAGE = {
    "usage-huge": {"prompt_tokens": 5, "completion_tokens": 10**30, "total_tokens": 10**30},
    "usage-negative": {"prompt_tokens": 5, "completion_tokens": -3, "total_tokens": 2},
}
"""Or its usage: a count past any integer orjson writes, a negative one."""


def _dumps(doc: dict[str, Any]) -> bytes:
    """``doc`` as JSON, its integers past 64 bits too (orjson cannot write them)."""
    return json.dumps(doc).encode()


async def _send_json(send: Any, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


async def _upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An OpenAI-compatible upstream whose answer has the wrong type in one field."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"].endswith("/models"):
        data = [{"id": name, "object": "model"} for name in WRONG]
        await _send_json(send, orjson.dumps({"object": "list", "data": data}))
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    req = orjson.loads(raw)
    wrong = WRONG[req["model"]]
    usage = WRONG_USAGE.get(req["model"], USAGE)
    head = {"id": "u", "created": 1, "model": req["model"]}
    if not req.get("stream"):
        choice = {"index": 0, "message": {"role": "assistant", **wrong}, "finish_reason": "stop"}
        answer = {**head, "object": "chat.completion", "usage": usage, "choices": [choice]}
        await _send_json(send, _dumps(answer))
        return
    first = {**head, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"role": "assistant", **wrong}, "finish_reason": None}]}  # fmt: skip
    end = {**head, "object": "chat.completion.chunk", "usage": usage,
           "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}  # fmt: skip
    frames = b"".join(b"data: " + f + b"\n\n" for f in (_dumps(first), _dumps(end), b"[DONE]"))
    await _send_json(send, frames, b"text/event-stream")


def _config(upstream: str) -> str:
    products = "".join(
        f'\n[products.{name}]\nmax_requeues = 0\n[[products.{name}.deployments]]\nengine = "openai"\n'
        f'base_url = "{upstream}/v1"\nmodel = "{name}"\nflavor = "openai"\nfloor = 1.0\nbreaker_threshold = 1000\n'
        for name in WRONG
    )
    return '[server]\nlog_level = "warning"\n' + products


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("types")
    with (
        serve_app_in_thread(_upstream) as upstream,
        serve_process(tmp, "types", _config(upstream), tmp / "data", ADMIN_KEY) as (url, _proc),
    ):
        yield Served(url, tmp / "data", None)


@pytest.fixture(scope="module")
def key(served: Served) -> str:
    [k] = served.accounts("types", 1, 10.0)
    return k


def _balance(served: Served) -> int:
    return int(served.admin("GET", "/admin/accounts/types-0").json()["balance_micros"])


@pytest.mark.parametrize("route", ["chat", "chat-stream", "responses"])
@pytest.mark.parametrize("wrong", list(WRONG))
def test_an_answer_with_a_field_of_the_wrong_type_is_the_upstreams_failure_not_charged(
    served: Served, key: str, wrong: str, route: str, tmp_path: Path
) -> None:
    before = _balance(served)
    auth = {"authorization": f"Bearer {key}"}
    if route == "responses":
        r = httpx.post(served.url + "/v1/responses", headers=auth, timeout=30,
                       json={"model": wrong, "input": "hi", "max_output_tokens": 8})  # fmt: skip
    else:
        body = {"model": wrong, "messages": USER, "max_tokens": 8, "stream": route == "chat-stream"}
        r = httpx.post(served.url + "/v1/chat/completions", headers=auth, json=body, timeout=30)
    assert r.status_code != 500 and "internal_error" not in r.text, r.text
    if route == "chat-stream":
        assert r.status_code == 200, r.text
        frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]", r.text
        error = orjson.loads(frames[-2])["error"]
        assert error["code"] == "upstream_error", error
    else:
        # a usage block comes after the output: not the kind of failure a retry mends
        assert_error_envelope(
            r, 502, "upstream_error", should_retry="false" if wrong in WRONG_USAGE else None
        )
    books = served.at_rest(10)
    books.assert_balanced()
    assert _balance(served) == before, f"charged for an answer the client did not get: {r.text[:300]}"
