"""The response shapes the gateway builds itself (``bourse.wire.chunks``): the
aggregated non-streamed answer and the usage chunk (the error frames: test_error_frames.py)."""

from __future__ import annotations

from typing import Any

import pytest

from bourse.domain.errors import GatewayError
from bourse.wire.chunks import CHAT, CHAT_CHUNK, TEXT, Aggregator, usage_chunk

RID = "chatcmpl-abc"
CREATED = 1_700_000_000


def _chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
    return {"id": "up", "object": CHAT_CHUNK, "choices": [choice]}


def _text_chunk(text: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, **extra}
    return {"id": "up", "object": TEXT, "choices": [choice]}


def _text_logprobs(token: str, offset: int, logprob: float) -> dict[str, list[Any]]:
    """A legacy completion chunk's ``logprobs``: one token (as llama-cpp-python and vLLM stream them)."""
    return {
        "tokens": [token],
        "token_logprobs": [logprob],
        "top_logprobs": [{token: logprob}],
        "text_offset": [offset],
    }


# -- Aggregator ------------------------------------------------------------------------------


def test_chat_content_is_joined_with_the_last_finish_reason() -> None:
    agg = Aggregator("chat")
    for chunk in (
        _chat_chunk({"role": "assistant", "content": "Hel"}),
        _chat_chunk({"content": "lo"}),
        _chat_chunk({}, "stop"),
        {"id": "up", "object": CHAT_CHUNK, "choices": []},  # the engine's usage chunk: no choice
    ):
        agg.add(chunk)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert agg.text == "Hello"
    assert agg.build(RID, "p", CREATED, usage) == {
        "id": RID,
        "object": CHAT,
        "created": CREATED,
        "model": "p",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": usage,
    }


def test_no_usage_leaves_the_key_out_and_a_fingerprint_is_kept() -> None:
    agg = Aggregator("chat")
    agg.add({**_chat_chunk({"content": "x"}, "stop"), "system_fingerprint": "fp_1"})
    doc = agg.build(RID, "p", CREATED, None)
    assert "usage" not in doc
    assert doc["system_fingerprint"] == "fp_1"


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_and_refusal_are_joined_under_their_names(key: str) -> None:
    agg = Aggregator("chat", reasoning_key=key)
    agg.add(_chat_chunk({key: "think "}))
    agg.add(_chat_chunk({key: "more"}))
    agg.add(_chat_chunk({"refusal": "no"}))
    agg.add(_chat_chunk({"content": "ok"}, "stop"))
    message = agg.build(RID, "p", CREATED, None)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "ok", key: "think more", "refusal": "no"}


def test_tool_call_fragments_are_assembled_by_index() -> None:
    agg = Aggregator("chat")
    fragments = [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_", "arguments": ""}},
        {"index": 1, "id": "call_b", "function": {"name": "get_time", "arguments": "{}"}},
        {"index": 0, "function": {"name": "weather", "arguments": '{"city": '}},
        {"index": 0, "function": {"arguments": '"Oslo"}'}},
    ]
    for tc in fragments:
        agg.add(_chat_chunk({"tool_calls": [tc]}))
    agg.add(_chat_chunk({}, "tool_calls"))
    choice = agg.build(RID, "p", CREATED, None)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,  # only tool calls: no content
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }


def test_chat_logprobs_are_concatenated() -> None:
    agg = Aggregator("chat")
    agg.add(_chat_chunk({"content": "a"}, logprobs={"content": [{"token": "a", "logprob": -0.1}]}))
    agg.add(_chat_chunk({"content": "b"}, "stop", logprobs={"content": [{"token": "b", "logprob": -0.2}]}))
    choice = agg.build(RID, "p", CREATED, None)["choices"][0]
    assert choice["logprobs"] == {
        "content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]
    }


def test_legacy_completion_text_is_joined() -> None:
    agg = Aggregator("completion")
    for chunk in (_text_chunk("Once"), _text_chunk(" upon"), _text_chunk("", "length")):
        agg.add(chunk)
    doc = agg.build("cmpl-1", "p", CREATED, None)
    assert doc["object"] == TEXT
    assert doc["choices"] == [{"index": 0, "text": "Once upon", "logprobs": None, "finish_reason": "length"}]


def test_legacy_completion_logprobs_are_concatenated_list_by_list() -> None:
    """OpenAI's non-streamed legacy shape: one ``logprobs`` object whose four lists run
    over the whole text (the streamed ``text_offset``s already count from the same start)."""
    agg = Aggregator("completion")
    agg.add(_text_chunk("Once", logprobs=_text_logprobs("Once", 5, -0.5)))
    agg.add(_text_chunk(" upon", logprobs=_text_logprobs(" upon", 9, -0.25)))
    agg.add(_text_chunk("", "length"))  # the finish chunk carries none
    choice = agg.build("cmpl-1", "p", CREATED, None)["choices"][0]
    assert choice["text"] == "Once upon"
    assert choice["logprobs"] == {
        "tokens": ["Once", " upon"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Once": -0.5}, {" upon": -0.25}],
        "text_offset": [5, 9],
    }


def test_a_non_streamed_legacy_answers_logprobs_are_kept_whole() -> None:
    """The ``openai`` engine hands a non-streamed answer on as one chunk: its lists as they are."""
    whole = {"tokens": ["a", "b"], "token_logprobs": [None, -1.0], "top_logprobs": [None, {"b": -1.0}],
             "text_offset": [0, 1]}  # fmt: skip
    agg = Aggregator("completion")
    agg.add(_text_chunk("ab", "stop", logprobs=whole))
    assert agg.build("cmpl-1", "p", CREATED, None)["choices"][0]["logprobs"] == whole


def test_an_empty_answer_is_empty_content() -> None:
    choice = Aggregator("chat").build(RID, "p", CREATED, None)["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ""}
    assert choice["finish_reason"] is None


# -- usage chunk and error frame -------------------------------------------------------------


@pytest.mark.parametrize(("kind", "obj"), [("chat", CHAT_CHUNK), ("completion", TEXT)])
@pytest.mark.parametrize("name", ["receipt", "hips"])
def test_usage_chunk_has_no_choices_and_the_named_receipt(kind: str, obj: str, name: str) -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    receipt = {"cost_micros": 3}
    assert usage_chunk(kind, RID, "p", CREATED, usage, name, receipt) == {
        "id": RID,
        "object": obj,
        "created": CREATED,
        "model": "p",
        "choices": [],
        "usage": usage,
        name: receipt,
    }


ERR = GatewayError(502, "upstream_error", "the engine failed")
ENVELOPE = {"message": "the engine failed", "type": "upstream_error", "param": None, "code": "upstream_error"}
