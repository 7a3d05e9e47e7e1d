"""The Responses API's wire logic, pure: the request's translation to chat (and back, for
an upstream that speaks it), the builder's events and output, item ids and references."""

from __future__ import annotations

from typing import Any

import pytest

from bourse.domain.errors import GatewayError
from bourse.wire.responses import (
    ResponseBuilder,
    UpstreamEvents,
    chat_body,
    chat_messages,
    input_items,
    parse_request,
    referenced,
    response_object,
    response_usage,
    upstream_request,
)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_items_become_chat_messages_with_calls_joined_to_their_turn() -> None:
    req = parse_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Rules."},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {"role": "assistant", "content": "Let me look."},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "two"}],
                },
                {"type": "reasoning", "summary": []},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "max_price": 0.5,
        }
    )
    body = chat_body(req, [], input_items(req))
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool", "tool"], body["messages"]
    assert body["messages"][2]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assistant = body["messages"][3]
    assert assistant["content"] == "Let me look." and [c["id"] for c in assistant["tool_calls"]] == [
        "c1",
        "c2",
    ]
    assert body["messages"][5] == {"role": "tool", "tool_call_id": "c2", "content": "two"}
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["max_tokens"] == 9 and body["max_price"] == 0.5 and body["stream"] is False
    assert body["response_format"]["json_schema"]["name"] == "x"


def test_a_string_input_is_one_user_message_with_an_id() -> None:
    req = parse_request({"model": "m", "input": "hi"})
    (item,) = input_items(req)
    assert item["id"].startswith("msg_") and item["content"] == [{"type": "input_text", "text": "hi"}]
    assert chat_messages([item]) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"input": "x", "store": False, "background": True}, "background"),
        ({"input": "x", "unknown": 1}, "unknown"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input.0.name"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ],
)
def test_a_bad_request_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as err:
        parse_request({"model": "m", **body})
    assert err.value.status == 400 and err.value.param == param, err.value


def _builder(events: bool = True) -> ResponseBuilder:
    req = parse_request({"model": "m", "input": "x"})
    return ResponseBuilder(response_object("resp-1", req, "m", 1, "in_progress"), events=events)


def test_the_builder_streams_reasoning_text_and_calls_in_order() -> None:
    b = _builder()
    b.add(_chunk({"role": "assistant", "reasoning_content": "think"}))
    b.add(_chunk({"content": "Hel"}))
    b.add(_chunk({"content": "lo"}))
    b.add(
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": '{"a"'}}]})
    )
    b.add(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"))
    final = b.finish({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "cost_micros": 8})
    events = b.take()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events if e["type"].endswith(("added", "done"))][:4] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert events[0]["response"]["status"] == "in_progress"  # a snapshot, not the final object
    out = final["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert [i["id"] for i in out] == ["rs_resp-1_0", "msg_resp-1_1", "fc_resp-1_2"]
    assert out[1]["content"][0]["text"] == "Hello" and out[2]["arguments"] == '{"a": 1}'
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["cost_micros"] == 8
    assert referenced(out[2]["id"]) == ("resp-1", 2) and referenced("msg_abc") is None


def test_the_output_budget_and_failures_end_the_response() -> None:
    b = _builder(events=False)
    b.add(_chunk({"content": "a"}, "length"))
    cut = b.finish(None)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete" and b.take() == []
    failed = _builder()
    failed.finish({}, {"code": "book_timeout", "message": "waited"})
    assert [e["type"] for e in failed.take()] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]


def test_usage_in_the_responses_api_names() -> None:
    usage = response_usage(
        {
            "prompt_tokens": 4,
            "completion_tokens": 6,
            "total_tokens": 10,
            "prompt_tokens_details": {"cached_tokens": 2},
            "completion_tokens_details": {"reasoning_tokens": 1},
            "x_market": {"bid": 1.0},
            "cost": 0.0001,
        }
    )
    assert usage == {
        "input_tokens": 4, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 10, "cost": 0.0001,
        "x_market": {"bid": 1.0},
    }  # fmt: skip


def test_a_chat_request_for_an_upstream_that_speaks_the_responses_api() -> None:
    chat = {
        "model": "front",
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"},
        ],
        "max_tokens": 5, "seed": 1, "sim": {}, "tools": [{"type": "function", "function": {"name": "f"}}],
    }  # fmt: skip
    body = upstream_request(chat, "up")
    assert body["model"] == "up" and body["stream"] is True and body["store"] is False
    assert body["max_output_tokens"] == 5 and "seed" not in body and "sim" not in body
    assert [i.get("type", "message") for i in body["input"]] == ["message", "message", "function_call",
                                                                  "function_call_output"]  # fmt: skip
    assert body["input"][1]["content"] == [{"type": "input_text", "text": "q"}]
    assert body["tools"] == [{"type": "function", "name": "f"}]


def test_an_upstreams_events_as_chat_chunks() -> None:
    up = UpstreamEvents()
    item = {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": ""}
    chunks = [
        up.chunk({"type": "response.created", "response": {}}),
        up.chunk({"type": "response.reasoning_summary_text.delta", "delta": "r"}),
        up.chunk({"type": "response.output_text.delta", "delta": "t"}),
        up.chunk({"type": "response.output_item.added", "item": item}),
        up.chunk({"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": "{}"}),
        up.chunk(
            {"type": "response.completed", "response": {"usage": {"input_tokens": 2, "output_tokens": 3}}}
        ),
    ]
    assert chunks[0] is None and up.done
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c is not None]
    assert deltas[:2] == [{"reasoning_content": "r"}, {"content": "t"}]
    assert (
        deltas[2]["tool_calls"][0]["id"] == "c"
        and deltas[3]["tool_calls"][0]["function"]["arguments"] == "{}"
    )
    last = chunks[-1]
    assert last is not None and last["choices"][0]["finish_reason"] == "tool_calls"
    assert up.usage is not None and (up.usage["prompt_tokens"], up.usage["completion_tokens"]) == (2, 3)
    failing = UpstreamEvents()
    assert (
        failing.chunk({"type": "response.failed", "response": {"status": "failed", "error": {"code": "x"}}})
        is None
    )
    assert failing.error is not None and failing.error["code"] == "x"
