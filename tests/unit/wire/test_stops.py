"""Stop strings applied to streamed text (bourse.wire.stops)."""

from __future__ import annotations

from bourse.wire.stops import StopStrings, stop_list


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    s = StopStrings(stops)
    shown: list[str] = []
    for piece in pieces:
        text, stopped = s.push(piece)
        shown.append(text)
        if stopped:
            return shown, True, ""
    return shown, False, s.flush()


def test_a_stop_split_across_pieces_is_held_then_cut() -> None:
    assert _run([" 7"], ["4,", " 5,", " 6,", " ", "7", ", 8"]) == (["4,", " 5,", " 6,", "", ""], True, "")


def test_the_first_of_several_stops_cuts() -> None:
    assert _run(["\n\n", "."], ["Paris", " is big.", " And"]) == (["Paris", " is big"], True, "")


def test_text_that_only_looked_like_a_stop_is_shown_once_it_is_not() -> None:
    shown, stopped, held = _run(["ab"], ["xa", "c", "a"])
    assert (shown, stopped, held) == (["x", "ac", ""], False, "a")


def test_stop_list_reads_a_string_a_list_or_nothing() -> None:
    assert stop_list("\n") == ["\n"]
    assert stop_list(["a", "", 3, "b"]) == ["a", "b"]
    assert stop_list(None) == [] and stop_list(7) == []
