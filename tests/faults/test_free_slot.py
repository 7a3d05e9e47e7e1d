"""Nobody holds a slot for free (issue 14, item 4).

Before the fix a request could hold a slot as long as it liked and pay nothing:
``sim: {"ttft_ms": 1e9}`` or ``{"tokens_per_s": 1e-308}`` was accepted, the built-in
config took per-request sim settings on its priced products, and no engine's
generation was ever ended for going quiet. Now:

- every per-request sim knob is bounded at the edge (a 400 naming the knob, before any
  hold or order);
- a product takes per-request sim settings only when its operator says so
  (``sim_overrides``), by default only when it charges nothing by itself (every floor
  is 0): the built-in priced products refuse them;
- a generation that gives no token for the product's ``stall_timeout_s`` is ended on
  every engine (the in-process ``sim`` and the ``openai`` engine here): an error frame
  after output (charged by the policy's ``charge_on_error``), a requeue then a 502
  before it (nothing charged), and the slot goes back at once.

The gateway runs in process (no socket) except the ``openai`` engine's upstream, a sim
upstream on a loopback port.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

from bourse.engines.sim import SimEngine, SimSettings
from bourse.engines.sim_server import create_sim_app
from bourse.services.completion import Finished
from bourse.services.ids import new_request_id
from bourse.settings import load_config
from bourse.wire.requests import validate
from bourse.wire.sim import SIM_KNOBS
from tests.support.asgi import InProcessGateway, in_process_gateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope
from tests.support.servers import serve_app_in_thread
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

STALL_S = 0.4
"""The products' stall timeout: a stall ends between 0.4 and 0.5 s."""
BOUND_S = 8.0
"""Every request here ends well within this (a stall the gateway does not end takes 30 s)."""


def _config(upstream: str) -> str:
    def product(name: str, knobs: str, deployment: str = 'engine = "sim"', floor: float = 1.0) -> str:
        return (
            f'[products.{name}]\n{knobs}\n[[products.{name}.deployments]]\nname = "{name}-a"\n'
            f"slots = 1\nfloor = {floor}\nbreaker_threshold = 1000\ncooldown_s = 0\n{deployment}\n"
        )

    stall = f"sim_overrides = true\nstall_timeout_s = {STALL_S}\nmax_requeues = 1"
    openai = f'engine = "openai"\nbase_url = "{upstream}/v1"\nmodel = "sim-upstream"'
    return "\n".join(
        [
            '[server]\nlog_level = "warning"\n',
            product("open", stall),
            product("generated", stall + '\npolicy = "gopuram"'),
            product("upstream", stall, openai),
            product("priced", ""),
            product("free", "", floor=0.0),
            product("free-off", "sim_overrides = false", floor=0.0),
        ]
    )


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with serve_app_in_thread(create_sim_app(SimSettings())) as url:
        yield url


@pytest.fixture(scope="module")
async def gw(upstream: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[InProcessGateway]:
    async with in_process_gateway(_config(upstream), tmp_path_factory.mktemp("free-slot")) as g:
        yield g


async def _chat(gw: InProcessGateway, model: str, sim: dict[str, Any], **body: Any) -> Any:
    with anyio.fail_after(BOUND_S):
        return await gw.post("/v1/chat/completions", {"model": model, "messages": USER, "sim": sim, **body})


async def _record(gw: InProcessGateway, request_id: str) -> dict[str, Any]:
    async def written() -> dict[str, Any] | None:
        r = await gw.get(f"/v1/usage/{request_id}")
        out: dict[str, Any] | None = r.json() if r.status_code == 200 else None
        return out

    return await await_until(written, what=f"the usage record of {request_id}")


async def _books_closed(gw: InProcessGateway) -> None:
    """No hold open, the ledger balanced, no sim generation still running."""

    async def closed() -> bool | None:
        r = await gw.admin("GET", "/admin/holds", params={"account": gw.account, "state": "open"})
        return True if r.json()["data"] == [] else None

    await await_until(closed, what="every hold closed")
    led = (await gw.admin("GET", "/admin/ledger")).json()
    assert led["credits_micros"] == led["balances_micros"] + led["holds_micros"] + led["revenue_micros"], led
    for name in ("open-a", "generated-a", "priced-a", "free-a"):
        engine = gw.container.engines[name]
        assert isinstance(engine, SimEngine) and engine.stats["running"] == 0, name


# -- bounds -------------------------------------------------------------------------------

PAST_BOUNDS: list[tuple[dict[str, Any], str]] = [
    ({"ttft_ms": 1e9}, "ttft_ms"),
    ({"ttft_ms": 30_001}, "ttft_ms"),
    ({"tokens_per_s": 1e-308}, "tokens_per_s"),
    ({"tokens_per_s": 0.5}, "tokens_per_s"),
    ({"tokens_per_s": 1e7}, "tokens_per_s"),
    ({"stall_s": 1e6, "stall_after_tokens": 1}, "stall_s"),
    ({"stall_s": 30.5, "stall_after_tokens": 1}, "stall_s"),
    ({"output_tokens": 10**9}, "output_tokens"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"fail_before_output": 10**6}, "fail_before_output"),
    ({"fail_after_tokens": 2**63}, "fail_after_tokens"),
    ({"stall_after_tokens": 10**9, "stall_s": 1}, "stall_after_tokens"),
    ({"ttft_ms": "soon"}, "ttft_ms"),
    ({"bogus": 1}, "bogus"),
]


@pytest.mark.parametrize(("sim", "knob"), PAST_BOUNDS, ids=[f"{k}={v}" for (v, k) in PAST_BOUNDS])
async def test_a_sim_knob_past_its_bound_is_a_400_before_any_hold(
    gw: InProcessGateway, sim: dict[str, Any], knob: str
) -> None:
    before = await gw.balance()
    for stream in (False, True):
        r = await _chat(gw, "open", sim, stream=stream, max_tokens=4)
        err = assert_error_envelope(r, 400, "invalid_request")
        assert err["param"] == f"sim.{knob}", err
    r = await gw.post("/v1/jobs", {"endpoint": "/v1/chat/completions",
                                   "body": {"model": "open", "messages": USER, "sim": sim}})  # fmt: skip
    assert_error_envelope(r, 400, "invalid_request")
    assert await gw.balance() == before
    await _books_closed(gw)


def test_every_knob_has_a_per_request_bound() -> None:
    for name, knob in SIM_KNOBS.items():
        assert knob.kind == "bool" or knob.request_max > knob.minimum, name


async def test_the_bounds_themselves_are_accepted(gw: InProcessGateway) -> None:
    sim = {"tokens_per_s": 1000, "fail_before_output": 0, "stall_after_tokens": 100_000, "stall_s": 30,
           "fail_after_tokens": 100_000, "max_output_tokens": 100_000, "output_tokens": 3}  # fmt: skip
    r = await _chat(gw, "open", sim, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# -- who may send sim settings -------------------------------------------------------------


def test_the_built_in_priced_products_take_no_sim_settings() -> None:
    cfg = load_config(None)
    for name in ("sim-fast", "sim-market"):
        product = cfg.products[name]
        assert min(d.floor for d in product.deployments) > 0
        assert product.takes_sim_overrides() is False, name


@pytest.mark.parametrize(
    ("model", "allowed"), [("priced", False), ("free-off", False), ("free", True), ("open", True)]
)
async def test_per_request_sim_settings_follow_the_product(
    gw: InProcessGateway, model: str, allowed: bool
) -> None:
    before = await gw.balance()
    r = await _chat(gw, model, {"output_tokens": 2}, max_tokens=4)
    if allowed:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2
    else:
        err = assert_error_envelope(r, 400, "invalid_request")
        assert err["param"] == "sim" and "sim_overrides" in err["message"], err
        assert await gw.balance() == before
        job = {"endpoint": "/v1/chat/completions", "body": {"model": model, "messages": USER, "sim": {}}}
        assert_error_envelope(await gw.post("/v1/jobs", job), 400, "invalid_request")
    # without a sim object every product serves
    with anyio.fail_after(BOUND_S):
        r = await gw.post("/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 2})
    assert r.status_code == 200, r.text
    await _books_closed(gw)


# -- stalls ---------------------------------------------------------------------------------

STALL_AFTER_3 = {"stall_after_tokens": 3, "stall_s": 30, "output_tokens": 8, "tokens_per_s": 1000}


@pytest.mark.parametrize(
    ("model", "charged", "code"),
    [
        ("open", False, "upstream_error"),
        ("generated", True, "provider_error"),
        ("upstream", False, "upstream_error"),
    ],
)
async def test_a_stream_that_stalls_after_output_ends_with_an_error_frame_and_frees_its_slot(
    gw: InProcessGateway, model: str, charged: bool, code: str
) -> None:
    t0 = time.monotonic()
    with anyio.fail_after(BOUND_S):
        res = await gw.sse({"model": model, "max_tokens": 8, "sim": STALL_AFTER_3})
    elapsed = time.monotonic() - t0
    assert res.status == 200
    kinds = [k for k in res.kinds() if not k.startswith("c:")]
    assert kinds[:3] == ["data", "data", "data"] and "error" in kinds, res.kinds()
    err = next(c for c in res.chunks if "error" in c)["error"]
    # the policy names an engine's failure (gopuram: provider_error)
    assert err["code"] == code and "no token for 0.4 s" in err["message"], err
    assert STALL_S <= elapsed < BOUND_S, elapsed
    rec = await _record(gw, res.headers["x-request-id"])
    usage = rec["usage"]
    assert rec["outcome"] == "error" and usage["completion_tokens"] == 3, rec
    # the policy decides the charge: gopuram charges what was generated, default nothing
    assert usage["cost_micros"] == (usage["total_tokens"] if charged else 0), usage
    # the one slot is free at once: the next request is admitted without waiting
    r = await _chat(gw, model, {"output_tokens": 2}, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["x_market"]["queued_ms"] < 1000, r.json()["usage"]
    await _books_closed(gw)


@pytest.mark.parametrize(("model", "stream"), [("open", False), ("open", True), ("upstream", True)])
async def test_a_stall_before_the_first_token_is_requeued_then_a_502_and_nothing_is_charged(
    gw: InProcessGateway, model: str, stream: bool
) -> None:
    before = await gw.balance()
    body = {"model": model, "max_tokens": 4, "sim": {"ttft_ms": 30_000}}
    with anyio.fail_after(BOUND_S):
        if stream:  # the head went out at once: the error comes in the stream
            res = await gw.sse(body)
            assert res.status == 200 and next(k for k in res.kinds() if not k.startswith("c:")) == "error"
            err = next(c for c in res.chunks if "error" in c)["error"]
            request_id = res.headers["x-request-id"]
        else:
            r = await gw.post("/v1/chat/completions", {**body, "messages": USER})
            err = assert_error_envelope(r, 502, "upstream_error")
            request_id = r.headers["x-request-id"]
    assert err["code"] == "upstream_error" and "no token for 0.4 s" in err["message"], err
    rec = await _record(gw, request_id)
    assert rec["usage"]["x_market"]["requeues"] == 1, rec  # max_requeues = 1
    assert rec["usage"]["cost_micros"] == 0 and await gw.balance() == before
    await _books_closed(gw)


async def test_a_whole_unary_answer_is_timed_by_its_engine_not_by_the_stall_clock(
    gw: InProcessGateway,
) -> None:
    """The ``openai`` engine asks its upstream for one non-streamed answer: nothing comes
    before the whole answer, and the engine's own answer timeout bounds that wait."""
    r = await _chat(gw, "upstream", {"ttft_ms": 1000, "output_tokens": 3}, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    await _books_closed(gw)


async def test_a_slow_reader_is_not_a_stall(gw: InProcessGateway) -> None:
    """The clock times the engine only: a consumer that holds a chunk longer than the
    stall timeout (a slow client, a full socket) does not end the generation."""
    ask = gw.container.completions
    body = {"model": "open", "messages": USER, "max_tokens": 4, "stream": True, "sim": {"output_tokens": 2}}
    principal = await ask.auth.user(f"Bearer {gw.api_key}")
    run = await ask.open("chat", body, validate("chat", body), principal, request_id=new_request_id("chat"))
    events = run.events()
    ends: list[Finished] = []
    async for ev in events:
        if isinstance(ev, Finished):
            ends.append(ev)
        else:
            await anyio.sleep(STALL_S * 2)  # the consumer holds each event past the timeout
    assert len(ends) == 1 and ends[0].error is None and ends[0].outcome == "completed", ends
    await _books_closed(gw)
