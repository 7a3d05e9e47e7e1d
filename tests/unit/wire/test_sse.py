"""SSE framing (``bourse.wire.sse``): the frames the relay writes, and the incremental
parser reading them back, whatever the byte boundaries."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bourse.wire.sse import (
    DONE,
    KEEP_ALIVE,
    REQUEUED,
    Event,
    SSEParser,
    comment,
    data_frame,
    fmt_price,
)


def _events(*pieces: bytes) -> list[Event]:
    parser = SSEParser()
    return [ev for piece in pieces for ev in parser.feed(piece)]


# -- writing ---------------------------------------------------------------------------------


def test_data_frame_and_comment_are_one_line_and_a_blank_line() -> None:
    assert data_frame(b'{"a": 1}') == b'data: {"a": 1}\n\n'
    assert comment("queued bid=0.05") == b": queued bid=0.05\n\n"


def test_the_fixed_frames() -> None:
    assert data_frame(b"[DONE]") == DONE
    assert comment("keep-alive") == KEEP_ALIVE
    assert comment("requeued (transient backend failure), waiting") == REQUEUED


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0.05, "0.05"),
        (1.0, "1"),
        (12.5, "12.5"),
        (0.0143, "0.0143"),
        (0.1234567, "0.123457"),
        (1e-9, "0"),
        (0.0, "0"),
    ],
)
def test_fmt_price_has_at_most_six_decimals_and_no_trailing_zeros(value: float, shown: str) -> None:
    assert fmt_price(value) == shown


# -- reading ---------------------------------------------------------------------------------


def test_parser_reads_data_comments_and_done() -> None:
    raw = comment("queued bid=1") + data_frame(b'{"x": 1}') + KEEP_ALIVE + DONE
    assert _events(raw) == [
        Event(comment="queued bid=1"),
        Event(data='{"x": 1}'),
        Event(comment="keep-alive"),
        Event(data="[DONE]"),
    ]


def test_an_event_is_complete_only_at_its_blank_line() -> None:
    parser = SSEParser()
    assert list(parser.feed(b"data: par")) == []
    assert list(parser.feed(b"tial\n")) == []
    assert list(parser.feed(b"\n")) == [Event(data="partial")]


def test_several_data_lines_join_with_newlines_and_the_event_name_is_kept() -> None:
    assert _events(b"event: delta\ndata: one\ndata:two\n\n") == [Event(data="one\ntwo", event="delta")]


def test_crlf_line_ends_and_unknown_fields() -> None:
    assert _events(b"id: 7\r\nretry: 10\r\ndata: x\r\n\r\n") == [Event(data="x")]


def test_blank_lines_without_data_yield_nothing() -> None:
    assert _events(b"\n\n\n") == []


def test_only_one_space_after_the_colon_is_dropped() -> None:
    assert _events(b"data:  two spaces\n\n") == [Event(data=" two spaces")]


def test_a_comment_keeps_its_text_without_the_colon_and_spaces() -> None:
    assert _events(b":no-space\n") == [Event(comment="no-space")]


_LINE_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=20)
"""Text of one line: no line break, no lone surrogate (not encodable)."""
_COMMENT_TEXT = st.text(
    st.characters(codec="utf-8", exclude_characters="\r\n", exclude_categories=("Zs", "Cc")), max_size=20
).map(str.strip)
"""A comment's text: the parser drops the spaces around it."""
_FRAMES = st.lists(
    st.one_of(st.tuples(st.just("data"), _LINE_TEXT), st.tuples(st.just("comment"), _COMMENT_TEXT)),
    max_size=8,
)


@settings(deadline=None)
@given(frames=_FRAMES, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10))
def test_what_is_written_is_read_back_however_it_is_split(
    frames: list[tuple[str, str]], cuts: list[int]
) -> None:
    raw = b"".join(data_frame(t.encode()) if kind == "data" else comment(t) for kind, t in frames)
    points = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    pieces = [raw[a:b] for a, b in itertools.pairwise(points)]
    expected = [Event(data=t) if kind == "data" else Event(comment=t) for kind, t in frames]
    assert _events(*pieces) == expected


# -- payloads: the HTTP engine's way -----------------------------------------------------


def _payloads(*pieces: bytes) -> list[bytes]:
    parser = SSEParser()
    return [p for piece in pieces for p in parser.payloads(piece)] + parser.end()


def test_payloads_of_a_read_of_whole_one_line_events() -> None:
    raw = data_frame(b'{"a": 1}') + data_frame(b"") + data_frame(b"x y") + DONE
    assert _payloads(raw) == [b'{"a": 1}', b"", b"x y", b"[DONE]"]


def test_payloads_of_a_read_that_ends_an_event_begun_in_the_one_before() -> None:
    # the first read leaves a data line waiting for its blank line: the second read's
    # line belongs to the same event, though the second read alone is a whole event
    assert _payloads(b"data: x\n", b"data: z\n\n") == [b"x\nz"]
    assert _payloads(b"data: par", b"tial\n\n") == [b"partial"]


@pytest.mark.parametrize(
    "raw",
    [
        b"data: a\r\n\r\n",  # CRLF
        b"data:a\n\n",  # no space after the colon
        b"data: a\ndata: b\n\n",  # two data lines
        b"data: a\n\ndata: b\ndata: c\n\n",  # two data lines in a later event
        b"data: a\n\n\n\n",  # blank lines after the last event
        b": comment\n\ndata: a\n\n",  # a comment
        b"data: a\n\n\ndata: b\n\n",  # a blank line between events
        b"event: e\ndata: a\n\n",  # another field
        b"\n\n",  # nothing but a blank line
    ],
)
def test_payloads_of_other_shapes_are_the_events_data(raw: bytes) -> None:
    expected = [ev.data.encode() for ev in _events(raw) if ev.data is not None]
    assert _payloads(raw) == expected


_EVENTS = st.lists(
    st.one_of(
        st.lists(_LINE_TEXT, min_size=1, max_size=3).map(lambda lines: ("data", lines)),
        _COMMENT_TEXT.map(lambda t: ("comment", [t])),
        st.just(("blank", [])),
    ),
    max_size=8,
)


def _written(events: list[tuple[str, list[str]]], crlf: bool, space: bool) -> bytes:
    eol = "\r\n" if crlf else "\n"
    out = ""
    for kind, lines in events:
        if kind == "data":
            out += "".join(f"data:{' ' if space else ''}{line}{eol}" for line in lines) + eol
        elif kind == "comment":
            out += f": {lines[0]}{eol}{eol}"
        else:
            out += eol
    return out.encode()


@settings(deadline=None)
@given(
    events=_EVENTS,
    crlf=st.booleans(),
    space=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_payloads_are_the_data_of_every_event_however_the_stream_is_written_and_split(
    events: list[tuple[str, list[str]]], crlf: bool, space: bool, cuts: list[int]
) -> None:
    raw = _written(events, crlf, space)
    points = sorted({0, len(raw), *(c for c in cuts if c < len(raw))})
    pieces = [raw[a:b] for a, b in itertools.pairwise(points)]
    expected = [ev.data.encode() for ev in _events(*pieces) if ev.data is not None]
    assert _payloads(*pieces) == expected

    # without the written space, each line's own leading space is the one the parser drops
    def read(line: str) -> str:
        return line[1:] if not space and line[:1] == " " else line

    assert expected == ["\n".join(map(read, lines)).encode() for kind, lines in events if kind == "data"]
