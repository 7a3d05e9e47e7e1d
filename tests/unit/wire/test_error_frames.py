"""The chunk shapes the gateway builds: the error frame of each policy, and a chunk
split as OpenAI sends it (the role alone first, the ``finish_reason`` alone last)."""

from __future__ import annotations

from typing import Any

import pytest

from bourse.domain.errors import GatewayError
from bourse.domain.policy import PRESETS
from bourse.wire.chunks import error_frame, has_finish, split_role_and_finish, stream_chunk

ERR = GatewayError(502, "upstream_error", "boom")


def frame(preset: str, kind: str = "chat", err: GatewayError = ERR) -> dict[str, Any]:
    p = PRESETS[preset]
    code, error_type = p.engine_error(err.code, err.error_type)
    err = GatewayError(err.status, code, err.message, error_type=error_type)
    return error_frame(kind, "rid", "m", 7, err, shape=p.error_frame, fields=p.error_fields,
                       finish_reason=p.error_finish_reason)  # fmt: skip


def test_the_error_frame_of_each_preset() -> None:
    envelope = {"message": "boom", "type": "upstream_error", "param": None, "code": "upstream_error"}
    assert frame("default") == {"id": "rid", "object": "chat.completion.chunk", "created": 7, "model": "m",
                                "error": envelope}  # fmt: skip
    assert frame("default", "completion")["object"] == "text_completion"
    assert frame("hips") == frame("openfill") == {"error": envelope}
    assert frame("aigrid") == {"error": {"code": "provider_failed", "message": "boom"}, "id": "rid"}
    assert list(frame("aigrid")) == ["error", "id"]  # the sheet's order
    assert frame("gopuram") == {
        "id": "rid", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}],
        "error": {"message": "boom", "type": "api_error", "code": "provider_error"},
    }  # fmt: skip
    # a refusal keeps its own code under every preset
    refusal = GatewayError(400, "context_length_exceeded", "too long")
    assert {frame(p, err=refusal)["error"]["code"] for p in PRESETS} == {"context_length_exceeded"}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return stream_chunk("chat", "rid", "m", 7, delta, finish)


def _deltas(chunks: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str | None]]:
    return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (_chunk({"role": "assistant", "content": "a"}), [({"role": "assistant"}, None), ({"content": "a"}, None)]),
        (_chunk({"content": "b"}), [({"content": "b"}, None)]),
        (_chunk({"content": "c"}, "stop"), [({"content": "c"}, None), ({}, "stop")]),
        (_chunk({"role": "assistant", "content": "d"}, "length"),
         [({"role": "assistant"}, None), ({"content": "d"}, None), ({}, "length")]),
        (_chunk({"role": "assistant"}), [({"role": "assistant"}, None)]),
        (_chunk({}, "stop"), [({}, "stop")]),
    ],
)  # fmt: skip
def test_split_role_and_finish(
    chunk: dict[str, Any], expected: list[tuple[dict[str, Any], str | None]]
) -> None:
    out = split_role_and_finish(chunk)
    assert _deltas(out) == expected
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in out} == {
        ("rid", "chat.completion.chunk", 7, "m")
    }
    assert has_finish(out[-1]) is (expected[-1][1] is not None)
    assert not any(has_finish(c) for c in out[:-1])


def test_a_chunk_of_several_choices_is_left_as_it_is() -> None:
    chunk = _chunk({"role": "assistant", "content": "a"}, "stop")
    chunk["choices"].append({"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"})
    assert split_role_and_finish(chunk) == [chunk]
