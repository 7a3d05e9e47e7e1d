"""What a probe's result does to a deployment (:class:`bourse.services.probes.Prober`):
availability, slots from the engine (capped, with a WARNING), the start probe."""

from __future__ import annotations

import asyncio
import logging

import pytest

from bourse.domain.book import Deployment
from bourse.ports.engine import Probe
from bourse.services.probes import Prober, ProbeTarget


class FakeEngine:
    def __init__(self, probe: Probe, upstream: str = "http://h:1") -> None:
        self.next = probe
        self.flavor = probe.flavor
        self.upstream = upstream
        self.probes = 0

    async def probe(self) -> Probe:
        self.probes += 1
        return self.next


def _target(configured: int | None, interval_s: float = 10.0, probe: Probe | None = None) -> ProbeTarget:
    engine = FakeEngine(probe or Probe(None, "openai"))
    return ProbeTarget("p", Deployment("d", 0.0, configured or 4), engine, interval_s, configured)


@pytest.mark.parametrize(
    ("configured", "engine", "slots"),
    [(None, 1, 1), (None, None, 4), (2, 3, 2), (8, None, 8), (4, 1, 1)],
)
def test_slots(configured: int | None, engine: int | None, slots: int) -> None:
    t = _target(configured)
    Prober().apply(t, Probe(None, "llama.cpp", slots=engine))
    assert t.deployment.slots == slots


def test_slots_above_the_engine_are_capped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    t, prober = _target(4), Prober()
    with caplog.at_level(logging.WARNING, "bourse.probes"):
        prober.apply(t, Probe(None, "llama-cpp-python", slots=1))
        prober.apply(t, Probe(None, "llama-cpp-python", slots=1))
    capped = [r for r in caplog.records if "capped to 1" in r.getMessage()]
    assert len(capped) == 1 and "slots = 4" in capped[0].getMessage()


def test_a_failed_probe_makes_it_unavailable_and_a_passing_one_brings_it_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t, prober = _target(2), Prober()
    t.deployment.availability.on_change = lambda reason: prober.changed("p", "d", reason)
    with caplog.at_level(logging.INFO, "bourse.probes"):
        prober.apply(t, Probe("the upstream is unreachable", "openai"))
        assert t.deployment.availability.reason == "the upstream is unreachable"
        assert t.deployment.slots == 2  # kept while it cannot say
        prober.apply(t, Probe(None, "openai"))
    assert t.deployment.availability.ok
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert ("WARNING", "deployment d of p is unavailable: the upstream is unreachable") in levels
    assert ("INFO", "deployment d of p is available again") in levels


@pytest.mark.anyio
async def test_with_periodic_probes_off_a_failed_start_probe_keeps_it_out_until_one_passes() -> None:
    """``probe_interval_s = 0``: a failed start probe makes the deployment unavailable (it
    took orders that met a wrong URL or a dead upstream); it is probed again every
    ``retry_s`` until a probe passes, then no more."""
    prober = Prober(retry_s=0.01)
    t = _target(None, interval_s=0, probe=Probe("the upstream is unreachable", "openai"))
    prober.add(t)
    await prober.start()
    try:
        assert t.deployment.availability.reason == "the upstream is unreachable"
        engine = t.engine
        assert isinstance(engine, FakeEngine)
        await asyncio.sleep(0.05)
        assert not t.deployment.availability.ok and engine.probes > 1  # probed again, still out
        engine.next = Probe(None, "openai")
        for _ in range(100):
            if t.deployment.availability.ok:
                break
            await asyncio.sleep(0.01)
        assert t.deployment.availability.ok
        probes = engine.probes
        await asyncio.sleep(0.05)
        assert engine.probes == probes  # passed once: no more probes
    finally:
        await prober.stop()


@pytest.mark.anyio
async def test_start_probes_then_no_loop_when_off() -> None:
    prober = Prober()
    t = _target(None, interval_s=0, probe=Probe(None, "llama-cpp-python", slots=1))
    prober.add(t)
    await prober.start()
    assert t.deployment.slots == 1
    assert prober._tasks == []
    await prober.stop()


def test_a_llama_cpp_python_server_running_a_generation_here_is_not_probed() -> None:
    """Its /v1/models waits for the generation and, with interrupt_requests, ends it."""
    prober = Prober()
    busy = _target(1, probe=Probe(None, "llama-cpp-python"))
    idle = _target(1, probe=Probe(None, "llama-cpp-python"))  # another product, same server
    other = ProbeTarget(
        "q", Deployment("o", 0.0, 1), FakeEngine(Probe(None, "llama-cpp-python"), "http://h:2"), 10, 1
    )
    for t in (busy, idle, other):
        prober.add(t)
    busy.deployment.busy = 1
    assert prober._disturbs(busy) and prober._disturbs(idle)
    assert not prober._disturbs(other)
    busy.deployment.busy = 0
    assert not prober._disturbs(idle)
    vllm = _target(1, probe=Probe(None, "vllm"))
    vllm.deployment.busy = 1
    prober.add(vllm)
    assert not prober._disturbs(vllm)  # its probes do not disturb it


def test_an_engine_queueing_behind_the_book_shrinks_the_slots_then_they_come_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t, prober = _target(None), Prober()
    with caplog.at_level(logging.WARNING, "bourse.probes"):
        prober.apply(t, Probe(None, "llama.cpp", slots=4, waiting=0))
        assert t.deployment.slots == 4
        prober.apply(t, Probe(None, "llama.cpp", slots=4, waiting=2))
        assert t.deployment.slots == 2
        prober.apply(t, Probe(None, "llama.cpp", slots=4, waiting=5))
        assert t.deployment.slots == 1  # never below one
    assert sum("queues" in r.getMessage() for r in caplog.records) == 2
    prober.apply(t, Probe(None, "llama.cpp", slots=4, waiting=None))  # not said: kept
    assert t.deployment.slots == 1
    for want in (2, 3, 4, 4):
        prober.apply(t, Probe(None, "llama.cpp", slots=4, waiting=0))
        assert t.deployment.slots == want


class BrokenEngine(FakeEngine):
    async def probe(self) -> Probe:
        raise ValueError("a bug")


@pytest.mark.anyio
async def test_a_probe_that_raises_reads_as_a_failed_one() -> None:
    prober = Prober()
    t = ProbeTarget("p", Deployment("d", 0.0, 1), BrokenEngine(Probe(None, "openai")), 10, 1)
    prober.add(t)
    await prober.start()
    assert t.deployment.availability.reason == "its probe failed (ValueError)"
    await prober.stop()
