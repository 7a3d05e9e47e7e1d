"""Client request bodies (``bourse.wire.requests``): JSON parsing, the chat and
legacy completion shapes (a failure names the field), the body size limit."""

from __future__ import annotations

from typing import Any

import pytest

from bourse.domain.errors import GatewayError
from bourse.wire.requests import (
    GATEWAY_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    check_size,
    parse_body,
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


def test_parse_body_gives_the_object() -> None:
    assert parse_body(b'{"model": "p", "n": 1}') == {"model": "p", "n": 1}


@pytest.mark.parametrize(
    ("raw", "says"),
    [(b"", "empty"), (b"{nope", "not valid JSON"), (b"[1]", "JSON object"), (b'"s"', "JSON object")],
)
def test_parse_body_refuses_what_is_not_a_json_object(raw: bytes, says: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_body(raw)
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    assert says in info.value.message


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
    assert set(GATEWAY_FIELDS) == {"max_price", "timeout", "detached"}


# -- check_size ---------------------------------------------------------------------------------


def test_check_size_allows_the_limit_and_refuses_more() -> None:
    check_size(1024, 1024)
    with pytest.raises(GatewayError) as info:
        check_size(1025, 1024)
    assert (info.value.status, info.value.code) == (413, "request_too_large")
    assert "1025" in info.value.message and "1024" in info.value.message
