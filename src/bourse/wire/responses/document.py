"""The response document: the object a response is stored and answered as
(:func:`response_object`), its usage in the Responses API's names
(:func:`response_usage`), its text (:func:`output_text`), its final states, and the
ids of its items (:func:`new_id`, :func:`referenced`). Pure (no I/O).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from bourse.wire.responses.request import ResponsesRequest

FINAL_STATUSES = frozenset({"completed", "failed", "cancelled", "incomplete"})
"""A response in one of these states changes no more."""


def new_id(prefix: str) -> str:
    """A new item id: ``msg_…``, ``fc_…``, ``rs_…``."""
    return f"{prefix}_{os.urandom(12).hex()}"


def referenced(item_id: str) -> tuple[str, int] | None:
    """The response id and output index an output item's id names (``msg_<response
    id>_<index>``), or None for an id this gateway did not give an output item."""
    prefix, _, rest = item_id.partition("_")
    response_id, _, index = rest.rpartition("_")
    if prefix not in ("msg", "fc", "rs") or not response_id or not index.isdigit():
        return None
    return response_id, int(index)


def response_object(
    response_id: str, req: ResponsesRequest, model: str, created_at: int, status: str
) -> dict[str, Any]:
    """The response object before any output: the request's settings echoed, as OpenAI's."""
    reasoning = req.reasoning or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": req.stored,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [{**t, "strict": t.get("strict")} for t in req.tools or ()],
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def response_usage(usage: Mapping[str, Any]) -> dict[str, Any]:
    """A chat usage in the Responses API's names; bourse's receipt fields (``cost``,
    ``cost_micros``, ``x_market``, ``usage_estimated``) ride along."""
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    out: dict[str, Any] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }
    for key in ("cost", "cost_micros", "x_market", "usage_estimated"):
        if key in usage:
            out[key] = usage[key]
    return out


def output_text(response: Mapping[str, Any]) -> str:
    """The text of a response's message items (what the SDKs call ``output_text``)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output") or ()
        if item.get("type") == "message"
        for part in item.get("content") or ()
    )
