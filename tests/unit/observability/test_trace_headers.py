"""The client's x-request-id and traceparent: kept only in a shape that is safe to log
and to hand on."""

from __future__ import annotations

import pytest

from bourse.wire.trace_headers import correlation_id, traceparent

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("value", [b"abc", b"order-42/attempt:1", b"A" * 128, b"x=y"])
def test_a_plain_token_is_a_correlation_id(value: bytes) -> None:
    assert correlation_id(value) == value.decode()


@pytest.mark.parametrize(
    "value",
    [b"", b"a b", b"a\nb", b'a"b', b"a\\b", b"A" * 129, "é".encode(), b"\x00", b"a\tb"],
)
def test_anything_that_could_break_a_log_line_is_dropped(value: bytes) -> None:
    assert correlation_id(value) is None


def test_a_w3c_traceparent_is_kept() -> None:
    assert traceparent(TP.encode()) == TP
    assert traceparent(TP.upper().encode()) == TP


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"garbage",
        b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # a version we do not read
        b"00-00000000000000000000000000000000-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\nx",
    ],
)
def test_a_malformed_traceparent_is_dropped(value: bytes) -> None:
    assert traceparent(value) is None
