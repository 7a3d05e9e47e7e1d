"""Observability of a served gateway (``bourse serve`` processes):

- ``/metrics`` read with prometheus-client's own parser; the request and response
  counters move by exactly the requests made (a stream, a non-streamed answer, an
  engine error, a client that left, a 402, a 408), and the live gauges are there;
- the JSON log: one object per line, one access line per request carrying its
  request id and the client's correlation id, and no secret anywhere;
- the client's ``x-request-id`` kept in the usage record, its ``traceparent`` handed
  on to an ``openai`` upstream; with ``tracing = true`` the run's spans reach an OTLP
  receiver under the client's trace, and the upstream gets the attempt's span;
- ``metrics = false``: ``/metrics`` is 404.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from bourse.engines.sim import SimSettings
from bourse.engines.sim_server import create_sim_app
from tests.support.dead_upstream import DyingUpstream
from tests.support.gateway import running_gateway
from tests.support.processes import serve_process
from tests.support.servers import serve_app_in_thread

ADMIN_KEY = "bk_admin_observability_test"
ROUTE = "/v1/chat/completions"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
USER = [{"role": "user", "content": "Tell me something about rivers."}]
WAIT_S = 15.0

CONFIG = """
[server]
log_format = "{log_format}"
tracing = {tracing}
otlp_endpoint = "{otlp}"

[products.fast]
sim_overrides = true
[[products.fast.deployments]]
engine = "sim"
slots = 4
floor = 1.0

[products.slow]
sim_overrides = true
[[products.slow.deployments]]
engine = "sim"
slots = 1
floor = 1.0
tokens_per_s = 5

[products.relayed]
[[products.relayed.deployments]]
engine = "openai"
base_url = "{upstream}/v1"
model = "internal"
slots = 4
floor = 1.0
"""

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- helpers ---------------------------------------------------------------------------


@dataclass
class Recorder:
    """An ASGI wrapper that keeps the headers of every request it sees."""

    app: Any
    headers: list[dict[str, str]] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await self.app(scope, receive, send)


@dataclass
class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver: keeps (trace id, span id, parent id, name) of each span."""

    spans: list[tuple[str, str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            msg: Message = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if dict(scope["headers"]).get(b"content-encoding") == b"gzip":
            body = gzip.decompress(body)
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        with self.lock:
            for rs in req.resource_spans:
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append(
                            (sp.trace_id.hex(), sp.span_id.hex(), sp.parent_span_id.hex(), sp.name)
                        )
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-protobuf")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b""})


def eventually(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not in {timeout_s:.0f} s: {what}"
        time.sleep(0.05)


def scrape(url: str) -> Series:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out: Series = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counters(series: Series) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The request and completion-route response counters."""
    return {
        k: v
        for k, v in series.items()
        if k[0] == "bourse_requests_total"
        or (k[0] == "bourse_http_responses_total" and ("route", ROUTE) in k[1])
    }


def delta(before: Series, after: Series) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for k in set(before) | set(after):
        d = after.get(k, 0.0) - before.get(k, 0.0)
        if d:
            out[k] = d
    return out


def req(product: str, outcome: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("bourse_requests_total", (("outcome", outcome), ("product", product)))


def resp(status: int) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("bourse_http_responses_total", (("method", "POST"), ("route", ROUTE), ("status", str(status))))


@dataclass
class Served:
    url: str
    log: Path
    proc: subprocess.Popen[bytes]
    key: str
    upstream: Recorder

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(
            method, self.url + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30, **kw
        )

    def account(self, name: str, credit_usd: float) -> str:
        r = self.admin("POST", "/admin/accounts", json={"id": name, "credit_usd": credit_usd})
        assert r.status_code == 201, r.text
        r = self.admin("POST", "/admin/keys", json={"account": name})
        assert r.status_code in (200, 201), r.text
        key: str = r.json()["key"]
        return key

    def log_text(self) -> str:
        return self.log.read_text()


def body(product: str, *, stream: bool = False, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": product, "messages": USER, "stream": stream, "max_tokens": max_tokens, **extra}


@contextmanager
def served(tmp: Path, name: str, *, log_format: str, otlp: str | None = None) -> Iterator[Served]:
    """A gateway process (traced when ``otlp`` is given) in front of a recording upstream."""
    recorder = Recorder(create_sim_app(SimSettings(), model_name="internal"))
    with serve_app_in_thread(recorder) as upstream:
        config = CONFIG.format(
            log_format=log_format, tracing="true" if otlp else "false",
            otlp=otlp or "http://127.0.0.1:4318/v1/traces", upstream=upstream,
        )  # fmt: skip
        with serve_process(tmp, name, config, tmp / f"{name}-data", ADMIN_KEY) as (url, proc):
            log = max(tmp.glob(f"{name}-*.log"), key=lambda p: p.stat().st_mtime)
            gw = Served(url, log, proc, "", recorder)
            gw.key = gw.account("obs", 100.0)
            yield gw


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with served(tmp_path_factory.mktemp("obs-json"), "obs-json", log_format="json") as gw:
        yield gw


# -- metrics and logs ---------------------------------------------------------------------


def test_counters_move_by_exactly_the_requests_made_and_each_has_one_json_line(gateway: Served) -> None:
    gw = gateway
    poor = gw.account("poor", 0.000001)
    before = counters(scrape(gw.url))
    rids: dict[str, str] = {}
    with httpx.Client(base_url=gw.url + "/v1", headers=gw.headers, timeout=30) as client:
        # a stream that holds the only slot of 'slow', left after its first chunk
        with client.stream(
            "POST",
            "/chat/completions",
            json=body("slow", stream=True, max_tokens=200, sim={"output_tokens": 200}),
        ) as s:
            assert s.status_code == 200
            rids["disconnect"] = s.headers["x-request-id"]
            sse = s.iter_lines()  # kept: closing this iterator would close the stream
            for line in sse:
                if line.startswith("data: "):
                    break
            # meanwhile an order for the same slot gives up in the book: 408
            r = client.post("/chat/completions", json=body("slow", timeout=0.3))
            assert r.status_code == 408, r.text
            rids["408"] = r.headers["x-request-id"]
        r = client.post(
            "/chat/completions", json=body("fast", stream=True), headers={"x-request-id": "corr-stream"}
        )
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        rids["stream"] = r.headers["x-request-id"]
        r = client.post("/chat/completions", json=body("relayed"),
                        headers={"x-request-id": "corr-unary", "traceparent": TRACEPARENT})  # fmt: skip
        assert r.status_code == 200, r.text
        rids["unary"] = r.headers["x-request-id"]
        r = client.post("/chat/completions", json=body("fast", sim={"fail_after_tokens": 2}))
        assert r.status_code == 502, r.text
        rids["error"] = r.headers["x-request-id"]
        r = client.post(
            "/chat/completions",
            json=body("fast", max_tokens=500),
            headers={"authorization": f"Bearer {poor}"},
        )
        assert r.status_code == 402, r.text
        rids["402"] = r.headers["x-request-id"]

    expected = {
        req("slow", "disconnected"): 1,
        req("slow", "timeout"): 1,
        req("fast", "completed"): 1,
        req("relayed", "completed"): 1,
        req("fast", "error"): 1,
        req("fast", "refused"): 1,
        resp(200): 3,
        resp(408): 1,
        resp(502): 1,
        resp(402): 1,
    }
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def settled() -> bool:
        nonlocal got
        got = delta(before, counters(scrape(gw.url)))
        return got == expected

    eventually(settled, "the counters to move by the requests made")
    assert got == expected

    # one JSON access line per request, with its ids; every line one object
    lines: list[dict[str, Any]] = []

    def logged() -> bool:
        nonlocal lines
        lines = [json.loads(x) for x in gw.log_text().splitlines() if x.startswith("{")]
        return all(any(d.get("request_id") == rid for d in lines) for rid in rids.values())

    eventually(logged, "an access line for every request")
    for x in gw.log_text().splitlines():
        assert x.startswith("{"), x  # every line, the CLI's own start-up lines too
    for what, rid in rids.items():
        mine = [d for d in lines if d.get("request_id") == rid and d["logger"] == "bourse.access"]
        assert len(mine) == 1, (what, mine)
        assert mine[0]["level"] == "INFO"
    by = {what: next(d for d in lines if d.get("request_id") == rid) for what, rid in rids.items()}
    assert by["stream"]["correlation_id"] == "corr-stream" and by["stream"]["outcome"] == "completed"
    assert by["disconnect"]["outcome"] == "disconnected" and by["408"]["outcome"] == "timeout"
    assert by["402"]["status"] == 402 and by["402"]["error"] == "insufficient_funds"
    assert by["unary"]["deployment"] == "relayed/0" and by["unary"]["key_id"].startswith("key_")
    text = gw.log_text()
    for secret in (gw.key, poor, ADMIN_KEY):
        assert secret not in text

    # the correlation id is in the usage record; the client's traceparent reached the upstream
    r = httpx.get(f"{gw.url}/v1/usage/{rids['unary']}", headers=gw.headers, timeout=30)
    assert r.status_code == 200 and r.json()["correlation_id"] == "corr-unary"
    assert any(h.get("traceparent") == TRACEPARENT for h in gw.upstream.headers)


RESPONSES = "/v1/responses"


def access_lines(gw: Served, rid: str) -> list[dict[str, Any]]:
    """The JSON access lines of request ``rid`` so far."""
    lines = [json.loads(x) for x in gw.log_text().splitlines() if x.startswith("{")]
    return [d for d in lines if d.get("request_id") == rid and d["logger"] == "bourse.access"]


def test_refused_responses_requests_are_counted_and_logged_under_their_route(gateway: Served) -> None:
    gw = gateway
    before = scrape(gw.url)
    refused = {
        "bad json": (400, gw.headers, b"{not json"),
        "over the output limit": (400, gw.headers, json.dumps({"model": "fast", "input": "Hi",
                                                               "max_output_tokens": 10**9}).encode()),
        "unknown model": (404, gw.headers, json.dumps({"model": "nope", "input": "Hi"}).encode()),
        "no key": (401, {}, json.dumps({"model": "fast", "input": "Hi"}).encode()),
    }  # fmt: skip
    rids: dict[str, str] = {}
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for what, (status, headers, content) in refused.items():
            r = client.post(
                RESPONSES, content=content, headers={**headers, "content-type": "application/json"}
            )
            assert r.status_code == status, (what, r.text)
            rids[what] = r.headers["x-request-id"]

    def on_route(status: int) -> tuple[str, tuple[tuple[str, str], ...]]:
        return (
            "bourse_http_responses_total",
            (("method", "POST"), ("route", RESPONSES), ("status", str(status))),
        )

    expected = {
        on_route(400): 2,
        on_route(404): 1,
        on_route(401): 1,
        req("unknown", "refused"): 3,
        req("fast", "refused"): 1,
    }
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def settled() -> bool:
        nonlocal got
        got = {
            k: v
            for k, v in delta(before, scrape(gw.url)).items()
            if k[0] == "bourse_requests_total" or ("route", RESPONSES) in k[1]
        }
        return got == expected

    try:
        eventually(settled, "the counters to move by the refused requests")
    finally:
        assert got == expected
    eventually(lambda: all(access_lines(gw, rid) for rid in rids.values()), "an access line for each")
    for what, rid in rids.items():
        (line,) = access_lines(gw, rid)
        status = refused[what][0]
        assert (line["route"], line["status"], line["outcome"]) == (RESPONSES, status, "refused"), (
            what,
            line,
        )


def test_a_response_is_logged_and_recorded_under_its_route_attached_or_in_the_background(
    gateway: Served,
) -> None:
    """A Responses request runs as a chat completion, but its access lines (the request's
    and, in the background, its detached run's) and its usage record's ``endpoint`` name
    the route the client called: ``/v1/responses``."""
    gw = gateway
    with httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {gw.key}"}, timeout=30) as c:
        attached = c.post(RESPONSES, json={"model": "fast", "input": "Hi"})
        assert attached.status_code == 200, attached.text
        queued = c.post(RESPONSES, json={"model": "fast", "input": "Hi", "background": True})
        assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text
        bg = queued.json()["id"]
        eventually(lambda: c.get(f"{RESPONSES}/{bg}").json()["status"] == "completed", "the background one")
        for rid, lines in ((attached.json()["id"], 1), (bg, 2)):
            eventually(lambda rid=rid, n=lines: len(access_lines(gw, rid)) == n, f"{lines} access lines")  # type: ignore[misc]
            assert [d["route"] for d in access_lines(gw, rid)] == [RESPONSES] * lines, access_lines(gw, rid)
            record = c.get(f"/v1/usage/{rid}").json()
            assert record["endpoint"] == RESPONSES, record
        [job] = [j for j in c.get("/v1/jobs").json()["data"] if j["request_id"] == bg]
        assert job["endpoint"] == RESPONSES, job


def test_the_live_gauges_are_scraped(gateway: Served) -> None:
    got = scrape(gateway.url)
    for product in ("fast", "slow", "relayed"):
        cluster = (("product", product), ("scope", "cluster"))  # the book's: the same on every replica
        assert ("bourse_book_waiting_orders", cluster) in got
        dep = (("deployment", f"{product}/0"), ("product", product), ("scope", "cluster"))
        assert got[("bourse_deployment_slots", dep)] >= 1
        assert got[("bourse_deployment_breaker_state", dep)] == 0
    assert ("bourse_holds", (("scope", "cluster"), ("state", "reconciling"))) in got
    assert ("bourse_jobs", (("scope", "cluster"), ("state", "queued"))) in got
    assert any(k[0] == "process_resident_memory_bytes" for k in got)


def test_a_dead_upstream_is_logged_with_its_deployment(tmp_path: Path) -> None:
    dying = DyingUpstream("x")
    config = f"""
[server]
log_format = "json"
[products.dead]
max_requeues = 0
[[products.dead.deployments]]
engine = "openai"
base_url = "{dying.base_url}"
model = "x"
breaker_threshold = 1
cooldown_s = 60
probe_interval_s = 0  # probed at start only (it passes); then its request meets it dead
"""
    with dying, serve_process(tmp_path, "dead", config, tmp_path / "data", ADMIN_KEY) as (url, proc):
        dying.refuse()
        gw = Served(url, max(tmp_path.glob("dead-*.log")), proc, "", Recorder(None))
        gw.key = gw.account("dead", 10.0)
        r = httpx.post(url + "/v1/chat/completions", json=body("dead"), headers=gw.headers, timeout=30)
        assert r.status_code in (502, 503), r.text

        def warned() -> list[dict[str, Any]]:
            return [
                json.loads(x) for x in gw.log_text().splitlines() if x.startswith("{") and '"WARNING"' in x
            ]

        eventually(lambda: len(warned()) >= 2, "the WARN lines")
        msgs = {d["msg"].split(":")[0]: d for d in warned()}
        failure = msgs["upstream failure on deployment dead/0 (connect)"]
        assert failure["deployment"] == "dead/0" and failure["kind"] == "connect"
        assert "circuit breaker of deployment dead/0 opened (cooling down)" in msgs
        got = scrape(url)
        assert (
            got[
                (
                    "bourse_upstream_failures_total",
                    (("deployment", "dead/0"), ("kind", "connect"), ("product", "dead")),
                )
            ]
            == 1
        )
        dead = (("deployment", "dead/0"), ("product", "dead"), ("scope", "cluster"))
        assert got[("bourse_deployment_breaker_state", dead)] == 1


# -- traces -----------------------------------------------------------------------------------


def test_traces_reach_the_collector_under_the_clients_trace(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    with (
        serve_app_in_thread(receiver) as otlp,
        served(tmp_path, "obs-traced", log_format="text", otlp=otlp + "/v1/traces") as gw,
    ):
        r = httpx.post(gw.url + "/v1/chat/completions", json=body("relayed"),
                           headers={**gw.headers, "traceparent": TRACEPARENT}, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        names = {"bourse.run", "bourse.book.wait", "bourse.engine.attempt", "bourse.settle"}

        def exported() -> bool:
            with receiver.lock:
                return names <= {n for t, _, _, n in receiver.spans if t == CLIENT_TRACE}

        eventually(exported, "the run's spans at the collector")
        with receiver.lock:
            spans = {n: (s, p) for t, s, p, n in receiver.spans if t == CLIENT_TRACE}
        root_id, root_parent = spans["bourse.run"]
        assert root_parent == CLIENT_PARENT
        assert all(spans[n][1] == root_id for n in names - {"bourse.run"})
        # the upstream got the attempt's span as its parent, in the client's trace
        sent = [h["traceparent"] for h in gw.upstream.headers if "traceparent" in h]
        assert sent == [f"00-{CLIENT_TRACE}-{spans['bourse.engine.attempt'][0]}-01"]
        eventually(lambda: f"request_id={rid}" in gw.log_text(), "the text access line")


# -- switched off ------------------------------------------------------------------------------


def test_metrics_off_is_a_404_and_nothing_is_counted() -> None:
    config = """
[server]
metrics = false
access_log = false
[products.fast]
[[products.fast.deployments]]
engine = "sim"
"""
    with running_gateway(config) as gw:
        r = httpx.post(gw.v1 + "/chat/completions", json=body("fast"), headers=gw.headers, timeout=30)
        assert r.status_code == 200
        r = httpx.get(gw.url + "/metrics", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
