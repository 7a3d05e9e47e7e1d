"""POST /v1/responses through the official openai-python client, unchanged, on every
engine kind: not streamed, streamed (typed events with ``sequence_number``), the
``responses.stream(...)`` helper, a function-call round trip, ``previous_response_id``,
reasoning as a reasoning item's summary, the output budget (``incomplete``), stored
responses owned by their account, and unsupported fields named in a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.e2e.jobs.support import unique
from tests.e2e.money.support import new_caller
from tests.e2e.responses.support import PRODUCTS, SERVER, Caller, text_of, types_of
from tests.support.env import ENGINE_KINDS, Env, start_env

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    }
]


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    with start_env(request.param, PRODUCTS, server=SERVER) as e:
        yield e


def _caller(env: Env, prefix: str) -> tuple[Caller, openai.OpenAI]:
    me = new_caller(env.gateway, unique(prefix), 10.0)
    return Caller(env.url, me.key, me.account), env.client(api_key=me.key)


def test_a_response_not_streamed(env: Env) -> None:
    me, client = _caller(env, "unary")
    r = client.responses.create(model="fast", input="Tell me about rivers.", max_output_tokens=50)
    assert r.object == "response" and r.status == "completed", r
    assert r.model == "fast" and r.output_text and r.output[0].type == "message", r
    assert r.usage is not None and r.usage.output_tokens == 6 and r.usage.total_tokens > 6, r.usage
    doc: dict[str, Any] = r.to_dict()
    usage = doc["usage"]
    assert usage["cost_micros"] > 0 and usage["x_market"]["deployment"] == "fast-a", usage
    assert doc["receipt"]["outcome"] == "completed", doc
    record = me.get_raw(f"/v1/usage/{r.id}").json()  # the receipt is the usage record
    assert record["usage"]["cost_micros"] == usage["cost_micros"], record
    assert me.retrieve(r.id) == doc  # stored (store defaults to true)


def test_a_streamed_response_with_the_sdk(env: Env) -> None:
    _, client = _caller(env, "sdk-stream")
    events = list(client.responses.create(model="fast", input="Tell me about rivers.", stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 6,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1]
    assert done.type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert done.response.output_text == deltas and done.response.status == "completed"
    assert done.response.id == events[0].response.id  # type: ignore[union-attr]
    usage: dict[str, Any] = done.response.model_dump()["usage"]
    assert usage["cost_micros"] > 0 and usage["x_market"]["cleared_price"] is not None, usage


def test_the_raw_stream_is_typed_events(env: Env) -> None:
    me, _ = _caller(env, "raw")
    s = me.stream({"model": "fast", "input": "Hi"})
    assert s.status == 200 and s.response.headers["content-type"].startswith("text/event-stream")
    assert s.response.headers["x-request-id"] == s.events[0]["response"]["id"]
    assert b"[DONE]" not in s.raw
    assert all(f.comment is not None for f in s.seen[: s.seen.index(next(f for f in s.seen if f.event))])
    assert types_of(s.events)[-1] == "response.completed"


def test_the_stream_helper(env: Env) -> None:
    _, client = _caller(env, "helper")
    deltas: list[str] = []
    with client.responses.stream(model="fast", input="Hello", instructions="Be brief.") as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) != ""
    assert final.instructions == "Be brief."


def test_a_function_call_round_trip(env: Env) -> None:
    _, client = _caller(env, "tools")
    call = client.responses.create(
        model="fast",
        input="What is the weather in Paris?",
        tools=TOOLS,
        extra_body={"sim": {"tool_call": True}},
    )
    assert call.status == "completed" and len(call.output) == 1, call
    item = call.output[0]
    assert item.type == "function_call" and item.name == "weather", item
    args = json.loads(item.arguments)
    assert set(args) == {"city", "days"}, args
    answer = client.responses.create(
        model="fast",
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": '{"sky": "clear"}'}],
        tools=TOOLS,
    )
    assert answer.status == "completed" and answer.output_text, answer
    # the same round trip without the stored conversation: the call and its output as input items
    stateless = client.responses.create(
        model="fast",
        store=False,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": item.call_id,
                "name": "weather",
                "arguments": item.arguments,
            },
            {"type": "function_call_output", "call_id": item.call_id, "output": '{"sky": "clear"}'},
        ],
        tools=TOOLS,
    )
    assert stateless.output_text == answer.output_text  # the same conversation, the same (seeded) answer


def test_a_streamed_function_call(env: Env) -> None:
    me, _ = _caller(env, "tool-stream")
    s = me.stream({"model": "fast", "input": "Weather?", "tools": TOOLS, "sim": {"tool_call": True}})
    events = s.events
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "weather", added
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == deltas and json.loads(deltas), done
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["arguments"] == deltas, final


def test_previous_response_id_prepends_the_stored_conversation(env: Env) -> None:
    _, client = _caller(env, "chain")
    first = client.responses.create(model="fast", input="First question.", instructions="Answer briefly.")
    second = client.responses.create(model="fast", input="Second question.", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.instructions is None  # not carried over
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens, (first.usage, second.usage)
    # the engine saw the whole conversation: the same conversation sent whole gets the same answer
    whole = client.responses.create(
        model="fast",
        store=False,
        input=[
            {"role": "user", "content": "First question."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Second question."},
        ],
    )
    assert whole.output_text == second.output_text
    third = client.responses.create(model="fast", input="Third.", previous_response_id=second.id)
    assert third.usage is not None and third.usage.input_tokens > second.usage.input_tokens


def test_an_item_reference_names_a_stored_output_item(env: Env) -> None:
    me, client = _caller(env, "ref")
    other, _ = _caller(env, "ref-other")
    first = client.responses.create(model="fast", input="First question.")
    ref = first.output[0].id
    assert ref is not None
    second = client.responses.create(
        model="fast",
        store=False,
        input=[
            {"role": "user", "content": "First question."},
            {"type": "item_reference", "id": ref},
            {"role": "user", "content": "Second question."},
        ],
    )
    whole = client.responses.create(
        model="fast",
        store=False,
        input=[
            {"role": "user", "content": "First question."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Second question."},
        ],
    )
    assert second.output_text == whole.output_text  # the engine saw the referenced answer
    for bad in (ref + "0", "msg_nothing", "anything"):
        r = me.create_raw({"model": "fast", "input": [{"type": "item_reference", "id": bad}]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "input.0.id", r.text
    theirs = other.create_raw({"model": "fast", "input": [{"type": "item_reference", "id": ref}]})
    assert theirs.status_code == 404, theirs.text


def test_reasoning_is_a_reasoning_item_with_its_summary(env: Env) -> None:
    me, _ = _caller(env, "think")
    s = me.stream({"model": "think", "input": "Think first."})
    types = types_of(s.events)
    for t in ("response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
              "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"):  # fmt: skip
        assert t in types, types
    final = s.events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"], final["output"]
    summary = "".join(e["delta"] for e in s.events if e["type"] == "response.reasoning_summary_text.delta")
    assert final["output"][0]["summary"] == [{"type": "summary_text", "text": summary}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 6, final["usage"]


def test_the_output_budget_makes_it_incomplete(env: Env) -> None:
    me, client = _caller(env, "budget")
    r = client.responses.create(model="fast", input="Hello", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details is not None, r
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage is not None
    assert r.usage.output_tokens == 3
    s = me.stream({"model": "fast", "input": "Hello", "max_output_tokens": 3})
    assert types_of(s.events)[-1] == "response.incomplete" and len(text_of(s.events).split()) == 3


def test_stored_responses_are_the_accounts_own(env: Env) -> None:
    me, client = _caller(env, "own")
    other, _ = _caller(env, "other")
    r = client.responses.create(
        model="fast", input=[{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}],
        metadata={"ticket": "42"},
    )  # fmt: skip
    assert r.metadata == {"ticket": "42"}
    for path in (f"/v1/responses/{r.id}", f"/v1/responses/{r.id}/input_items"):
        denied = other.get_raw(path)
        assert denied.status_code == 404 and denied.json()["error"]["code"] == "not_found", denied.text
    chained = other.create_raw({"model": "fast", "input": "Hi", "previous_response_id": r.id})
    assert chained.status_code == 404 and chained.json()["error"]["param"] == "previous_response_id"
    items = client.responses.input_items.list(r.id, order="asc")
    assert [i.model_dump()["content"][0]["text"] for i in items.data] == ["One.", "Two."]
    newest = me.get_raw(f"/v1/responses/{r.id}/input_items", limit=1).json()
    assert newest["has_more"] is True and newest["data"][0]["content"][0]["text"] == "Two.", newest
    client.responses.delete(r.id)
    assert me.get_raw(f"/v1/responses/{r.id}").status_code == 404
    unstored = client.responses.create(model="fast", input="Forget me.", store=False)
    assert (
        unstored.model_dump()["store"] is False
        and me.get_raw(f"/v1/responses/{unstored.id}").status_code == 404
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0.type"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content",
        ),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"background": True, "store": False}, "background"),
    ],
)
def test_an_unsupported_field_is_a_400_that_names_it(env: Env, extra: dict[str, Any], param: str) -> None:
    me, _ = _caller(env, "bad")
    r = me.create_raw({"model": "fast", "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    assert err["type"] == "invalid_request_error" and r.headers["x-should-retry"] == "false"
