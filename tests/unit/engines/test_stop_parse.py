"""The openai engine's parse step for a counted stream whose stop strings bourse applies
itself (``StopParse``): every token counted, the text cut before the stop string, the
chunk that completed it ending the answer."""

from __future__ import annotations

import orjson

from bourse.engines.openai_parse import StopParse
from bourse.ports.engine import EngineFailure


def _failure(error: object, began: bool) -> EngineFailure:
    return EngineFailure(str(error), transient=not began)


def _legacy(text: str, finish: str | None = None) -> bytes:
    chunk = {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _chat(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    chunk = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def test_a_stop_split_across_chunks_cuts_the_answer_and_every_token_is_counted() -> None:
    parse = StopParse(_failure, [" 7"], chat=False)
    read = b"".join(_legacy(t) for t in [" 4,", " 5,", " 6,", " ", "7", ", 8"])
    events = parse.events(read)
    texts = [e.chunk["choices"][0]["text"] for e in events]
    assert texts == [" 4,", " 5,", " 6,", ""]  # " " held (may begin " 7") and dropped; "7" ends it
    assert events[-1].chunk["choices"][0]["finish_reason"] == "stop"
    assert parse.tokens == 5  # the held and the completing tokens count, ", 8" never read
    assert parse.done and parse.cut and parse.finished
    assert parse.finish() is None  # no upstream usage: the counter's


def test_a_stop_never_met_flushes_what_was_held_at_the_finish() -> None:
    parse = StopParse(_failure, ["ab"], chat=True)
    events = parse.events(_chat(None) + _chat("xa") + _chat("", "length") + b"data: [DONE]\n\n")
    contents = [e.chunk["choices"][0]["delta"].get("content") for e in events]
    assert contents == [None, "x", "a"]  # a chunk without content passes as it is; "a" was held
    assert events[-1].chunk["choices"][0]["finish_reason"] == "length"
    assert parse.done and not parse.cut
