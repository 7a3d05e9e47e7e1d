"""The frames of a streamed answer for each preset of SPEC section 12 (sections 4 to 6),
read from the raw SSE bytes of the app in process: the head, the queue comment, the
chunks, the usage chunk and its receipt, the error frame and the ``[DONE]`` rules."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from bourse.engines.sim import REASONING_TOKENS
from tests.http.gateway import FLOOR
from tests.support.asgi import InProcessGateway
from tests.support.sse import SSEResult

pytestmark = pytest.mark.anyio

FAIL_AFTER_3 = {"fail_after_tokens": 3, "output_tokens": 10}
WITH_USAGE = {"include_usage": True}
RECEIPT_KEYS = {"cost_micros", "latency_ms", "ttft_ms", "quote_micros", "outcome"}
HIPS_KEYS = {"cost_micros", "latency_ms", "quote", "outcome"}
X_MARKET_KEYS = {"bid", "cleared_price", "level", "position_at_entry", "queued_ms", "requeues", "deployment"}


@dataclass(frozen=True)
class Sheet:
    """What a product's policy shows on the wire."""

    product: str
    usage_always: bool = False
    done_after_error: bool = True
    error_finish_reason: bool = True
    receipt: str = "receipt"
    headers: str = "x-bourse-"
    reasoning: str = "reasoning_content"
    charge_on_error: bool = False
    reconciles: bool = False
    """An answer without the engine's usage keeps its hold for an operator."""


SHEETS = [
    Sheet("default"),
    Sheet("hips", done_after_error=False, error_finish_reason=False, receipt="hips", headers="x-hips-"),
    Sheet("openfill"),
    Sheet("aigrid", usage_always=True, reconciles=True),
    Sheet("gopuram", usage_always=True, reasoning="reasoning", charge_on_error=True),
    Sheet(
        "knobs", usage_always=True, done_after_error=False, error_finish_reason=False, reasoning="reasoning"
    ),
]
IDS = [s.product for s in SHEETS]


def _data_kinds(res: SSEResult) -> list[str]:
    return [k for k in res.kinds() if not k.startswith("c:")]


def _usage_chunks(res: SSEResult) -> list[dict[str, Any]]:
    return [c for c in res.chunks if c.get("choices") == []]


def _the_usage_chunk(res: SSEResult) -> dict[str, Any]:
    [u] = _usage_chunks(res)
    return u


def _assert_receipt(sheet: Sheet, chunk: dict[str, Any], outcome: str) -> dict[str, Any]:
    """The usage chunk's receipt object: named per the sheet, with the sheet's keys."""
    other = "receipt" if sheet.receipt == "hips" else "hips"
    assert other not in chunk, chunk
    receipt: dict[str, Any] = chunk[sheet.receipt]
    assert set(receipt) == (HIPS_KEYS if sheet.receipt == "hips" else RECEIPT_KEYS), receipt
    assert receipt["outcome"] == outcome, receipt
    assert isinstance(receipt["latency_ms"], int | float) and receipt["latency_ms"] >= 0, receipt
    assert receipt["cost_micros"] == chunk["usage"]["cost_micros"], chunk
    return receipt


# -- the head -------------------------------------------------------------------------------


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_head_has_the_sse_headers_and_the_quote_but_no_cost(gw: InProcessGateway, sheet: Sheet) -> None:
    res = await gw.sse({"model": sheet.product, "seed": 1})
    assert res.status == 200
    h = res.headers
    assert h["content-type"] == "text/event-stream; charset=utf-8"
    assert h["cache-control"] == "no-cache, no-transform"
    assert h["x-accel-buffering"] == "no"
    assert h["x-request-id"].startswith("chatcmpl-")
    assert int(h[f"{sheet.headers}quote-micros"]) > 0
    # the cost and latency need the finished answer: never in the head of a stream
    for name in ("cost-micros", "latency-ms"):
        assert f"x-bourse-{name}" not in h and f"x-hips-{name}" not in h, dict(h)
    other = "x-bourse-" if sheet.headers == "x-hips-" else "x-hips-"
    assert not [k for k in h if k.startswith(other)], dict(h)


# -- a completed answer ------------------------------------------------------------------------


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_completed_stream_unasked(gw: InProcessGateway, sheet: Sheet) -> None:
    """``: queued bid=…`` first, the chunks, the usage chunk only under ``usage_chunk =
    always``, then ``[DONE]``; every chunk carries the request id and the product."""
    res = await gw.sse({"model": sheet.product, "seed": 2})
    kinds = res.kinds()
    assert kinds[0] == f"c:queued bid={FLOOR:g}", kinds
    tail = ["usage", "DONE"] if sheet.usage_always else ["DONE"]
    content = res.content_chunks
    assert kinds[1:] == ["data"] * len(content) + tail, kinds
    rid = res.headers["x-request-id"]
    for c in res.chunks:
        assert (c["id"], c["model"], c["object"]) == (rid, sheet.product, "chat.completion.chunk"), c
    for c in content:
        assert "usage" not in c and sheet.receipt not in c, c
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in content]
    assert finishes == [None] * (len(content) - 1) + ["stop"], finishes
    assert res.raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_include_usage_false_is_the_policy_default(gw: InProcessGateway, sheet: Sheet) -> None:
    res = await gw.sse({"model": sheet.product, "seed": 2, "stream_options": {"include_usage": False}})
    assert len(_usage_chunks(res)) == (1 if sheet.usage_always else 0), res.kinds()


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_usage_chunk_when_asked_carries_usage_cost_and_receipt(
    gw: InProcessGateway, sheet: Sheet
) -> None:
    res = await gw.sse({"model": sheet.product, "seed": 4, "stream_options": WITH_USAGE})
    assert _data_kinds(res)[-2:] == ["usage", "DONE"], res.kinds()
    u = _the_usage_chunk(res)
    rid = res.headers["x-request-id"]
    assert (u["id"], u["model"], u["object"], u["choices"]) == (
        rid,
        sheet.product,
        "chat.completion.chunk",
        [],
    )
    usage = u["usage"]
    assert usage["completion_tokens"] == len(res.content_chunks)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "usage_estimated" not in usage
    # one micro-USD per token at this floor
    assert usage["cost_micros"] == usage["total_tokens"]
    assert usage["cost"] == usage["cost_micros"] / 1_000_000
    assert set(usage["x_market"]) == X_MARKET_KEYS
    assert usage["x_market"]["cleared_price"] == FLOOR
    assert usage["x_market"]["deployment"] == f"{sheet.product}-a"
    receipt = _assert_receipt(sheet, u, "completed")
    quote = receipt["quote"] if sheet.receipt == "hips" else receipt["quote_micros"]
    assert quote == int(res.headers[f"{sheet.headers}quote-micros"]) >= receipt["cost_micros"]


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_an_answer_without_engine_usage_is_estimated_or_reconciled(
    gw: InProcessGateway, sheet: Sheet
) -> None:
    body = {"model": sheet.product, "seed": 2, "sim": {"omit_usage": True, "output_tokens": 5}}
    res = await gw.sse({**body, "stream_options": WITH_USAGE})
    assert _data_kinds(res)[-2:] == ["usage", "DONE"], res.kinds()
    u = _the_usage_chunk(res)
    usage = u["usage"]
    assert usage["usage_estimated"] is True and usage["completion_tokens"] == 5, usage
    if sheet.reconciles:
        assert _assert_receipt(sheet, u, "reconciling")["cost_micros"] == 0
    else:
        assert _assert_receipt(sheet, u, "completed")["cost_micros"] == usage["total_tokens"]


async def test_the_receipt_in_the_stream_is_the_usage_record(gw: InProcessGateway) -> None:
    res = await gw.sse({"model": "default", "seed": 5, "stream_options": WITH_USAGE})
    u = _the_usage_chunk(res)
    r = await gw.get(f"/v1/usage/{res.headers['x-request-id']}")
    assert r.status_code == 200, r.text
    record = r.json()
    assert record["receipt"] == u["receipt"]
    assert record["usage"] == u["usage"]
    assert record["outcome"] == "completed"


# -- an error after the stream started ---------------------------------------------------------


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_error_after_output_frames(gw: InProcessGateway, sheet: Sheet) -> None:
    """The chunks so far, the usage chunk (when the policy always sends it), the error
    frame, then ``[DONE]`` unless the policy says otherwise."""
    res = await gw.sse({"model": sheet.product, "seed": 2, "sim": FAIL_AFTER_3})
    assert res.status == 200
    expected = ["data"] * 3 + (["usage"] if sheet.usage_always else []) + ["error"]
    if sheet.done_after_error:
        expected.append("DONE")
    assert _data_kinds(res) == expected, res.kinds()
    assert (b"[DONE]" in res.raw) == sheet.done_after_error
    [frame] = [c for c in res.chunks if "error" in c]
    err = frame["error"]
    assert err["code"] == "upstream_error" and err["type"] and err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    if not sheet.error_finish_reason:
        assert set(frame) == {"error"}, frame
        return
    assert frame["id"] == res.headers["x-request-id"]
    assert (frame["model"], frame["object"]) == (sheet.product, "chat.completion.chunk")
    assert frame["choices"] == [{"index": 0, "delta": {}, "finish_reason": "error"}]


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_error_after_output_with_usage_charges_per_policy(gw: InProcessGateway, sheet: Sheet) -> None:
    """Asked for usage, the receipt precedes the error frame: outcome ``error``, the
    generated tokens charged only where the policy charges errors."""
    res = await gw.sse({"model": sheet.product, "seed": 2, "sim": FAIL_AFTER_3, "stream_options": WITH_USAGE})
    kinds = _data_kinds(res)
    assert kinds[:5] == ["data", "data", "data", "usage", "error"], res.kinds()
    u = _the_usage_chunk(res)
    usage = u["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["usage_estimated"] is True  # the engine failed before its usage
    receipt = _assert_receipt(sheet, u, "error")
    assert receipt["cost_micros"] == (usage["total_tokens"] if sheet.charge_on_error else 0)


async def test_error_before_output_requeues_then_is_an_in_band_502(gw: InProcessGateway) -> None:
    """A transient failure before any output goes back to the book (a ``requeued``
    comment each time, nothing charged); after the last requeue: 502 in band."""
    res = await gw.sse(
        {"model": "flaky", "seed": 2, "sim": {"fail_before_output": -1}, "stream_options": WITH_USAGE}
    )
    assert res.status == 200
    kinds = res.kinds()
    requeued = "c:requeued (transient backend failure), waiting"
    assert kinds == [f"c:queued bid={FLOOR:g}", requeued, requeued, requeued, "error", "DONE"], kinds
    assert res.chunks[-1]["error"]["code"] == "upstream_error"
    assert res.chunks[-1]["choices"][0]["finish_reason"] == "error"


async def test_a_requeue_then_success_counts_in_x_market(gw: InProcessGateway) -> None:
    res = await gw.sse(
        {"model": "flaky", "seed": 2, "sim": {"fail_before_output": 1}, "stream_options": WITH_USAGE}
    )
    kinds = res.kinds()
    assert kinds[:2] == [f"c:queued bid={FLOOR:g}", "c:requeued (transient backend failure), waiting"], kinds
    assert kinds[-2:] == ["usage", "DONE"], kinds
    assert _the_usage_chunk(res)["usage"]["x_market"]["requeues"] == 1


async def test_a_bad_sim_object_is_a_400_before_the_stream(gw: InProcessGateway) -> None:
    """The body's ``sim`` object is checked at the edge (``bourse.wire.sim``), so the
    engine never gets to refuse it: an HTTP 400 naming the knob, no stream."""
    res = await gw.sse({"model": "default", "sim": {"no_such_setting": 1}})
    assert res.status == 400 and res.frames == [], res.kinds()
    err = res.body_json["error"]
    assert (err["code"], err["type"]) == ("invalid_request", "invalid_request_error"), err
    assert err["param"] == "sim.no_such_setting" and "no_such_setting" in err["message"], err


# -- chunk contents ----------------------------------------------------------------------------


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_reasoning_arrives_under_the_policy_name(gw: InProcessGateway, sheet: Sheet) -> None:
    res = await gw.sse({"model": sheet.product, "seed": 2, "sim": {"reasoning": True}})
    other = "reasoning" if sheet.reasoning == "reasoning_content" else "reasoning_content"
    deltas = [c["choices"][0]["delta"] for c in res.content_chunks]
    assert all(d.get(sheet.reasoning) for d in deltas[:REASONING_TOKENS]), deltas
    assert not any(other in d for d in deltas), deltas
    assert deltas[REASONING_TOKENS].get("content"), deltas


async def test_tool_call_arguments_stream_in_fragments_by_index(gw: InProcessGateway) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    res = await gw.sse({"model": "default", "seed": 11, "tools": tools, "sim": {"tool_call": True}})
    calls = [tc for c in res.content_chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert {tc["index"] for tc in calls} == {0}
    fragments = [tc["function"]["arguments"] for tc in calls[1:]]
    assert len(fragments) >= 2 and all(fragments), calls
    assert isinstance(json.loads("".join(fragments)), dict)
    assert res.content_chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_legacy_completions_stream_text_completion_chunks(gw: InProcessGateway) -> None:
    res = await gw.sse(
        {"model": "default", "prompt": "Once upon a time", "seed": 3, "stream_options": WITH_USAGE},
        path="/v1/completions",
    )
    assert res.status == 200
    rid = res.headers["x-request-id"]
    assert rid.startswith("cmpl-")
    for c in res.chunks:
        assert (c["id"], c["model"], c["object"]) == (rid, "default", "text_completion"), c
    for c in res.content_chunks:
        assert isinstance(c["choices"][0]["text"], str)
    assert _data_kinds(res)[-2:] == ["usage", "DONE"]
    assert _the_usage_chunk(res)["usage"]["completion_tokens"] == len(res.content_chunks)


async def test_request_ids_differ_between_requests(gw: InProcessGateway) -> None:
    ids = {(await gw.sse({"model": "default", "seed": 1})).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
