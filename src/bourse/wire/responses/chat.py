"""A Responses request as the chat request that runs it: :func:`input_items` gives its
input as stored items (with ids), :func:`chat_messages` items as chat messages, and
:func:`chat_body` the whole chat body (``instructions`` first, then the stored
conversation of ``previous_response_id``, then the input, with ``tools``,
``tool_choice``, ``text.format``, the output budget and bourse's own ``max_price``,
``timeout``, ``deadline_s`` and ``sim``). Pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bourse.domain.errors import invalid_request
from bourse.wire.responses.document import new_id
from bourse.wire.responses.request import ResponsesRequest, parse_item


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string input is one user message)."""
    if isinstance(req.input, str):
        return [_message("user", [{"type": "input_text", "text": req.input}])]
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(req.input):
        item = parse_item(i, raw).model_dump(exclude_none=True)
        if item["type"] == "message":
            if isinstance(item["content"], str):
                part = "output_text" if item["role"] == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        if "id" not in item:
            item["id"] = new_id(_ID_PREFIX[item["type"]])
        out.append(item)
    return out


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _message(role: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": new_id("msg"), "type": "message", "role": role, "status": "completed", "content": content}


def chat_messages(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Items (stored ones first, then the input) as chat messages: consecutive function
    calls join the assistant turn before them; reasoning items are left out."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type")
        if kind == "message":
            messages.append(_chat_message(item))
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p.get("text", "") for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages


def _chat_message(item: Mapping[str, Any]) -> dict[str, Any]:
    role = "system" if item["role"] == "developer" else item["role"]
    parts: list[dict[str, Any]] = []
    for p in item["content"]:
        if p["type"] == "input_image":
            image = {"url": p["image_url"], **({"detail": p["detail"]} if p.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": p["text"]})
    if all(p["type"] == "text" for p in parts) and (len(parts) == 1 or role != "user"):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def chat_body(
    req: ResponsesRequest, history: Sequence[Mapping[str, Any]], items: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The chat request that runs ``req``: its instructions, the stored conversation
    ``history`` (of ``previous_response_id``) and its input ``items``."""
    messages = chat_messages([*history, *items])
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise invalid_request("input: expected at least one message", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional = {
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls if req.tools else None,
        "user": req.user,
        "max_price": req.max_price,
        "timeout": req.timeout,
        "deadline_s": req.deadline_s,
        "sim": req.sim,
        "seed": req.seed,
        "reasoning_effort": (req.reasoning or {}).get("effort"),
        "response_format": _response_format(req.text),
    }
    body.update((k, v) for k, v in optional.items() if v is not None)
    if req.tools:
        body["tools"] = [_chat_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
        )
    return body


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, Mapping) or fmt.get("type") == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
    schema.setdefault("name", "response")
    return {"type": "json_schema", "json_schema": schema}
