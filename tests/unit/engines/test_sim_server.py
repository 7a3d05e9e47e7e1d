"""The sim upstream's HTTP face over a real socket: SSE framing, aggregation, errors, stats."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from tests.support.servers import serve_app_in_thread

from bourse.engines.sim import SimSettings
from bourse.engines.sim_server import create_sim_app

CHAT = {"model": "sim-upstream", "messages": [{"role": "user", "content": "hello there"}], "seed": 21}
TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with serve_app_in_thread(create_sim_app(SimSettings())) as url, httpx.Client(base_url=url) as client:
        yield client


def _events(text: str) -> list[Any]:
    assert text.endswith("\n\n")
    frames = text[:-2].split("\n\n")
    assert all(f.startswith("data: ") for f in frames)
    return [f[6:] if f[6:] == "[DONE]" else orjson.loads(f[6:]) for f in frames]


def _stream_content(events: list[Any]) -> str:
    return "".join(
        e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e["choices"]
    )


def _wait_for_stats(client: httpx.Client, expected: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + 1.0
    stats: dict[str, int] = client.get("/sim/stats").json()
    while stats != expected and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = client.get("/sim/stats").json()
    return stats


def test_stream_and_non_stream_give_the_same_text(client: httpx.Client) -> None:
    streamed = client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        headers={"x-request-id": "rid-1"},
    )
    assert streamed.status_code == 200
    assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert streamed.headers["x-request-id"] == "rid-1"
    events = _events(streamed.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["id"] == "rid-1"
    chunks = events[:-2]
    assert all(c["id"] == "rid-1" and c["model"] == "sim-upstream" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    whole = client.post("/v1/chat/completions", json=CHAT)
    assert whole.status_code == 200
    answer = whole.json()
    assert answer["object"] == "chat.completion"
    assert answer["id"].startswith("chatcmpl-")
    assert whole.headers["x-request-id"] == answer["id"]
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": _stream_content(events)}
    assert choice["finish_reason"] == "stop"
    assert answer["usage"] == usage_chunk["usage"]
    assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"] + len(chunks)


def test_usage_chunk_only_when_asked(client: httpx.Client) -> None:
    events = _events(client.post("/v1/chat/completions", json={**CHAT, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] for e in events[:-1])
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "sim": {"omit_usage": True}}
    events = _events(client.post("/v1/chat/completions", json=body).text)
    assert all(e["choices"] for e in events[:-1])


def test_non_stream_tool_call_and_reasoning(client: httpx.Client) -> None:
    body = {**CHAT, "tools": TOOLS, "sim": {"tool_call": True, "reasoning": True}}
    answer = client.post("/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] is None
    assert len(message["reasoning_content"].split()) == 6
    [call] = message["tool_calls"]
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert set(orjson.loads(call["function"]["arguments"])) == {"city", "days"}


def test_completions(client: httpx.Client) -> None:
    body = {"model": "sim-upstream", "prompt": "say something", "seed": 4, "max_tokens": 5}
    answer = client.post("/v1/completions", json=body).json()
    assert answer["object"] == "text_completion"
    assert answer["id"].startswith("cmpl-")
    assert answer["choices"][0]["finish_reason"] == "length"
    assert len(answer["choices"][0]["text"].split()) == 5
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    events = _events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == answer["choices"][0]["text"]
    assert all(e["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize("stream", [True, False])
def test_failure_before_output_is_a_503(client: httpx.Client, stream: bool) -> None:
    body = {**CHAT, "stream": stream, "sim": {"fail_before_output": 1}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 503
    assert response.json() == {
        "error": {
            "message": "simulated failure before output",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    }
    retried = client.post("/v1/chat/completions", json=body, headers={"x-bourse-attempt": "1"})
    assert retried.status_code == 200


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({**CHAT, "stream": True, "sim": {"nope": 1}}, {}),
        ({**CHAT, "sim": {"nope": 1}}, {}),
        (CHAT, {"x-bourse-attempt": "first"}),
    ],
)
def test_bad_requests_are_400(client: httpx.Client, body: dict[str, Any], headers: dict[str, str]) -> None:
    response = client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_request"


def test_invalid_json_is_400(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", content=b"{nope")
    assert response.status_code == 400


def test_failure_after_output_sends_an_error_frame_without_done(client: httpx.Client) -> None:
    body = {**CHAT, "stream": True, "sim": {"fail_after_tokens": 2}}
    events = _events(client.post("/v1/chat/completions", json=body).text)
    assert len(events) == 3
    assert events[-1] == {
        "error": {
            "message": "simulated failure after 2 tokens",
            "type": "server_error",
            "code": "upstream_error",
        }
    }


def test_disconnect_during_a_stall_cancels_promptly(client: httpx.Client) -> None:
    client.post("/sim/reset")
    body = {**CHAT, "stream": True, "sim": {"stall_after_tokens": 1, "stall_s": 30}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    assert _wait_for_stats(
        client, {"started": 1, "completed": 0, "cancelled": 1, "running": 0, "peak_running": 1}
    ) == {
        "started": 1,
        "completed": 0,
        "cancelled": 1,
        "running": 0,
        "peak_running": 1,
    }


def test_disconnect_before_the_first_token_cancels(client: httpx.Client) -> None:
    client.post("/sim/reset")
    body = {**CHAT, "stream": True, "sim": {"ttft_ms": 30000}}
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=body, timeout=0.2)
    assert (
        _wait_for_stats(
            client, {"started": 1, "completed": 0, "cancelled": 1, "running": 0, "peak_running": 1}
        )["cancelled"]
        == 1
    )


def test_stats_reset_models_and_health(client: httpx.Client) -> None:
    client.post("/sim/reset")
    client.post("/v1/chat/completions", json=CHAT)
    assert client.get("/sim/stats").json() == {
        "started": 1,
        "completed": 1,
        "cancelled": 0,
        "running": 0,
        "peak_running": 1,
    }
    assert client.post("/sim/reset").json() == {
        "started": 0,
        "completed": 0,
        "cancelled": 0,
        "running": 0,
        "peak_running": 0,
    }
    assert client.get("/sim/stats").json() == {
        "started": 0,
        "completed": 0,
        "cancelled": 0,
        "running": 0,
        "peak_running": 0,
    }
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sim-upstream"]
    assert client.get("/healthz").json() == {"status": "ok"}
