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
FAIL_AT_ONCE = {"fail_after_tokens": 0}
WITH_USAGE = {"include_usage": True}
RECEIPT_KEYS = {"cost_micros", "latency_ms", "ttft_ms", "quote_micros", "outcome"}
HIPS_KEYS = {"cost_micros", "latency_ms", "quote", "outcome"}
X_MARKET_KEYS = {
    "bid", "start_bid", "deadline_s", "cleared_price", "level", "position_at_entry", "queued_ms", "requeues",
    "deployment",
}  # fmt: skip
ID_HEADERS = ("x-aigrid-invocation", "x-gopuram-request-id")
OPENAI_ERROR = ("message", "type", "param", "code")


@dataclass(frozen=True)
class Sheet:
    """What a product's policy shows on the wire."""

    product: str
    usage_always: bool = False
    done_after_error: bool = True
    error_frame: str = "chunk"
    """The error frame's top level: ``chunk`` (``id``, ``object``, ``created``, ``model``),
    ``envelope`` (``error`` alone) or ``envelope_id`` (``error`` and ``id``)."""
    error_finish_reason: bool = False
    """The error frame also carries ``choices: [{…, "finish_reason": "error"}]``."""
    error_keys: tuple[str, ...] = OPENAI_ERROR
    engine_code: str = "upstream_error"
    engine_type: str = "upstream_error"
    receipt: str = "receipt"
    headers: str = "x-bourse-"
    reasoning: str = "reasoning_content"
    charge_on_error: bool = False
    reconciles: bool = False
    """An answer without the engine's usage (also one that failed after output) keeps
    its hold for an operator."""
    id_prefix: str = "chatcmpl-"
    id_header: str | None = None
    """The header that repeats the request id besides ``x-request-id``."""
    usage_on_last_choice: bool = False
    """The usage rides on the terminal chunk (the one with the last choice) instead
    of a ``choices: []`` chunk of its own."""
    usage_before_error: bool = True
    """A usage chunk (always, or asked for) precedes the error frame of a failure."""
    split_role: bool = False
    """The role alone on the first chunk, the ``finish_reason`` alone (``delta: {}``) on the last."""


SHEETS = [
    Sheet("default"),
    Sheet(
        "hips", done_after_error=False, error_frame="envelope", receipt="hips", headers="x-hips-",
        usage_before_error=False,
    ),
    Sheet("openfill", error_frame="envelope"),
    Sheet(
        "aigrid", usage_always=True, error_frame="envelope_id", error_keys=("code", "message"),
        engine_code="provider_failed", reconciles=True, id_header="x-aigrid-invocation",
        usage_on_last_choice=True,
    ),
    Sheet(
        "gopuram", usage_always=True, error_finish_reason=True, error_keys=("message", "type", "code"),
        engine_code="provider_error", engine_type="api_error", reasoning="reasoning", charge_on_error=True,
        id_prefix="gen-", id_header="x-gopuram-request-id", split_role=True,
    ),
    Sheet(
        "knobs", usage_always=True, done_after_error=False, error_frame="envelope", error_finish_reason=True,
        reasoning="reasoning",
    ),
]  # fmt: skip
IDS = [s.product for s in SHEETS]
DEFAULT = SHEETS[0]


def _data_kinds(res: SSEResult) -> list[str]:
    """The data frames: ``usage`` for any chunk with a ``usage`` (also a terminal chunk
    that holds the last choice), ``error``, ``DONE``, else ``data``."""
    out = []
    for f in res.data_frames:
        if f.is_done:
            out.append("DONE")
            continue
        j = f.json
        out.append("error" if "error" in j else "usage" if "usage" in j else "data")
    return out


def _usage_chunks(res: SSEResult) -> list[dict[str, Any]]:
    return [c for c in res.chunks if "usage" in c]


def _the_usage_chunk(sheet: Sheet, res: SSEResult) -> dict[str, Any]:
    """The one chunk with the usage: ``choices: []``, or under ``usage_on_last_choice``
    the terminal chunk with its one choice."""
    [u] = _usage_chunks(res)
    if sheet.usage_on_last_choice:
        [choice] = u["choices"]
        assert choice["index"] == 0, u
    else:
        assert u["choices"] == [], u
    return u


def _tokens(res: SSEResult) -> int:
    """The chunks that carry a generated token (content or reasoning)."""
    deltas = [c["choices"][0]["delta"] for c in res.chunks if c.get("choices") and "error" not in c]
    return sum(1 for d in deltas if set(d) & {"content", "reasoning", "reasoning_content"})


def _error_frame(res: SSEResult) -> dict[str, Any]:
    [frame] = [c for c in res.chunks if "error" in c]
    return frame


def _assert_one_created(res: SSEResult) -> None:
    """One ``created`` per response, on every chunk and frame that has one."""
    created = {c["created"] for c in res.chunks if "created" in c}
    assert len(created) <= 1, [c.get("created") for c in res.chunks]


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


def _assert_error_frame(sheet: Sheet, res: SSEResult, code: str, error_type: str | None) -> dict[str, Any]:
    """The error frame in the sheet's exact shape; its ``error`` object."""
    frame = _error_frame(res)
    rid = res.headers["x-request-id"]
    err: dict[str, Any] = frame["error"]
    assert list(err) == list(sheet.error_keys), err
    assert err["code"] == code and isinstance(err["message"], str) and err["message"], err
    if "type" in sheet.error_keys:
        assert err["type"] == error_type, err
    if "param" in sheet.error_keys:
        assert err["param"] is None, err
    keys = {"error"}
    if sheet.error_frame == "chunk":
        keys |= {"id", "object", "created", "model"}
        assert (frame["id"], frame["model"], frame["object"]) == (rid, sheet.product, "chat.completion.chunk")
    if sheet.error_frame == "envelope_id":
        assert list(frame) == ["error", "id"] and frame["id"] == rid, frame
    if sheet.error_finish_reason:
        keys.add("choices")
        assert frame["choices"] == [{"index": 0, "delta": {}, "finish_reason": "error"}], frame
    assert set(frame) == keys | ({"id"} if sheet.error_frame == "envelope_id" else set()), frame
    return err


# -- the head -------------------------------------------------------------------------------


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_head_has_the_sse_headers_and_the_quote_but_no_cost(gw: InProcessGateway, sheet: Sheet) -> None:
    res = await gw.sse({"model": sheet.product, "seed": 1})
    assert res.status == 200
    h = res.headers
    assert h["content-type"] == "text/event-stream; charset=utf-8"
    assert h["cache-control"] == "no-cache, no-transform"
    assert h["x-accel-buffering"] == "no"
    rid = h["x-request-id"]
    assert rid.startswith(sheet.id_prefix) and len(rid) > len(sheet.id_prefix), rid
    for name in ID_HEADERS:
        assert h.get(name) == (rid if name == sheet.id_header else None), dict(h)
    assert int(h[f"{sheet.headers}quote-micros"]) > 0
    # the cost and latency need the finished answer: never in the head of a stream
    for name in ("cost-micros", "latency-ms"):
        assert f"x-bourse-{name}" not in h and f"x-hips-{name}" not in h, dict(h)
    other = "x-bourse-" if sheet.headers == "x-hips-" else "x-hips-"
    assert not [k for k in h if k.startswith(other)], dict(h)


# -- a completed answer ------------------------------------------------------------------------


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_completed_stream_unasked(gw: InProcessGateway, sheet: Sheet) -> None:
    """``: queued bid=…`` first, the chunks, the usage only under ``usage_chunk =
    always`` (on a chunk of its own, or on the terminal chunk), then ``[DONE]``; every
    chunk carries the request id, the product and the one ``created``."""
    res = await gw.sse({"model": sheet.product, "seed": 2})
    kinds = res.kinds()
    assert kinds[0] == f"c:queued bid={FLOOR:g}", kinds
    assert not [k for k in kinds[1:] if k.startswith("c:")], kinds
    content = [c for c in res.chunks if c.get("choices")]
    n = len(content)
    if not sheet.usage_always:
        expected = ["data"] * n
    elif sheet.usage_on_last_choice:
        expected = ["data"] * (n - 1) + ["usage"]
    else:
        expected = ["data"] * n + ["usage"]
    assert _data_kinds(res) == [*expected, "DONE"], res.kinds()
    rid = res.headers["x-request-id"]
    for c in res.chunks:
        assert (c["id"], c["model"], c["object"]) == (rid, sheet.product, "chat.completion.chunk"), c
    _assert_one_created(res)
    plain = content[:-1] if sheet.usage_on_last_choice else content
    for c in plain:
        assert "usage" not in c and sheet.receipt not in c, c
    deltas = [c["choices"][0]["delta"] for c in content]
    finishes = [c["choices"][0]["finish_reason"] for c in content]
    assert finishes == [None] * (n - 1) + ["stop"], finishes
    if sheet.split_role:  # the role alone, the content, then the finish_reason alone
        assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}, deltas
        assert all(set(d) == {"content"} for d in deltas[1:-1]), deltas
    else:
        assert deltas[0]["role"] == "assistant" and deltas[0]["content"], deltas
        assert all(set(d) == {"content"} for d in deltas[1:]), deltas
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
    u = _the_usage_chunk(sheet, res)
    rid = res.headers["x-request-id"]
    assert (u["id"], u["model"], u["object"]) == (rid, sheet.product, "chat.completion.chunk")
    if sheet.usage_on_last_choice:  # the terminal chunk: the last token and the finish_reason
        assert u["choices"][0]["finish_reason"] == "stop" and u["choices"][0]["delta"]["content"], u
    _assert_one_created(res)
    usage = u["usage"]
    assert usage["completion_tokens"] == _tokens(res)
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
    u = _the_usage_chunk(sheet, res)
    usage = u["usage"]
    assert usage["usage_estimated"] is True and usage["completion_tokens"] == 5, usage
    if sheet.reconciles:
        assert _assert_receipt(sheet, u, "reconciling")["cost_micros"] == 0
    else:
        assert _assert_receipt(sheet, u, "completed")["cost_micros"] == usage["total_tokens"]


async def test_the_receipt_in_the_stream_is_the_usage_record(gw: InProcessGateway) -> None:
    res = await gw.sse({"model": "default", "seed": 5, "stream_options": WITH_USAGE})
    u = _the_usage_chunk(DEFAULT, res)
    r = await gw.get(f"/v1/usage/{res.headers['x-request-id']}")
    assert r.status_code == 200, r.text
    record = r.json()
    assert record["receipt"] == u["receipt"]
    assert record["usage"] == u["usage"]
    assert record["outcome"] == "completed"


# -- an error after the stream started ---------------------------------------------------------


def _failure_kinds(sheet: Sheet, tokens: int, usage: bool) -> list[str]:
    """The data frames of a stream that failed after ``tokens`` tokens: the chunks (a
    role-only chunk first where the role is split, when anything was generated), the
    usage (``usage``: always, or asked for) unless the sheet sends the error alone, the
    error frame, ``[DONE]`` unless the sheet ends without it."""
    data = ["data"] * (tokens + (1 if sheet.split_role and tokens else 0))
    tail = ["usage"] if usage and sheet.usage_before_error else []
    return data + tail + ["error"] + (["DONE"] if sheet.done_after_error else [])


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_error_after_output_frames(gw: InProcessGateway, sheet: Sheet) -> None:
    """The chunks so far, the usage (when the policy always sends it), the error frame
    in the sheet's shape with the sheet's code for an engine failure, then ``[DONE]``
    unless the policy says otherwise."""
    res = await gw.sse({"model": sheet.product, "seed": 2, "sim": FAIL_AFTER_3})
    assert res.status == 200
    assert _data_kinds(res) == _failure_kinds(sheet, 3, sheet.usage_always), res.kinds()
    assert (b"[DONE]" in res.raw) == sheet.done_after_error
    _assert_error_frame(sheet, res, sheet.engine_code, sheet.engine_type)
    _assert_one_created(res)
    if sheet.usage_on_last_choice:  # the usage on a terminal chunk whose choice is empty
        u = _the_usage_chunk(sheet, res)
        assert u["choices"][0]["delta"] == {} and u["choices"][0]["finish_reason"] is None, u


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_error_after_output_with_usage_charges_per_policy(gw: InProcessGateway, sheet: Sheet) -> None:
    """Asked for usage, the receipt precedes the error frame (except where the sheet
    sends the error alone): outcome ``error``, the generated tokens charged only where
    the policy charges errors; the usage record says the same."""
    res = await gw.sse({"model": sheet.product, "seed": 2, "sim": FAIL_AFTER_3, "stream_options": WITH_USAGE})
    assert _data_kinds(res) == _failure_kinds(sheet, 3, True), res.kinds()
    r = await gw.get(f"/v1/usage/{res.headers['x-request-id']}")
    assert r.status_code == 200, r.text
    record = r.json()
    usage = record["usage"]
    outcome = "reconciling" if sheet.reconciles else "error"
    assert record["outcome"] == outcome, record
    assert usage["completion_tokens"] == 3
    assert usage["usage_estimated"] is True  # the engine failed before its usage
    assert usage["cost_micros"] == (usage["total_tokens"] if sheet.charge_on_error else 0)
    if not sheet.usage_before_error:
        assert not _usage_chunks(res), res.kinds()
        return
    u = _the_usage_chunk(sheet, res)
    assert u["usage"] == usage
    _assert_receipt(sheet, u, outcome)


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_a_failure_before_the_first_token(gw: InProcessGateway, sheet: Sheet) -> None:
    """An engine that fails for good before its first token: under ``usage_chunk =
    always`` the usage (nothing generated, nothing charged) still precedes the error
    frame; asked for, the usage comes only when something was generated."""
    res = await gw.sse({"model": sheet.product, "seed": 2, "sim": FAIL_AT_ONCE})
    assert res.status == 200
    assert _data_kinds(res) == _failure_kinds(sheet, 0, sheet.usage_always), res.kinds()
    _assert_error_frame(sheet, res, sheet.engine_code, sheet.engine_type)
    _assert_one_created(res)
    if sheet.usage_always:
        u = _the_usage_chunk(sheet, res)
        assert (u["usage"]["completion_tokens"], u["usage"]["cost_micros"]) == (0, 0), u
        _assert_receipt(sheet, u, "error")
        if sheet.usage_on_last_choice:
            assert u["choices"][0]["delta"] == {} and u["choices"][0]["finish_reason"] is None, u
        return
    asked = await gw.sse(
        {"model": sheet.product, "seed": 2, "sim": FAIL_AT_ONCE, "stream_options": WITH_USAGE}
    )
    assert _data_kinds(asked) == _failure_kinds(sheet, 0, False), asked.kinds()


@pytest.mark.parametrize(("product", "comment"), [("default-slow", "waiting"), ("hips-slow", "keep-alive")])
async def test_the_comment_between_admission_and_the_first_token(
    gw: InProcessGateway, product: str, comment: str
) -> None:
    """Admitted, the engine silent before its first token: ``: waiting`` every quiet
    interval, ``: keep-alive`` under hips (sheet 000)."""
    res = await gw.sse({"model": product, "seed": 2, "sim": {"ttft_ms": 300, "output_tokens": 2}})
    kinds = res.kinds()
    first = kinds.index("data")
    assert kinds[0] == f"c:queued bid={FLOOR:g}", kinds
    quiet = kinds[1:first]
    assert quiet and set(quiet) == {f"c:{comment}"}, kinds


async def test_error_before_output_requeues_then_is_an_in_band_502(gw: InProcessGateway) -> None:
    """A transient failure before any output goes back to the book (a ``requeued``
    comment each time, nothing charged); after the last requeue: 502 in band, in the
    default error frame (no usage: nothing was generated)."""
    res = await gw.sse(
        {"model": "flaky", "seed": 2, "sim": {"fail_before_output": -1}, "stream_options": WITH_USAGE}
    )
    assert res.status == 200
    kinds = res.kinds()
    requeued = "c:requeued (transient backend failure), waiting"
    assert kinds == [f"c:queued bid={FLOOR:g}", requeued, requeued, requeued, "error", "DONE"], kinds
    flaky = Sheet("flaky")
    _assert_error_frame(flaky, res, "upstream_error", "upstream_error")
    r = await gw.get(f"/v1/usage/{res.headers['x-request-id']}")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cost_micros"] == 0, r.json()


async def test_a_requeue_then_success_counts_in_x_market(gw: InProcessGateway) -> None:
    res = await gw.sse(
        {"model": "flaky", "seed": 2, "sim": {"fail_before_output": 1}, "stream_options": WITH_USAGE}
    )
    kinds = res.kinds()
    assert kinds[:2] == [f"c:queued bid={FLOOR:g}", "c:requeued (transient backend failure), waiting"], kinds
    assert kinds[-2:] == ["usage", "DONE"], kinds
    assert _the_usage_chunk(DEFAULT, res)["usage"]["x_market"]["requeues"] == 1


@pytest.mark.parametrize("sheet", SHEETS, ids=IDS)
async def test_an_engine_refusal_is_an_in_band_400(gw: InProcessGateway, sheet: Sheet) -> None:
    """A refusal keeps its own code (not the sheet's engine-failure code) in the sheet's
    error frame; nothing was generated, so no usage precedes it unless always sent. The
    sim refuses a prompt longer than its context, here set to 16 tokens for this request
    (the prompt is 46 as the sim counts; the gateway's own bound, bytes / 8, lets it in)."""
    long = [{"role": "user", "content": "word " * 40}]
    res = await gw.sse({"model": sheet.product, "messages": long, "sim": {"context_length": 16}})
    assert res.status == 200
    assert _data_kinds(res) == _failure_kinds(sheet, 0, sheet.usage_always), res.kinds()
    err = _assert_error_frame(sheet, res, "context_length_exceeded", "invalid_request_error")
    assert "context" in err["message"]


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
    if sheet.split_role:  # the role alone first, the finish_reason alone last
        assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}, deltas
        deltas = deltas[1:-1]
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
    assert _the_usage_chunk(DEFAULT, res)["usage"]["completion_tokens"] == len(res.content_chunks)


async def test_request_ids_differ_between_requests(gw: InProcessGateway) -> None:
    ids = {(await gw.sse({"model": "default", "seed": 1})).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
