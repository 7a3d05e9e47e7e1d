"""The run's meter: tokens generated and delivered (taken by the consumer), and timings."""

from __future__ import annotations

import time

import pytest

from bourse.ports.engine import ChunkEvent
from bourse.services.completion import Finished
from bourse.services.run_meter import Meter, reasoning_count
from tests.unit.services.exchange import Exchange, run_to_end


def test_a_new_meter_counts_nothing() -> None:
    m = Meter(time.perf_counter())
    assert (m.generated, m.delivered, m.reasoning) == (0, 0, 0)
    assert m.ttft_ms is None and m.queued_ms is None and m.engine_usage is None


def test_the_first_admission_is_kept_and_a_later_one_is_not() -> None:
    m = Meter(time.perf_counter())
    assert m.admitted(0.25) is True
    assert m.queued_ms == 250.0
    assert m.admitted(3.0) is False  # an admission after a requeue
    assert m.queued_ms == 250.0


def test_timings_count_from_the_arrival() -> None:
    t0 = time.perf_counter() - 0.5  # arrived half a second ago
    m = Meter(t0)
    m.first_output()
    assert m.ttft_ms is not None and 500.0 <= m.ttft_ms < 5000.0
    assert m.latency_ms() >= m.ttft_ms


@pytest.mark.parametrize(
    ("text", "tokens", "expected"),
    [("x" * 40, 1, 1), ("x" * 40, 20, 11), ("x" * 400, 20, 20), (None, 5, 5)],
)
def test_reasoning_count(text: str | None, tokens: int, expected: int) -> None:
    assert reasoning_count(text, tokens) == expected


@pytest.mark.anyio
async def test_a_run_read_to_its_end_delivered_all_it_generated(exchange: Exchange) -> None:
    run = await exchange.open("default", sim={"output_tokens": 5}, max_tokens=5)
    _, fin = await run_to_end(run)
    assert fin.outcome == "completed"
    assert run.meter.generated == run.meter.delivered == fin.usage["completion_tokens"] == 5
    assert run.tokens == 5
    assert run.meter.ttft_ms is not None and run.meter.queued_ms is not None


@pytest.mark.anyio
async def test_a_consumer_that_stops_was_delivered_only_what_it_came_back_after(exchange: Exchange) -> None:
    """The chunk in the consumer's hands when it stops was generated, not delivered."""
    run = await exchange.open("default", sim={"output_tokens": 8}, max_tokens=8)
    events = run.events()
    chunks: list[ChunkEvent] = []
    async for ev in events:
        if isinstance(ev, ChunkEvent) and ev.tokens:
            chunks.append(ev)
            if len(chunks) == 3:
                break
    await events.aclose()
    fin = await run.settled()
    assert isinstance(fin, Finished) and fin.outcome == "canceled"
    taken = sum(c.tokens for c in chunks)
    assert run.meter.generated == taken
    assert run.meter.delivered == taken - chunks[-1].tokens
    assert run.meter.delivered < run.meter.generated
