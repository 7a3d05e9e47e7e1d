"""A hypothesis property over hostile sizes, run on every route: no 500.

The routes are the app's own, read when the module is collected from a gateway built
(not started) on this module's config: its OpenAPI document's operations and the
dashboard's route table (which the document leaves out). Each route is a test case of
its own, and the three generation routes a second, streamed one, so that no route is
left to chance. Each case's examples go over real HTTP to one served gateway (the
bounded HTTP protocol ``bourse serve`` uses) with the credentials the route takes (the
user's API key on ``/v1``, the admin key on ``/admin``, a dashboard session's cookie,
origin and CSRF token on ``/dashboard``) and real ids in the path (the account, a
key, a hold, a job, a stored response, a request), so that each request reaches the
route's own code: its head padded to a drawn size around and past
``[server] max_header_bytes`` (64 KiB), its body (every POST) the route's documented
example with a drawn field nested to a drawn depth around and past
``[server] max_json_depth`` (64), orjson's 254 levels (what it can write) and 1024 (what
it can read); a field that takes JSON of any shape (a ``json_schema``, a tool's
``parameters``, job ``metadata``) is nested where it is read.

Whatever the route does with it: no 5xx but a 503 the route documents, never an
``internal_error`` (in the body or a stream's frames), every error is the envelope; a
head past the limit is a 431 and one well within it is not; on a route that takes a
body, a body nested past the limit is a 400 naming ``max_json_depth`` (or a 413 if it is
also past the route's size limit) and one within it is not; a streamed answer ends as a
stream should, without an error frame. Each case also checks its premise: the route's
own code answered (not only 401, 403 or 431), a body route refused a body for its depth,
a generation route or ``/v1/jobs`` served a body nested to the limit. After each case
the fault suite's ledger check runs (tests/faults/conftest.py), and after all of them
the books are at rest and balance.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import tempfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bourse.container import build
from bourse.http import dashboard
from bourse.http.dashboard.roles import ACTIONS
from bourse.settings import Environment, parse_config
from tests.faults.ledger import read_books
from tests.support.gateway import ADMIN_KEY, Gateway, running_gateway

CONFIG = """
[server]
log_level = "warning"

[products.h]
max_output_tokens = 16
[[products.h.deployments]]
engine = "sim"
slots = 8
floor = 0.1
ttft_ms = 0
tokens_per_s = 5000
"""
HEAD_LIMIT = 64 * 1024
DEPTH_LIMIT = 64
HEAD_SLACK = 2048
"""More than the request line and the client's own headers take (the session cookie too)."""
EXAMPLES = 10
"""Drawn examples per route, on top of the explicit ones (:data:`EXPLICIT`)."""
GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
EVENT_STREAMS = ("/dashboard/api/markets/{product}/events", "/dashboard/api/requests/events")
"""Dashboard routes that stream until the client leaves: their head is read, not their body."""
DASHBOARD_BODIES = {("POST", "/dashboard/api/session"), ("POST", "/dashboard/api/holds/{hold_id}/settle")} | {
    (a.method, a.path)
    for a in ACTIONS
    if a.method not in ("GET", "DELETE") and not a.name.startswith("hold.")
}
"""The dashboard routes that read a JSON body (the document's routes say so themselves;
a DELETE reads none)."""
DOCUMENTED_503 = {"no_capacity", "draining"}
FIELDS: dict[str, list[str]] = {
    "/v1/chat/completions": ["response_format", "tools", "metadata", "messages", "x"],
    "/v1/completions": ["", "prompt", "metadata", "x"],
    "/v1/responses": ["text", "tools", "metadata", "input", "x"],
    "/v1/jobs": ["body", "metadata", "x"],
    "/dashboard/api/session": ["", "key", "x"],
}
"""The fields to nest per route, the first one a body the route serves at any depth within
the limit, the second one it refuses past it (``""``: none, the example as it is); any
other route: :data:`ANY_FIELDS`."""
ANY_FIELDS = ["", "x", "metadata", "key", "amount_micros", "amount_usd", "products", "reason", "grace_s"]
SLOT = "@@"
"""Where the nested value goes in a wrapper."""
WRAPPERS = {
    (
        "/v1/chat/completions",
        "response_format",
    ): '{"type": "json_schema", "json_schema": {"name": "n", "schema": @@}}',
    ("/v1/chat/completions", "tools"): '[{"type": "function", "function": {"name": "f", "parameters": @@}}]',
    ("/v1/responses", "text"): '{"format": {"type": "json_schema", "name": "n", "schema": @@}}',
    ("/v1/responses", "tools"): '[{"type": "function", "name": "f", "parameters": @@}]',
    ("/v1/jobs", "body"): '{"model": "h", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
    '"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": @@}}}',
}
"""A field read as JSON of any shape, the nested value at its slot (a JSON object there)."""
QUERIES = {"/dashboard/api/requests/{request_id}": "?account=test"}
"""What a route needs in its query to find the ids in its path (the operator names the account)."""


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    stream: bool = False
    body: bool = False
    """Whether the route reads a JSON body."""
    example: dict[str, Any] = field(default_factory=dict)
    """The body the route documents (an empty object if none)."""
    errors: frozenset[str] = frozenset()
    """The statuses the document says it answers."""

    @property
    def id(self) -> str:
        return f"{self.method} {self.path}" + (" stream" if self.stream else "")

    @property
    def who(self) -> str:
        for prefix, kind in (("/v1/", "user"), ("/admin/", "admin"), ("/dashboard", "session")):
            if self.path.startswith(prefix):
                return kind
        return "none"


def _route_table() -> list[Route]:
    """Every route of a gateway on :data:`CONFIG`: its document's operations (with their
    examples and answers) and the dashboard's routes; the generation routes twice."""
    cfg = parse_config(tomllib.loads(CONFIG), "<test config>", env={})
    with tempfile.TemporaryDirectory(prefix="bourse-routes-") as tmp:
        container = build(cfg, data_dir=tmp, env=Environment(admin_key=ADMIN_KEY))

        async def document() -> dict[str, Any]:
            transport = httpx.ASGITransport(app=container.app())
            async with httpx.AsyncClient(transport=transport, base_url="http://routes") as client:
                out: dict[str, Any] = (await client.get("/openapi.json")).json()
                return out

        doc = asyncio.run(document())
        table = [
            Route(
                method.upper(),
                path,
                body="requestBody" in op,
                example=_example(op),
                errors=frozenset(op.get("responses", {})),
            )
            for path, ops in doc["paths"].items()
            for method, op in ops.items()
        ]
        table += [
            Route(m, r.path, body=(m, r.path) in DASHBOARD_BODIES)
            for r in dashboard.routes(container)
            for m in sorted(r.methods or ())
            if m != "HEAD"
        ]
    table += [Route("POST", path, stream=True, body=True, example=r.example, errors=r.errors)
              for path in GENERATION for r in table if r.path == path]  # fmt: skip
    return sorted(table, key=lambda r: r.id)


def _example(op: dict[str, Any]) -> dict[str, Any]:
    """The operation's documented body, on this gateway's product."""
    content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
    text = json.dumps(content.get("example", {})).replace('"sim-fast"', '"h"')
    out: dict[str, Any] = json.loads(text)
    return out


ROUTES = _route_table()


@dataclass
class World:
    """The served gateway, a dashboard session, and real ids for the routes' paths."""

    gw: Gateway
    ids: dict[str, str]
    doomed_response: str
    """A response for the route that deletes one (the others read ``response_id``)."""
    cookie: str = ""
    csrf: str = ""
    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)
    """One for every client here (a client that loads its own takes ~0.1 s of CPU)."""

    def client(self) -> httpx.Client:
        """A client of its own for one request (a 431 closes the connection)."""
        return httpx.Client(timeout=30, verify=self.tls)

    def sign_in(self) -> tuple[str, str]:
        """A new dashboard session as the operator: (its cookie, its CSRF token)."""
        with self.client() as client:
            r = client.post(self.gw.url + "/dashboard/api/session", json={"key": ADMIN_KEY},
                            headers={"origin": self.gw.url})  # fmt: skip
        assert r.status_code == 200, r.text
        return f"bourse_session={r.cookies['bourse_session']}", str(r.json()["csrf"])

    def path(self, route: Route) -> str:
        """The route's path with each parameter given a real id."""
        out = []
        for part in route.path.split("/"):
            if part.startswith("{") and part.endswith("}"):
                name = part[1:-1].split(":")[0]
                if name == "response_id" and route.method == "DELETE":
                    part = self.doomed_response
                else:
                    part = self.ids[name]
            out.append(part)
        return "/".join(out) + QUERIES.get(route.path, "")

    def headers(self, route: Route, pad: int, count: int) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if route.who == "user":
            headers.update(self.gw.headers)
        elif route.who == "admin":
            headers.update(self.gw.admin_headers)
        elif route.who == "session":
            cookie, csrf = (
                self.sign_in() if route.path == "/dashboard/api/session/end" else (self.cookie, self.csrf)
            )
            headers.update({"cookie": cookie, "x-csrf-token": csrf, "origin": self.gw.url})
        each, extra = divmod(pad, count)
        for i in range(count):
            headers[f"x-pad-{i}"] = "p" * (each + (extra if i == 0 else 0))
        return headers


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with running_gateway(CONFIG) as gw:
        chat = {"model": "h", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(gw.v1 + "/chat/completions", json=chat, headers=gw.headers, timeout=30)
        assert r.status_code == 200, r.text
        request_id = r.headers["x-request-id"]
        assert httpx.get(f"{gw.v1}/usage/{request_id}", headers=gw.headers, timeout=30).status_code == 200
        responses = []
        for _ in range(2):
            r = httpx.post(gw.v1 + "/responses", json={"model": "h", "input": "hi", "max_output_tokens": 2},
                           headers=gw.headers, timeout=30)  # fmt: skip
            assert r.status_code == 200, r.text
            responses.append(r.json()["id"])
        r = httpx.post(gw.v1 + "/jobs", json={"endpoint": "/v1/chat/completions", "body": chat},
                       headers=gw.headers, timeout=30)  # fmt: skip
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        r = gw.admin("POST", "/admin/keys", json={"account": gw.account, "name": "rotated and revoked"})
        assert r.status_code == 201, r.text
        key_id = r.json()["id"]
        holds = gw.admin("GET", "/admin/holds", params={"account": gw.account}).json()["data"]
        # the admin account routes suspend, close, debit ... an account of their own, not
        # the one whose key the other routes call with
        r = gw.admin("POST", "/admin/accounts", json={"id": "sizes-admin", "credit_usd": 100.0})
        assert r.status_code == 201, r.text
        r = gw.admin("POST", "/admin/operators", json={"name": "sizes-op", "role": "viewer"})
        assert r.status_code == 201, r.text
        operator_id = r.json()["id"]
        ids = {"product": "h", "model": "h", "account_id": "sizes-admin", "key_id": key_id, "hold_id": holds[0]["id"],
               "job_id": job, "response_id": responses[0], "request_id": request_id,
               "operator_id": operator_id, "path": "app.css"}  # fmt: skip
        w = World(gw, ids, responses[1])
        w.cookie, w.csrf = w.sign_in()
        yield w


def json_depth(text: str) -> tuple[int, int]:
    """How many levels the JSON ``text`` nests (brackets outside strings), and how many
    are open at its end."""
    depth = deepest = 0
    quoted = escaped = False
    for ch in text:
        if quoted:
            escaped, quoted = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest, depth


def _nested(depth: int, shape: str) -> str:
    """JSON text nested ``depth`` levels (written by hand: no encoder writes 3000)."""
    if depth <= 0:
        return "1"
    if shape == "list":
        return "[" * depth + "1" + "]" * depth
    if shape == "dict":
        return '{"a":' * depth + "1" + "}" * depth
    opens = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return opens + "1" + closes


def _body(route: Route, field_index: int, depth: int, shape: str) -> tuple[str, bytes]:
    """The route's example with a field (the ``field_index``-th it takes) nested so
    that the body has ``depth`` levels (or as few as the wrapper allows): the field and
    the body."""
    fields = FIELDS.get(route.path, ANY_FIELDS)
    name = fields[field_index % len(fields)]
    base = dict(route.example)
    if route.path in GENERATION:
        base["stream"] = route.stream
    if route.path == "/dashboard/api/session":
        base["key"] = ADMIN_KEY
    if not name:
        return name, json.dumps(base).encode()
    base.pop(name, None)
    wrapper = WRAPPERS.get((route.path, name))
    shell = json.dumps(base)[:-1] + (", " if base else "") + f'"{name}": {wrapper or SLOT}' + "}"
    head, tail = shell.rsplit(SLOT, 1)
    levels = depth - json_depth(head)[1]
    value = _nested(levels, shape) if wrapper is None else '{"a":' + _nested(levels - 1, shape) + "}"
    return name, (head + value + tail).encode()


_depths = st.one_of(
    st.integers(1, 80),
    st.sampled_from([DEPTH_LIMIT - 1, DEPTH_LIMIT, DEPTH_LIMIT + 1, 128, 129, 253, 254, 255, 1024, 1025]),
    st.integers(1, 3000),
)
_pads = st.one_of(
    st.integers(0, 2048),
    st.integers(HEAD_LIMIT - 4096, HEAD_LIMIT + 4096),
    st.sampled_from([HEAD_LIMIT - HEAD_SLACK, HEAD_LIMIT, HEAD_LIMIT + 1, 4 * HEAD_LIMIT]),
    st.integers(0, 5 * HEAD_LIMIT),
)


def _sent(world: World, route: Route, body: bytes | None, headers: dict[str, str]) -> httpx.Response:
    """The route's answer, its body read (an endless event stream: its head only)."""
    with (
        world.client() as client,
        client.stream(route.method, world.gw.url + world.path(route), content=body, headers=headers) as r,
    ):
        if route.path not in EVENT_STREAMS or r.status_code != 200:
            r.read()
        return r


def _check_stream(route: Route, r: httpx.Response, where: Any) -> None:
    """A streamed answer's frames: no error frame, and it ends as its API ends a stream."""
    assert r.headers["content-type"].startswith("text/event-stream"), where
    assert r.content.endswith(b"\n\n"), (where, r.content[-200:])
    data = [line.removeprefix("data: ") for block in r.text.split("\n\n") for line in block.split("\n")
            if line.startswith("data: ")]  # fmt: skip
    assert data, where
    if route.path == "/v1/responses":
        assert json.loads(data[-1])["type"] == "response.completed", (where, data[-1][:300])
    else:
        assert data[-1] == "[DONE]", (where, data[-1][:300])
        data.pop()
    for frame in data:
        doc = json.loads(frame)
        assert not doc.get("error") and doc.get("type") not in ("error", "response.failed"), (
            where,
            frame[:300],
        )


@dataclass
class Seen:
    """What one route answered over its examples."""

    statuses: set[int | None] = field(default_factory=set)
    """Each answer's status (None: the gateway closed before the answer was read)."""
    too_deep: int = 0
    """400s naming ``max_json_depth``."""


def _one(world: World, route: Route, seen: Seen, depth: int, shape: str, field_index: int, pad: int,
         count: int) -> None:  # fmt: skip
    """One example: the request, and what its answer must be."""
    name, body = (
        _body(route, field_index, depth, shape) if route.method in ("POST", "PUT", "PATCH") else ("", b"")
    )
    nested = json_depth(body.decode())[0] if body else 0
    try:
        r = _sent(world, route, body or None, world.headers(route, pad, count))
    except httpx.RemoteProtocolError as exc:
        # a head past the limit: the gateway answers 431 and closes; a client still
        # sending its body may see the close first
        assert pad > HEAD_LIMIT - HEAD_SLACK, (route.id, exc)
        seen.statuses.add(None)
        return
    seen.statuses.add(r.status_code)
    where = (route.id, r.status_code, name, nested, pad)
    text = r.text if route.path not in EVENT_STREAMS else ""
    assert "internal_error" not in text and "Traceback" not in text, (where, text[:300])
    if r.status_code >= 500:  # only a 503 the route documents
        assert r.status_code == 503 and "503" in route.errors, (where, text[:300])
        if route.path != "/readyz":  # its 503 is its own document
            code = r.json()["error"]["code"]
            assert code in DOCUMENTED_503 and "retry-after" in r.headers, (where, text[:300])
    if r.status_code >= 400 and route.path != "/readyz":
        assert "error" in r.json(), (where, text[:300])
    if pad > HEAD_LIMIT:
        assert r.status_code == 431, where
        return
    if pad < HEAD_LIMIT - HEAD_SLACK:
        assert r.status_code != 431, where
    if route.body and r.status_code != 431:
        names_limit = "max_json_depth" in text
        if nested > DEPTH_LIMIT:  # refused for its depth (or, first, for its size: a 413)
            assert (r.status_code == 400 and names_limit) or r.status_code == 413, (where, text[:300])
            seen.too_deep += r.status_code == 400
        else:
            assert not names_limit, (where, text[:300])
    if route.stream and r.status_code == 200:
        _check_stream(route, r, where)


# Threads of the in-process gateway (tenacity's and the webhook back-off's jitter) may
# draw from the global ``random`` while hypothesis draws; the requests draw nothing.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@pytest.mark.parametrize("route", ROUTES, ids=[r.id for r in ROUTES])
def test_no_size_of_head_or_nesting_gets_a_5xx_on_any_route(world: World, route: Route) -> None:
    seen = Seen()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        depth=_depths,
        shape=st.sampled_from(["list", "dict", "mixed"]),
        field_index=st.integers(0, 7),
        pad=_pads,
        count=st.integers(1, 8),
    )
    # within both limits, the route's own field at the depth limit: served as the route serves it
    @example(depth=DEPTH_LIMIT, shape="dict", field_index=0, pad=0, count=1)
    # one level past the depth limit: a 400 naming it
    @example(depth=DEPTH_LIMIT + 1, shape="mixed", field_index=1, pad=0, count=1)
    # a head just within the limit with a body past what orjson reads: still the 400
    @example(depth=1025, shape="list", field_index=1, pad=HEAD_LIMIT - HEAD_SLACK, count=3)
    # a head one byte past the limit, and four times it in eight headers: 431
    @example(depth=3, shape="dict", field_index=0, pad=HEAD_LIMIT + 1, count=1)
    @example(depth=255, shape="dict", field_index=0, pad=4 * HEAD_LIMIT, count=8)
    def examples(depth: int, shape: str, field_index: int, pad: int, count: int) -> None:
        _one(world, route, seen, depth, shape, field_index, pad, count)

    examples()
    # the premise: the route's own code answered (its credentials held), its body was read
    assert seen.statuses - {None, 401, 403, 431}, (route.id, seen)
    assert not route.body or seen.too_deep, (route.id, seen)
    if route.path in (*GENERATION, "/v1/jobs"):  # a body nested to the limit is served
        assert any(s is not None and 200 <= s < 300 for s in seen.statuses), (route.id, seen)


def test_every_kind_of_route_is_in_the_table() -> None:
    """The table is the app's: every prefix, both route tables, the streamed variants."""
    ids = {r.id for r in ROUTES}
    assert {"POST /v1/responses", "POST /v1/responses stream", "POST /dashboard/api/session",
            "GET /dashboard/api/requests/events", "POST /admin/holds/{hold_id}/settle",
            "GET /healthz"} <= ids, ids  # fmt: skip
    assert sum(r.stream for r in ROUTES) == len(GENERATION)
    assert {r.who for r in ROUTES} == {"user", "admin", "session", "none"}
    assert len(ROUTES) >= 60, len(ROUTES)


def test_the_books_balance_after_the_property(world: World) -> None:
    deadline = time.monotonic() + 10
    while True:
        books = read_books(Path(world.gw.data_dir), None)
        if not books.ids("open") and books.unfinished_jobs == 0:
            break
        assert time.monotonic() < deadline, books
        time.sleep(0.1)
    books.assert_balanced()
