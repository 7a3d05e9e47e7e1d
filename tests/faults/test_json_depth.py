"""JSON nesting is bounded before any money moves (``[server] max_json_depth``), and
nothing a client is charged for fails to reach it, through a served ``bourse serve``
process on SQLite and PostgreSQL.

Before the bound:

- ``POST /v1/responses`` with a ``text.format.schema`` nested 130 levels ran, was
  charged, and answered 500 (the access log said 200): the response object echoes the
  schema and orjson cannot write past 254 levels, so neither the answer nor the stored
  response could be written; streamed, the connection broke before
  ``response.created``, charged as well;
- a job whose body's ``metadata`` nested ~260 levels was a 500 (the job's row could
  not be written);
- an ``openai`` upstream whose answer nested too deep (its ``logprobs``) was charged
  and answered 500, or a broken stream.

Now a body nested deeper than the limit is a 400 naming the limit and the field, on
every route that reads JSON (orjson's own refusal past 1024 levels too), before the
key's hold; what the gateway keeps of a request is written once before the hold; an
upstream answer nested deeper than anything the gateway writes is the upstream's
failure (a 502, or an error frame, by the product's policy: not charged). After every
test the books balance and no charge is without its answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.faults.databases import DATABASES, database
from tests.faults.served import ADMIN, ADMIN_KEY, Served
from tests.support.errors import assert_error_envelope
from tests.support.processes import serve_process
from tests.support.servers import serve_app_in_thread

LIMIT = 64
USER = [{"role": "user", "content": "hi"}]


LOGPROBS = {"content": [{"token": "hi", "logprob": -1.0, "top_logprobs": "DEEP"}]}
USAGE = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def _too_deep(doc: dict[str, Any]) -> bytes:
    """``doc`` with its ``logprobs`` nesting 300 levels (written by hand: orjson cannot)."""
    return orjson.dumps(doc).replace(b'"DEEP"', b"[" * 300 + b"]" * 300)


async def _deep_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An OpenAI-compatible upstream whose streamed answers nest too deep."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"].endswith("/models"):
        body = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    if not orjson.loads(raw).get("stream"):  # one answer
        answer = {"id": "u", "object": "chat.completion", "created": 1, "model": "m", "usage": USAGE, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", "logprobs": LOGPROBS}]}  # fmt: skip
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": _too_deep(answer)})
        return
    first = {"id": "u", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None, "logprobs": LOGPROBS}]}  # fmt: skip
    end = {"id": "u", "object": "chat.completion.chunk", "created": 1, "model": "m", "usage": USAGE,
           "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}  # fmt: skip
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    for frame in (_too_deep(first), orjson.dumps(end), b"[DONE]"):
        await send({"type": "http.response.body", "body": b"data: " + frame + b"\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _config(upstream: str) -> str:
    return f"""
[server]
max_json_depth = {LIMIT}

[products.h]
max_output_tokens = 64
[[products.h.deployments]]
engine = "sim"
slots = 4
floor = 1.0

[products.deep]
max_requeues = 0
[[products.deep.deployments]]
engine = "openai"
base_url = "{upstream}/v1"
model = "m"
flavor = "openai"
floor = 1.0
"""


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_app_in_thread(_deep_upstream) as url:
        yield url


@pytest.fixture(scope="module", params=DATABASES)
def served(
    request: pytest.FixtureRequest, upstream: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("depth")
    with (
        database(request.param) as dsn,
        serve_process(tmp, "depth", _config(upstream), tmp / "data", ADMIN_KEY, database=dsn) as (url, _proc),
    ):
        yield Served(url, tmp / "data", dsn)


@pytest.fixture(scope="module")
def key(served: Served) -> str:
    [k] = served.accounts("depth", 1, 10.0)
    return k


@pytest.fixture(autouse=True)
def balanced_books(served: Served) -> Iterator[None]:
    yield
    served.at_rest(10).assert_balanced()


def _log_lines(served: Served) -> str:
    """The gateway's log so far (its access log is written in batches: a second)."""
    time.sleep(1.2)
    logs = sorted(served.data_dir.parent.glob("depth-*.log"), key=lambda p: p.stat().st_mtime)
    return logs[-1].read_text()


def _access_status(served: Served, request_id: str) -> str:
    lines = [
        line for line in _log_lines(served).splitlines() if "bourse.access" in line and request_id in line
    ]
    assert lines, f"no access log line for {request_id}"
    return lines[-1].split("status=", 1)[1].split()[0]


def _post(served: Served, key: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    # the standard library's encoder: orjson's stops at 254 levels
    return httpx.post(served.url + path, content=json.dumps(body).encode(), timeout=30,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"}, **kw)  # fmt: skip


def _schema(levels: int) -> dict[str, Any]:
    """A JSON schema of ``levels`` objects one in another (two JSON levels each)."""
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def _nested(levels: int) -> Any:
    v: Any = 1
    for i in range(levels):
        v = {"a": v} if i % 2 else [v]
    return v


def _money(served: Served, account: str = "depth-0") -> tuple[int, int]:
    """The account's balance and its number of holds (every state)."""
    a = served.admin("GET", f"/admin/accounts/{account}").json()
    holds = served.admin("GET", "/admin/holds", params={"account": account, "limit": "100"}).json()["data"]
    return a["balance_micros"], len(holds)


def _assert_too_deep(r: httpx.Response, param: str | None) -> None:
    err = assert_error_envelope(r, 400, "invalid_request")
    assert f"nested deeper than {LIMIT} levels" in err["message"], err
    assert err["param"] == param, err


# -- item 5: a response charged, then a 500 --------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_response_with_a_schema_nested_130_levels_is_a_400_before_any_hold(
    served: Served, key: str, stream: bool
) -> None:
    before = _money(served)
    body = {"model": "h", "input": "hi", "max_output_tokens": 8, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "deep", "schema": _schema(130)}}}  # fmt: skip
    r = _post(served, key, "/v1/responses", body)
    _assert_too_deep(r, "text.format.schema")
    assert _money(served) == before, "a refused request moved money or placed a hold"
    assert _access_status(served, r.headers["x-request-id"]) == "400"


def test_a_response_within_the_limit_is_answered_and_stored(served: Served, key: str) -> None:
    body = {"model": "h", "input": "hi", "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", "name": "ok", "schema": _schema(25)}}}  # fmt: skip
    r = _post(served, key, "/v1/responses", body)
    assert r.status_code == 200, r.text
    doc = r.json()
    stored = httpx.get(
        f"{served.url}/v1/responses/{doc['id']}", headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    assert stored.status_code == 200 and stored.json()["text"] == body["text"], stored.text
    assert _access_status(served, r.headers["x-request-id"]) == "200"


# -- item 7: a job's metadata ----------------------------------------------------------------


def test_a_job_with_metadata_nested_260_levels_is_a_400_before_any_hold(served: Served, key: str) -> None:
    before = _money(served)
    chat = {"model": "h", "messages": USER, "max_tokens": 4, "metadata": _nested(260)}
    r = _post(served, key, "/v1/jobs", {"endpoint": "/v1/chat/completions", "body": chat})
    _assert_too_deep(r, "body.metadata")
    r = _post(served, key, "/v1/chat/completions", {**chat, "detached": True})
    _assert_too_deep(r, "metadata")
    assert _money(served) == before


# -- every body, every nested schema ---------------------------------------------------------

DEEP = _nested(LIMIT + 1)
"""One level past the limit: the body's top object is the first."""


def _bodies() -> list[tuple[str, str, Any, str | None]]:
    """(path, key: user or admin, a body one level too deep, the field it names)."""
    chat = {"model": "h", "messages": USER, "max_tokens": 4}
    schema = _schema(40)
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    response_tool = {"type": "function", "name": "f", "parameters": schema}
    job = {"endpoint": "/v1/chat/completions", "body": {**chat, "tools": [chat_tool]}}
    return [
        ("/v1/chat/completions", "user", {**chat, "metadata": DEEP}, "metadata"),
        (
            "/v1/chat/completions",
            "user",
            {**chat, "response_format": response_format},
            "response_format.json_schema.schema",
        ),
        ("/v1/chat/completions", "user", {**chat, "tools": [chat_tool]}, "tools.0.function.parameters"),
        ("/v1/completions", "user", {"model": "h", "prompt": "hi", "max_tokens": 4, "x": DEEP}, "x"),
        (
            "/v1/responses",
            "user",
            {"model": "h", "input": "hi", "tools": [response_tool]},
            "tools.0.parameters",
        ),
        ("/v1/responses", "user", {"model": "h", "input": "hi", "metadata": {"m": DEEP}}, "metadata"),
        ("/v1/jobs", "user", job, "body.tools.0.function.parameters"),
        ("/admin/accounts", "admin", {"id": "never", "credit_usd": 1, "x": DEEP}, "x"),
        ("/admin/keys", "admin", {"account": "depth-0", "products": DEEP}, "products"),
        ("/admin/accounts/depth-0/credit", "admin", {"amount_usd": 1, "memo": DEEP}, "memo"),
        ("/dashboard/api/session", "none", {"key": DEEP}, "key"),
    ]


@pytest.mark.parametrize(
    ("path", "who", "body", "param"), _bodies(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_body_one_level_too_deep_is_a_400_naming_the_limit(
    served: Served, key: str, path: str, who: str, body: Any, param: str | None
) -> None:
    before = _money(served)
    headers = {"content-type": "application/json"}
    headers.update(ADMIN if who == "admin" else {"authorization": f"Bearer {key}"} if who == "user" else {})
    r = httpx.post(served.url + path, content=json.dumps(body).encode(), headers=headers, timeout=30)
    _assert_too_deep(r, param)
    assert _money(served) == before


@pytest.mark.parametrize("levels", [1025, 100_000])
def test_a_body_past_orjsons_own_limit_is_the_same_400(served: Served, key: str, levels: int) -> None:
    raw = b'{"model": "h", "messages": ' + b"[" * levels + b"]" * levels + b"}"
    r = httpx.post(served.url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"authorization": f"Bearer {key}", "content-type": "application/json"})  # fmt: skip
    _assert_too_deep(r, None)


def test_a_body_exactly_at_the_limit_is_served(served: Served, key: str) -> None:
    body = {"model": "h", "messages": USER, "max_tokens": 4, "metadata": _nested(LIMIT - 1)}
    r = _post(served, key, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text


# -- an upstream's answer too deep to write --------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_upstream_answer_nested_too_deep_is_its_failure_and_not_charged(
    served: Served, key: str, stream: bool
) -> None:
    before = _money(served)
    body = {"model": "deep", "messages": USER, "max_tokens": 4, "logprobs": True, "stream": stream}
    r = _post(served, key, "/v1/chat/completions", body)
    rid = r.headers["x-request-id"]
    if stream:
        assert r.status_code == 200
        frames = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]", r.text
        error = orjson.loads(frames[-2])["error"]
    else:
        error = assert_error_envelope(r, 502, "upstream_error")
    assert "nested deeper than" in error["message"], error
    served.at_rest(10)
    balance, holds = _money(served)
    assert balance == before[0], "charged for an answer the client did not get"
    assert holds == before[1] + 1
    usage = httpx.get(f"{served.url}/v1/usage/{rid}", headers={"authorization": f"Bearer {key}"}, timeout=30)
    assert usage.status_code == 200 and usage.json()["receipt"]["cost_micros"] == 0, usage.text
    assert _access_status(served, rid) == ("200" if stream else "502")
