"""A client that leaves (SPEC section 7), from the app in process: mid-stream, each
preset cancels or drains the engine and charges the generated tokens; before the first
token the engine call is cancelled and nothing charged; while queued the order leaves
the book without reaching the engine. Nothing is written once the client is gone."""

from __future__ import annotations

import os
from typing import Any

import pytest

from bourse.engines.sim import SimEngine
from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

DRAINS = {"openfill", "aigrid"}
PRODUCTS = ["default", "hips", "openfill", "aigrid", "gopuram", "knobs"]
PACED = {"output_tokens": 20, "tokens_per_s": 400}
"""About 50 ms of generation: still running when the client leaves after two chunks."""


def _stats(gw: InProcessGateway, product: str) -> dict[str, int]:
    """The counters of the product's sim engine (generations started, completed, cancelled)."""
    engine = gw.container.engines[f"{product}-a"]
    assert isinstance(engine, SimEngine)
    return dict(engine.stats)


async def _record(gw: InProcessGateway, request_id: str) -> dict[str, Any]:
    """The usage record, once settlement (detached from the client) wrote it."""

    async def written() -> dict[str, Any] | None:
        r = await gw.get(f"/v1/usage/{request_id}")
        return r.json() if r.status_code == 200 else None

    return await await_until(written, what=f"the usage record of {request_id}")


@pytest.mark.parametrize("product", PRODUCTS)
async def test_leaving_mid_stream_cancels_or_drains_and_charges_what_was_generated(
    gw: InProcessGateway, product: str
) -> None:
    before = _stats(gw, product)
    role_first = product == "gopuram"  # sheet 004: a role-only first chunk, then content
    frames = 3 if role_first else 2
    res = await gw.sse_leaving({"model": product, "seed": 3, "sim": PACED}, data_frames=frames)
    assert res.status == 200
    assert [k for k in res.kinds() if not k.startswith("c:")] == ["data"] * frames, res.kinds()
    rec = await _record(gw, res.headers["x-request-id"])
    after = _stats(gw, product)
    usage = rec["usage"]
    assert rec["outcome"] == "disconnected", rec
    if product in DRAINS:  # the engine ran to its end, unread
        assert (after["completed"], after["cancelled"]) == (before["completed"] + 1, before["cancelled"])
        assert usage["completion_tokens"] == PACED["output_tokens"], usage
    else:  # the engine stopped at once
        assert (after["completed"], after["cancelled"]) == (before["completed"], before["cancelled"] + 1)
        assert 2 <= usage["completion_tokens"] < PACED["output_tokens"], usage  # 2 content frames read
    assert usage["cost_micros"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0, usage


async def test_leaving_before_the_first_token_cancels_the_engine_and_charges_nothing(
    gw: InProcessGateway,
) -> None:
    before = _stats(gw, "default")
    res = await gw.sse_leaving({"model": "default", "sim": {"ttft_ms": 50}}, data_frames=0)
    assert res.kinds() == ["c:queued bid=1"], res.kinds()
    rec = await _record(gw, res.headers["x-request-id"])
    after = _stats(gw, "default")
    assert after["started"] == before["started"] + 1
    assert after["cancelled"] == before["cancelled"] + 1
    assert rec["usage"]["cost_micros"] == 0, rec
    assert rec["usage"]["completion_tokens"] == 0, rec


async def test_leaving_while_queued_never_reaches_the_engine(gw: InProcessGateway) -> None:
    account = "leaver-" + os.urandom(4).hex()
    key = await gw.new_account(account, 1.0)
    auth = {"authorization": f"Bearer {key}"}
    holder = await gw.post(
        "/v1/jobs",
        {"endpoint": "/v1/chat/completions", "body": {"model": "single", "messages": USER, "max_tokens": 400,
                                                      "sim": {"output_tokens": 400, "tokens_per_s": 50}}},
        headers=auth,
    )  # fmt: skip
    assert holder.status_code == 202, holder.text
    job_id = holder.json()["id"]

    async def holder_running() -> bool:
        return bool((await gw.get(f"/v1/jobs/{job_id}", headers=auth)).json()["status"] == "running")

    await await_until(holder_running, what="the job holding the only slot")
    before = _stats(gw, "single")
    res = await gw.sse_leaving({"model": "single"}, data_frames=0)
    assert res.kinds() == ["c:queued bid=1"], res.kinds()
    rec = await _record(gw, res.headers["x-request-id"])
    assert rec["usage"]["cost_micros"] == 0 and rec["usage"]["x_market"]["deployment"] is None, rec
    assert _stats(gw, "single")["started"] == before["started"]
    assert (await gw.post(f"/v1/jobs/{job_id}/cancel", headers=auth)).json()["status"] == "canceled"
    view = (await gw.get("/v1/account", headers=auth)).json()
    assert view["open_holds_micros"] == 0, view
