"""The access log (text and JSON, batched, bound to the ``bourse.access`` logger's level),
the JSON log format, and the process's handler: the command's own lines (``say``),
Python's warnings and a dying thread's traceback in the log's format."""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import threading
import warnings
from collections.abc import Iterator

import orjson
import pytest

from bourse.observability import access_log
from bourse.observability.access_log import (
    AccessLog,
    refused_fields,
    response_fields,
    run_text,
    run_text_parts,
)
from bourse.observability.logs import JsonFormatter, configure_logging, say
from bourse.observability.observer import Observability
from bourse.ports.observer import Caller, RunReport

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def access_at_info() -> Iterator[None]:
    logger = logging.getLogger("bourse.access")
    old = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(old)


def report(**kw: object) -> RunReport:
    fields: dict[str, object] = {
        "method": "POST",
        "request_id": "chatcmpl-abc",
        "route": "/v1/chat/completions",
        "product": "sim-fast",
        "outcome": "completed",
        "status": 200,
        "stream": True,
        "detached": False,
        "key_id": "key_0123",
        "correlation_id": None,
        "deployment": "sim-fast/0",
        "error": None,
        "prompt_tokens": 12,
        "completion_tokens": 16,
        "cost_micros": 28,
        "quote_micros": 40,
        "bid": 1.0,
        "cleared_price": 0.5,
        "queued_ms": 0.1,
        "ttft_ms": None,
        "latency_ms": 2.3,
        "requeues": 0,
    }
    fields.update(kw)
    return RunReport(**fields)  # type: ignore[arg-type]


def test_a_run_line_in_text_names_every_field() -> None:
    out = io.StringIO()
    log = AccessLog(json=False, stream=out)
    log.write_run(report(correlation_id="client-7"))
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    head, _, body = line.rstrip("\n").partition(" INFO bourse.access: ")
    assert len(head) == len("2025-05-01 12:00:00,123")
    fields = dict(part.split("=", 1) for part in body.split(" "))
    assert fields["request_id"] == "chatcmpl-abc"
    assert fields["correlation_id"] == "client-7"
    assert fields["key_id"] == "key_0123"
    assert fields["status"] == "200" and fields["outcome"] == "completed"
    assert fields["cleared_price"] == "0.5" and fields["ttft_ms"] == "-"
    assert fields["stream"] == "true" and fields["method"] == "POST"


KINDS: list[dict[str, object]] = [
    {},
    {"method": None, "detached": True, "stream": False, "route": "/v1/completions"},
    {"status": 502, "outcome": "error", "error": "upstream_error", "deployment": None, "cleared_price": None},
    {"product": "other", "correlation_id": "c=1", "queued_ms": None, "ttft_ms": 3.25, "bid": 0.2},
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_line_made_from_its_kinds_parts_and_cached_prices_is_the_whole_line(
    kind: dict[str, object],
) -> None:
    r = report(**kind)
    prices: dict[float, str] = {}
    assert run_text(r, run_text_parts(r), prices) == run_text(r)
    assert run_text(r, run_text_parts(r), prices) == run_text(r)  # the prices now cached


def test_the_observer_writes_each_kind_of_run_with_its_own_fields() -> None:
    out = io.StringIO()
    obs = Observability(access=AccessLog(json=False, stream=out))
    runs = [report(request_id=f"chatcmpl-{n}", **kind) for n in range(3) for kind in KINDS]
    for r in runs:
        obs.run_finished(r)
    obs.close()
    lines = out.getvalue().splitlines()
    assert [line.partition(" INFO bourse.access: ")[2] for line in lines] == [run_text(r) for r in runs]


def test_the_price_cache_is_bounded() -> None:
    out = io.StringIO()
    log = AccessLog(json=False, stream=out, max_pending=10_000)
    bids = [0.01 * n for n in range(1, access_log.PRICES_KEPT + 50)]
    for bid in bids:
        log.write_run(report(bid=bid, cleared_price=bid / 2))
    log.flush()
    assert len(log._prices) <= access_log.PRICES_KEPT
    written = [dict(p.split("=", 1) for p in line.split(" ")[4:]) for line in out.getvalue().splitlines()]
    assert [float(f["bid"]) for f in written] == bids
    assert [float(f["cleared_price"]) for f in written] == [b / 2 for b in bids]


def test_a_run_line_in_json_is_one_object() -> None:
    out = io.StringIO()
    log = AccessLog(json=True, stream=out)
    log.write_run(report())
    (line,) = out.getvalue().splitlines()
    doc = orjson.loads(line)
    assert doc["level"] == "INFO" and doc["logger"] == "bourse.access" and doc["msg"] == "access"
    assert doc["ts"].endswith("Z")
    assert doc["request_id"] == "chatcmpl-abc" and doc["cost_micros"] == 28 and doc["ttft_ms"] is None
    assert list(doc)[4:8] == ["method", "route", "status", "outcome"]  # the text line's order


def test_refused_and_other_lines_leave_out_what_is_not_known() -> None:
    out = io.StringIO()
    log = AccessLog(json=True, stream=out)
    caller = Caller("chatcmpl-x", "/v1/chat/completions", 0.0, key_id="key_1")
    log.write(refused_fields(caller, 402, "insufficient_funds", 0.002))
    log.write(response_fields("GET", "/v1/models", 200, 0.001, None))
    first, second = (orjson.loads(x) for x in out.getvalue().splitlines())
    assert first["status"] == 402 and first["error"] == "insufficient_funds" and first["outcome"] == "refused"
    assert "product" not in first and first["key_id"] == "key_1"
    assert second == {**second, "method": "GET", "route": "/v1/models", "status": 200}
    assert "request_id" not in second


def test_below_info_nothing_is_written() -> None:
    logging.getLogger("bourse.access").setLevel(logging.WARNING)
    out = io.StringIO()
    log = AccessLog(json=False, stream=out)
    log.write_run(report())
    log.write(response_fields("GET", "/v1/models", 200, 0.001, None))
    log.flush()
    assert out.getvalue() == ""


async def test_lines_are_written_in_batches_on_the_loop() -> None:
    out = io.StringIO()
    log = AccessLog(json=False, stream=out, flush_s=0.05, max_pending=3)
    log.write_run(report())
    log.write_run(report())
    assert out.getvalue() == ""  # waiting for the batch
    log.write_run(report())
    assert out.getvalue().count("\n") == 3  # a full batch goes at once
    log.write_run(report())
    await asyncio.sleep(0.2)
    assert out.getvalue().count("\n") == 4  # the rest within flush_s


def test_a_closed_stream_loses_lines_but_never_raises() -> None:
    out = io.StringIO()
    out.close()
    AccessLog(json=False, stream=out).write_run(report())


def test_the_json_format_puts_fields_and_tracebacks_in_one_object() -> None:
    fmt = JsonFormatter()
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord(
        "bourse.events", logging.WARNING, __file__, 1, "breaker %s", ("open",), exc_info
    )
    record.fields = {"deployment": "p/0", "msg": "not overwritten"}
    line = fmt.format(record)
    assert "\n" not in line
    doc = orjson.loads(line)
    assert doc["msg"] == "breaker open" and doc["level"] == "WARNING" and doc["deployment"] == "p/0"
    assert "ValueError: boom" in doc["exc"]


@pytest.fixture
def own_root() -> Iterator[None]:
    """configure_logging changes the process's root logger and hooks: put them back."""
    root = logging.getLogger()
    handlers, level, hook = list(root.handlers), root.level, threading.excepthook
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    threading.excepthook = hook
    logging.captureWarnings(False)


@pytest.mark.usefixtures("own_root")
def test_in_json_the_commands_lines_warnings_and_dying_threads_are_objects() -> None:
    out = io.StringIO()
    configure_logging("warning", "json", out)  # say()'s INFO line is not silenced by the level
    say("serving p on http://h/v1", url="http://h/v1")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("old api", DeprecationWarning, stacklevel=1)

    def die() -> None:
        raise RuntimeError("lost")

    t = threading.Thread(target=die, name="doomed")
    t.start()
    t.join()
    lines = out.getvalue().splitlines()
    docs = [orjson.loads(line) for line in lines]  # each line one object, or this raises
    said, warned, died = docs
    assert said["msg"] == "serving p on http://h/v1" and said["url"] == "http://h/v1", said
    assert said["level"] == "INFO" and said["logger"] == "bourse"
    assert warned["logger"] == "py.warnings" and "old api" in warned["msg"], warned
    assert died["msg"] == "thread doomed died: RuntimeError" and "RuntimeError: lost" in died["exc"], died


@pytest.mark.usefixtures("own_root")
def test_in_text_the_commands_lines_keep_their_shape() -> None:
    out = io.StringIO()
    configure_logging("error", "text", out)
    say("admin key kept in data/admin_key (mode 600)")
    logging.getLogger("bourse").error("a record")
    said, logged = out.getvalue().splitlines()
    assert said == "bourse: admin key kept in data/admin_key (mode 600)"
    assert logged.endswith(" ERROR bourse: a record"), logged
