"""The run's state machine: every move :data:`TRANSITIONS` allows is taken, every other
one raises, and the moves a run makes in its life are the table's."""

from __future__ import annotations

import itertools

import pytest

from bourse.services.run_state import (
    ADMITTED,
    DONE,
    NEW,
    QUEUED,
    STREAMING,
    TRANSITIONS,
    IllegalTransition,
    Phase,
    RunState,
)
from tests.unit.services.exchange import Exchange

ALLOWED = [(a, b) for a in Phase for b in sorted(TRANSITIONS[a])]
FORBIDDEN = [(a, b) for a, b in itertools.product(Phase, Phase) if b not in TRANSITIONS[a]]


def state_at(phase: Phase) -> RunState:
    """A state in ``phase``, reached along the table from NEW."""
    path = {
        Phase.NEW: [],
        Phase.QUEUED: [Phase.QUEUED],
        Phase.ADMITTED: [Phase.QUEUED, Phase.ADMITTED],
        Phase.STREAMING: [Phase.QUEUED, Phase.ADMITTED, Phase.STREAMING],
        Phase.DONE: [Phase.QUEUED, Phase.DONE],
    }[phase]
    state = RunState()
    for step in path:
        state.go(step)
    assert state.phase is phase
    return state


def test_the_table_names_every_phase_and_done_is_final() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.DONE] == frozenset()
    assert RunState().phase is Phase.NEW
    assert list(Phase) == [NEW, QUEUED, ADMITTED, STREAMING, DONE]  # the hot path's names: one per phase


@pytest.mark.parametrize(("src", "dst"), ALLOWED, ids=[f"{a.name}->{b.name}" for a, b in ALLOWED])
def test_an_allowed_transition_moves(src: Phase, dst: Phase) -> None:
    state = state_at(src)
    state.go(dst)
    assert state.phase is dst


@pytest.mark.parametrize(("src", "dst"), FORBIDDEN, ids=[f"{a.name}->{b.name}" for a, b in FORBIDDEN])
def test_a_forbidden_transition_raises_and_stays(src: Phase, dst: Phase) -> None:
    state = state_at(src)
    with pytest.raises(IllegalTransition, match=f"from {src.name} to {dst.name}"):
        state.go(dst)
    assert state.phase is src


def test_no_requeue_after_output_and_no_way_back_from_done() -> None:
    assert (Phase.STREAMING, Phase.QUEUED) in FORBIDDEN
    assert (Phase.ADMITTED, Phase.QUEUED) in ALLOWED
    assert all((Phase.DONE, p) in FORBIDDEN for p in Phase)


@pytest.mark.anyio
async def test_a_run_moves_along_the_table(exchange: Exchange) -> None:
    """A served run is QUEUED when booked and at its Queued event, STREAMING at its
    chunks (ADMITTED between two events), DONE at its Finished."""
    run = await exchange.open("default", sim={"output_tokens": 3}, max_tokens=3)
    assert run.phase is Phase.QUEUED
    seen: list[Phase] = []
    async for _ in run.events():
        if not seen or run.phase is not seen[-1]:
            seen.append(run.phase)
    assert seen == [Phase.QUEUED, Phase.STREAMING, Phase.DONE]
    assert run.done
