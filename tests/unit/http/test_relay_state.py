"""A relay's states (bourse.http.relay_state): each moves only forward, by its table,
and a move the table lacks is an error, not a silent overwrite."""

from __future__ import annotations

import itertools

import pytest

from bourse.http.relay_state import PRESENCE_MOVES, STAGE_MOVES, IllegalMove, Presence, Stage, moved


@pytest.mark.parametrize(("now", "to"), list(itertools.product(Stage, Stage)))
def test_a_stage_moves_only_forward(now: Stage, to: Stage) -> None:
    if to < now or (now is to and now is not Stage.CLOSING):
        with pytest.raises(IllegalMove):
            moved(STAGE_MOVES, now, to)
    else:
        moved(STAGE_MOVES, now, to)


def test_the_stage_table_is_the_forward_moves_and_closing_again() -> None:
    forward = {(a, b) for a, b in itertools.product(Stage, Stage) if a < b}
    assert forward | {(Stage.CLOSING, Stage.CLOSING)} == STAGE_MOVES


def test_a_client_that_left_stays_gone() -> None:
    moved(PRESENCE_MOVES, Presence.THERE, Presence.GONE)
    moved(PRESENCE_MOVES, Presence.GONE, Presence.GONE)  # heard of again: the same state
    with pytest.raises(IllegalMove, match="GONE -> THERE"):
        moved(PRESENCE_MOVES, Presence.GONE, Presence.THERE)
    with pytest.raises(IllegalMove):
        moved(PRESENCE_MOVES, Presence.THERE, Presence.THERE)
