"""Client request bodies (``bourse.wire.requests``): JSON parsing, the chat and
legacy completion shapes (a failure names the field), the body size limit."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bourse.domain.errors import GatewayError
from bourse.wire.requests import (
    GATEWAY_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    check_size,
    parse_body,
    parse_json,
    validate,
)

USER = [{"role": "user", "content": "hi"}]


def _refused(kind: Any, body: dict[str, Any]) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        validate(kind, body)
    err = info.value
    assert (err.status, err.code) == (400, "invalid_request"), err
    return err


# -- parse_body ------------------------------------------------------------------------------


DEPTH = 64


def test_parse_body_gives_the_object() -> None:
    assert parse_body(b'{"model": "p", "n": 1}', DEPTH) == {"model": "p", "n": 1}


@pytest.mark.parametrize(
    ("raw", "says"),
    [(b"", "empty"), (b"{nope", "not valid JSON"), (b"[1]", "JSON object"), (b'"s"', "JSON object")],
)
def test_parse_body_refuses_what_is_not_a_json_object(raw: bytes, says: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_body(raw, DEPTH)
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    assert says in info.value.message


def _nested(levels: int, inner: Any = 1) -> Any:
    """A value nested ``levels`` deep: dicts and lists by turns."""
    for i in range(levels):
        inner = {"a": inner} if i % 2 else [inner]
    return inner


@pytest.mark.parametrize("levels", [1, 2, 10, DEPTH])
def test_json_up_to_the_depth_limit_is_taken(levels: int) -> None:
    doc = _nested(levels)
    assert parse_json(orjson.dumps(doc), DEPTH) == doc


@pytest.mark.parametrize("levels", [DEPTH + 1, 200, 1000, 1025, 5000])
def test_json_past_the_depth_limit_is_a_400_naming_it(levels: int) -> None:
    raw = b"[" * levels + b"]" * levels  # past 1024 levels orjson itself refuses: the same 400
    with pytest.raises(GatewayError) as info:
        parse_json(raw, DEPTH)
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    assert f"nested deeper than {DEPTH} levels" in info.value.message
    assert "max_json_depth" in info.value.message


def test_brackets_inside_strings_do_not_count() -> None:
    raw = orjson.dumps({"content": "[" * 500 + "{" * 500})
    assert parse_json(raw, DEPTH) == {"content": "[" * 500 + "{" * 500}


def test_a_wide_shallow_body_is_within_the_limit() -> None:
    doc = {"messages": [{"role": "user", "content": [{"type": "text"}]} for _ in range(2000)]}
    assert parse_json(orjson.dumps(doc), DEPTH) == doc


def _schema(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": {"format": {"type": "json_schema", "schema": _schema(40)}}}, "text.format.schema"),
        ({"response_format": {"json_schema": {"schema": _schema(40)}}}, "response_format.json_schema.schema"),
        ({"tools": [{"function": {"name": "f", "parameters": _schema(40)}}]}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "parameters": _schema(40)}]}, "tools.0.parameters"),
        ({"metadata": _nested(80)}, "metadata"),
        ({"endpoint": "/v1/chat/completions", "body": {"metadata": _nested(80)}}, "body.metadata"),
    ],
)
def test_a_too_deep_body_names_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_body(orjson.dumps(body), DEPTH)
    assert info.value.param == param, info.value
    assert info.value.message.startswith(f"{param}: "), info.value


# -- validate: chat ----------------------------------------------------------------------------


def test_a_chat_body_keeps_the_fields_the_gateway_does_not_own() -> None:
    body = {"model": "p", "messages": USER, "temperature": 0.3, "logit_bias": {"1": 2}, "max_price": 0.5}
    req = validate("chat", body)
    assert isinstance(req, ChatCompletionRequest)
    assert req.model == "p" and req.max_price == 0.5 and req.stream is False and req.detached is False
    assert req.model_extra == {"temperature": 0.3, "logit_bias": {"1": 2}}


def test_stream_options_tools_and_content_parts() -> None:
    body = {
        "model": "p",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
    }
    req = validate("chat", body)
    assert isinstance(req, ChatCompletionRequest)
    assert req.stream_options is not None and req.stream_options.include_usage is True
    assert req.tools is not None and req.tools[0].function.name == "f"
    assert req.messages[1].tool_calls is not None and req.messages[1].tool_calls[0].type == "function"


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"messages": USER}, "model"),
        ({"model": "", "messages": USER}, "model"),
        ({"model": "p"}, "messages"),
        ({"model": "p", "messages": []}, "messages"),
        ({"model": "p", "messages": [{"role": "robot"}]}, "messages.0.role"),
        ({"model": "p", "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"model": "p", "messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"model": "p", "messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"model": "p", "messages": USER, "max_price": "0.5"}, "max_price"),  # strict: a number
        ({"model": "p", "messages": USER, "max_price": 0}, "max_price"),
        ({"model": "p", "messages": USER, "timeout": -1}, "timeout"),
        ({"model": "p", "messages": USER, "tools": [{"type": "web"}]}, "tools.0.type"),
        ({"model": "p", "messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
        ({"model": "p", "messages": USER, "stream": "yes please"}, "stream"),
    ],
)
def test_a_bad_chat_field_is_named(body: dict[str, Any], where: str) -> None:
    err = _refused("chat", body)
    assert err.message.startswith(where + ":"), err.message
    assert err.param == where


def test_n_other_than_one_is_refused() -> None:
    assert validate("chat", {"model": "p", "messages": USER, "n": 1}).n == 1
    err = _refused("chat", {"model": "p", "messages": USER, "n": 3})
    assert err.param == "n"


# -- validate: legacy completions ---------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Once", ["Once"], [1, 2, 3]])
def test_a_legacy_prompt_is_one_prompt(prompt: Any) -> None:
    req = validate("completion", {"model": "p", "prompt": prompt})
    assert isinstance(req, CompletionRequest) and req.prompt == prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "p", "prompt": ["one", "two"]}, "prompt"),
        ({"model": "p", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "p"}, "prompt"),
        ({"model": "p", "prompt": "x", "n": 2}, "n"),
    ],
)
def test_a_bad_legacy_body_is_refused(body: dict[str, Any], param: str) -> None:
    assert _refused("completion", body).param == param


def test_the_gateway_fields_are_its_request_extensions() -> None:
    assert set(GATEWAY_FIELDS) == {"max_price", "timeout", "deadline_s", "detached"}


# -- check_size ---------------------------------------------------------------------------------


def test_check_size_allows_the_limit_and_refuses_more() -> None:
    check_size(1024, 1024)
    with pytest.raises(GatewayError) as info:
        check_size(1025, 1024)
    assert (info.value.status, info.value.code) == (413, "request_too_large")
    assert "1025" in info.value.message and "1024" in info.value.message
