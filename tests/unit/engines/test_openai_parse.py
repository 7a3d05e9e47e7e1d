"""The parse step's reading of a chunk's choices: what counts as tokens, what ends the
answer, what is malformed (one pass over the choices: :func:`read_choices`)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bourse.engines.openai_parse import StreamParse
from bourse.ports.engine import EngineFailure


def _failure_of(error: object, output_began: bool) -> EngineFailure:
    return EngineFailure("error", transient=not output_began)


def _read(choices: Any) -> tuple[int | None, bool, bool]:
    """One chunk with ``choices`` through a stream's parse step: its event's tokens (None:
    no event), whether the parse saw a finish_reason, whether it found it malformed."""
    parse = StreamParse(_failure_of)
    events = parse.events(b"data: " + orjson.dumps({"id": "c", "choices": choices}) + b"\n\n")
    return (events[0].tokens if events else None), parse.finished, parse.failure is not None


TOOL = {"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("choices", "tokens", "finished"),
    [
        ([{"index": 0, "delta": {"role": "assistant"}}], 0, False),
        ([{"index": 0, "delta": {"role": "assistant", "content": "hi"}}], 1, False),
        ([{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}], 0, True),
        ([{"index": 0, "delta": {"content": None}, "finish_reason": ""}], 0, False),
        ([{"index": 0, "delta": {"reasoning_content": "r"}}], 1, False),
        ([{"index": 0, "delta": {"reasoning": "r"}}], 1, False),
        ([{"index": 0, "delta": {"refusal": "no"}}], 0, False),
        ([{"index": 0, "delta": {"tool_calls": [TOOL]}}], 1, False),
        ([{"index": 0, "delta": {"tool_calls": []}}], 0, False),
        ([{"index": 0, "delta": {}, "text": "ignored beside a delta"}], 0, False),
        ([{"index": 0, "text": "legacy"}], 1, False),
        ([{"index": 0, "text": ""}, {"index": 1, "text": "x", "finish_reason": "length"}], 1, True),
    ],
)
def test_a_chunks_tokens_and_finish(choices: list[dict[str, Any]], tokens: int, finished: bool) -> None:
    assert _read(choices) == (tokens, finished, False)


@pytest.mark.parametrize(
    "choices",
    [
        "text",
        [1],
        [{"finish_reason": 1}],
        [{"text": 2}],
        [{"delta": []}],
        [{"delta": {"content": 3}}],
        [{"delta": {"refusal": ["r"]}}],
        [{"delta": {"tool_calls": {}}}],
        [{"delta": {"tool_calls": [{**TOOL, "index": "0"}]}}],
        [{"delta": {"tool_calls": [{**TOOL, "function": {"name": 1}}]}}],
    ],
)
def test_a_malformed_choice_is_the_upstreams_malformed_chunk(choices: Any) -> None:
    tokens, _, malformed = _read(choices)  # (the stream fails: whether it finished is moot)
    assert (tokens, malformed) == (None, True)


def test_no_choices_is_no_event() -> None:
    assert _read([]) == (None, False, False)
