"""The observer through the real services (sim engines, the in-process book, SQLite):
what one run reports, its spans, and the WARN lines of failures."""

from __future__ import annotations

import io
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bourse.container import build
from bourse.observability.access_log import AccessLog
from bourse.observability.observer import Observability
from bourse.observability.tracing import Tracer
from bourse.ports.observer import Caller
from bourse.ports.webhooks import Address
from bourse.services.completion import Run
from bourse.services.ids import new_request_id
from bourse.settings import Environment, parse_config
from bourse.wire.requests import validate
from tests.unit.services.exchange import Exchange, product, run_to_end, running, until

pytestmark = pytest.mark.anyio

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def exchange(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Exchange]:
    products = {
        "plain": product(),
        "fragile": {
            "max_output_tokens": 64,
            "sim_overrides": True,
            "deployments": [
                {"engine": "sim", "slots": 1, "floor": 10.0, "breaker_threshold": 1, "cooldown_s": 0}
            ],
        },
        "reconcile": product("aigrid"),
    }
    async with running(tmp_path_factory.mktemp("observer"), products) as ex:
        yield ex


@pytest.fixture
def seen(exchange: Exchange) -> Iterator[tuple[Observability, io.StringIO, InMemorySpanExporter]]:
    """The exchange's observer, its access log on a buffer and its spans in memory."""
    obs = exchange.container.observer
    assert isinstance(obs, Observability)
    logging.getLogger("bourse.access").setLevel(logging.INFO)
    out = io.StringIO()
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    old = obs.access, obs.tracer
    obs.drain()  # earlier tests' runs go to their own access log
    obs.access, obs.tracer = AccessLog(json=True, stream=out), Tracer(provider)
    try:
        yield obs, out, spans
    finally:
        obs.drain()
        obs.access, obs.tracer = old
        provider.shutdown()


async def _open(ex: Exchange, model: str, *, caller: Caller | None = None, **sim: Any) -> Run:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
        "seed": 1,
    }
    if sim:
        body["sim"] = sim
    rid = caller.request_id if caller is not None else new_request_id("chat")
    return await ex.completions.open(
        "chat", body, validate("chat", body), ex.principal, request_id=rid, caller=caller
    )


def _lines(out: io.StringIO, obs: Observability) -> list[dict[str, Any]]:
    assert obs.access is not None
    obs.drain()  # the finished runs' batch (counted and written, then flushed)
    return [orjson.loads(x) for x in out.getvalue().splitlines()]


def _by_name(spans: InMemorySpanExporter) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for s in spans.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


async def test_a_run_reports_once_with_its_caller_and_its_spans(
    exchange: Exchange, seen: tuple[Observability, io.StringIO, InMemorySpanExporter]
) -> None:
    obs, out, spans = seen
    assert obs.instruments is not None
    before = dict(obs.instruments.requests.values)
    caller = Caller(new_request_id("chat"), "/v1/chat/completions", time.perf_counter(),
                    correlation_id="client-1", traceparent=TRACEPARENT, key_id="key_x", product="plain")  # fmt: skip
    run = await _open(exchange, "plain", caller=caller)
    _, fin = await run_to_end(run)
    (line,) = _lines(out, obs)
    assert line["request_id"] == run.request_id and line["correlation_id"] == "client-1"
    assert line["outcome"] == "completed" and line["status"] == 200 and line["deployment"] == "plain/0"
    assert line["cost_micros"] == fin.cost_micros > 0 and line["completion_tokens"] == 4
    assert line["key_id"] == exchange.principal.key.id
    assert (
        obs.instruments.requests.values[("plain", "completed")] == before.get(("plain", "completed"), 0) + 1
    )
    assert ("hold",) in obs.instruments.ledger.series and ("settle",) in obs.instruments.ledger.series
    record = await exchange.record(run)
    assert record.record["correlation_id"] == "client-1"
    names = _by_name(spans)
    (root,) = names["bourse.run"]
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE  # under the client's trace
    for child in ("bourse.book.wait", "bourse.engine.attempt", "bourse.settle"):
        (span,) = names[child]
        assert span.parent is not None and span.parent.span_id == root.context.span_id
    assert root.attributes is not None and root.attributes["bourse.outcome"] == "completed"


async def test_a_requeue_is_two_attempts_and_an_upstream_failure(
    exchange: Exchange,
    seen: tuple[Observability, io.StringIO, InMemorySpanExporter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    obs, out, spans = seen
    assert obs.instruments is not None
    failures = obs.instruments.upstream_failures.values.get(("plain", "plain/0", "other"), 0)
    with caplog.at_level(logging.WARNING, logger="bourse.events"):
        run = await _open(exchange, "plain", fail_before_output=1)
        await run_to_end(run)
    assert obs.instruments.upstream_failures.values[("plain", "plain/0", "other")] == failures + 1
    assert obs.instruments.requeues.values[("plain", "plain/0")] >= 1
    attempts = _by_name(spans)["bourse.engine.attempt"]
    assert [a.status.is_ok for a in attempts] == [False, True]
    warned = [r for r in caplog.records if "upstream failure on deployment plain/0" in r.getMessage()]
    assert len(warned) == 1 and run.request_id in warned[0].getMessage()
    (line,) = _lines(out, obs)
    assert line["requeues"] == 1 and line["outcome"] == "completed"


async def test_a_breaker_opening_and_closing_is_a_warning(
    exchange: Exchange, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="bourse.events"):
        run = await _open(exchange, "fragile", fail_before_output=1)
        await run_to_end(run)  # fails once (the breaker opens), then succeeds (it closes)
    messages = [r.getMessage() for r in caplog.records if r.name == "bourse.events"]
    assert "circuit breaker of deployment fragile/0 opened (cooling down)" in messages
    assert "circuit breaker of deployment fragile/0 closed" in messages


async def test_a_hold_moved_to_reconciling_is_a_warning(
    exchange: Exchange,
    seen: tuple[Observability, io.StringIO, InMemorySpanExporter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    obs, out, _ = seen
    assert obs.instruments is not None
    before = obs.instruments.reconciling.values.get((), 0)
    with caplog.at_level(logging.WARNING, logger="bourse.events"):
        run = await _open(exchange, "reconcile", omit_usage=True)
        await run_to_end(run)
    assert obs.instruments.reconciling.values[()] == before + 1
    assert any(f"hold {run.hold_id} of request {run.request_id} moved to reconciling" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    (line,) = _lines(out, obs)
    assert line["outcome"] == "reconciling"


async def test_a_jobs_run_is_reported_as_detached(
    exchange: Exchange, seen: tuple[Observability, io.StringIO, InMemorySpanExporter]
) -> None:
    obs, out, _ = seen
    run = await _open(exchange, "plain")  # no HTTP caller: a job's run
    await run_to_end(run)
    (line,) = _lines(out, obs)
    assert line["detached"] is True and line["route"] == "/v1/chat/completions"


class _Sender:
    """A webhook sender that answers ``status`` for every delivery."""

    def __init__(self, status: int) -> None:
        self.status = status

    async def resolve(self, host: str, port: int) -> list[Address]:
        return [ipaddress.IPv4Address("127.0.0.1")]

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        return self.status

    async def aclose(self) -> None:
        return None


@pytest.mark.parametrize(
    ("status", "results"), [(200, {"delivered": 1}), (500, {"attempt_failed": 2, "failed": 1})]
)
async def test_webhook_deliveries_are_counted_and_a_failed_one_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, status: int, results: dict[str, int]
) -> None:
    config = parse_config(
        {
            "jobs": {"allow_loopback_webhooks": True, "webhook_attempts": 2, "webhook_backoff_s": 0.01},
            "products": {"plain": product()},
        },
        "test",
        env={},
    )
    container = build(config, data_dir=tmp_path, env=Environment(admin_key="bk_admin_hooks"))
    container.announce = False
    container.jobs.sender = _Sender(status)
    await container.start()
    try:
        obs = container.observer
        assert isinstance(obs, Observability) and obs.instruments is not None
        await container.admin.create_account("hooks", 1.0)
        created = await container.admin.create_key("hooks", None, None, None, None)
        principal = await container.auth.user(f"Bearer {created['key']}")
        body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with caplog.at_level(logging.WARNING, logger="bourse.events"):
            job = await container.jobs.submit(
                principal, "/v1/chat/completions", body, webhook_url="http://127.0.0.1:9/h"
            )
            webhooks = obs.instruments.webhooks
            await until(lambda: {k[0]: int(v) for k, v in webhooks.values.items()} == results)
        failed = [r for r in caplog.records if f"webhook of job {job['id']} failed" in r.getMessage()]
        assert len(failed) == (1 if status != 200 else 0)
    finally:
        await container.stop()


async def test_with_nothing_observed_a_run_builds_no_report_and_starts_no_child_span(
    exchange: Exchange, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metrics, the access log and tracing off: the run settles as ever, asks for its own
    span once (the null span) and nothing more, and hands the observer no report."""
    obs = exchange.container.observer
    assert isinstance(obs, Observability)
    obs.drain()
    spans: list[str] = []
    reports: list[object] = []
    start_span = obs.start_span

    def counted_span(name: str, parent: Any = None, started: float | None = None) -> Any:
        spans.append(name)
        return start_span(name, parent, started)

    monkeypatch.setattr(obs, "start_span", counted_span)
    monkeypatch.setattr(obs, "run_finished", reports.append)
    monkeypatch.setattr(obs, "instruments", None)
    monkeypatch.setattr(obs, "access", None)
    monkeypatch.setattr(obs, "tracer", None)
    assert not obs.hears_runs
    caller = Caller(
        new_request_id("chat"), "/v1/chat/completions", time.perf_counter(), traceparent=TRACEPARENT
    )
    _, fin = await run_to_end(await _open(exchange, "plain", caller=caller))
    assert fin.outcome == "completed" and fin.cost_micros > 0
    assert spans == ["bourse.run"] and reports == []

    monkeypatch.setattr(obs, "access", AccessLog(json=True, stream=io.StringIO()))  # heard again
    assert obs.hears_runs
    _, fin = await run_to_end(await _open(exchange, "plain"))
    assert len(reports) == 1 and spans == ["bourse.run", "bourse.run"]
