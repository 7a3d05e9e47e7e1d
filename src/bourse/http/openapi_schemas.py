"""The component schemas of ``GET /openapi.json``'s answers (success and error), by name
(:data:`ANSWERS`), and the reference to one (:func:`ref`). Every error answer is the
OpenAI error envelope (``ErrorEnvelope``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REF = "#/components/schemas/{model}"


def ref(name: str) -> dict[str, str]:
    """A reference to the component schema ``name``."""
    return {"$ref": REF.format(model=name)}


def _obj(required: Sequence[str] = (), **properties: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def _const(value: str) -> dict[str, Any]:
    return {"type": "string", "const": value}


_INT = {"type": "integer"}
_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}
_NULLABLE_INT = {"type": ["integer", "null"]}

ANSWERS: dict[str, dict[str, Any]] = {
    "ErrorEnvelope": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": _obj(
                ["message", "type", "param", "code"],
                message=_STRING,
                type=_STRING,
                param=_NULLABLE_STRING,
                code=_NULLABLE_STRING,
            )
        },
    },
    "Object": {"type": "object"},
    "Event": {
        "description": "one server-sent event: a chunk, an error frame, or [DONE]",
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": ref("Chunk"),
                    },
                ]
            }
        },
    },
    "Chunk": {
        "anyOf": [
            _obj(
                ["id", "object", "created", "model", "choices"],
                id=_STRING,
                object={"enum": ["chat.completion.chunk", "text_completion"]},
                created=_INT,
                model=_STRING,
                choices={"type": "array", "items": {"type": "object"}},
            ),
            {"type": "object", "required": ["error"], "properties": {"error": {"type": "object"}}},
        ]
    },
    "ResponseEvent": {
        "description": "one typed server-sent event: `event: <type>` and `data: <json>`",
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": _STRING,
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _obj(["type", "sequence_number"], type=_STRING, sequence_number=_INT),
            },
        },
    },
    "Response": _obj(
        ["id", "object", "created_at", "status", "model", "output"],
        id=_STRING,
        object=_const("response"),
        created_at=_INT,
        status={"enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
        model=_STRING,
        output={"type": "array", "items": {"type": "object"}},
        usage={"type": ["object", "null"]},
    ),
    "ResponseDeleted": _obj(
        ["id", "object", "deleted"],
        id=_STRING,
        object=_const("response.deleted"),
        deleted={"type": "boolean"},
    ),
    "ItemList": _obj(
        ["object", "data", "has_more"],
        object=_const("list"),
        data={"type": "array", "items": {"type": "object"}},
        first_id=_NULLABLE_STRING,
        last_id=_NULLABLE_STRING,
        has_more={"type": "boolean"},
    ),
    "List": _obj(
        ["object", "data"], object=_const("list"), data={"type": "array", "items": {"type": "object"}}
    ),
    "Model": _obj(
        ["id", "object", "created", "owned_by"],
        id=_STRING,
        object=_const("model"),
        created=_INT,
        owned_by=_STRING,
        context_length=_INT,
        max_output_tokens=_INT,
        pricing={"type": "object"},
    ),
    "ModelList": _obj(
        ["object", "data"], object=_const("list"), data={"type": "array", "items": ref("Model")}
    ),
    "Page": _obj(
        ["object", "data", "has_more", "next_after"],
        object=_const("list"),
        data={"type": "array", "items": {"type": "object"}},
        has_more={"type": "boolean"},
        next_after=_NULLABLE_STRING,
    ),
    "ChatCompletion": _obj(
        ["id", "object", "created", "model", "choices"],
        id=_STRING,
        object=_const("chat.completion"),
        created=_INT,
        model=_STRING,
        choices={"type": "array", "items": {"type": "object"}},
        usage={"type": "object"},
    ),
    "TextCompletion": _obj(
        ["id", "object", "created", "model", "choices"],
        id=_STRING,
        object=_const("text_completion"),
        created=_INT,
        model=_STRING,
        choices={"type": "array", "items": {"type": "object"}},
        usage={"type": "object"},
    ),
    "Job": _obj(
        ["id", "object", "status", "endpoint", "request_id"],
        id=_STRING,
        object=_const("bourse.job"),
        endpoint=_STRING,
        request_id=_STRING,
        status={"enum": ["queued", "running", "succeeded", "failed", "canceled", "expired"]},
    ),
    "Market": _obj(
        ["object", "product", "slots", "deployments"],
        object=_const("bourse.market"),
        product=_STRING,
        slots={"type": "object"},
        deployments={"type": "array"},
    ),
    "Quote": _obj(
        ["object", "product", "within_s", "bid", "wait_s", "level", "forecast", "note"],
        object=_const("bourse.quote"),
        product=_STRING,
        within_s={"type": "number"},
        bid={"type": ["number", "null"]},
        wait_s={"type": ["number", "null"]},
        level={"type": "number"},
        wait_at_level_s={"type": ["number", "null"]},
        max_cost_usd={"type": ["number", "null"]},
        forecast={"type": "object"},
        note=_STRING,
    ),
    "Account": _obj(
        ["object", "id", "balance_micros"],
        object=_const("bourse.account"),
        id=_STRING,
        balance_micros=_INT,
        spend_cap_micros=_NULLABLE_INT,
        spend_micros=_INT,
    ),
    "Usage": _obj(
        ["id", "object", "model", "usage"],
        id=_STRING,
        object=_const("bourse.usage"),
        model=_STRING,
        usage={"type": "object"},
    ),
    "AdminAccount": _obj(
        ["id", "balance_micros", "status"],
        id=_STRING,
        balance_micros=_INT,
        status={"enum": ["active", "suspended", "closed"]},
        status_reason=_NULLABLE_STRING,
        spend_cap_micros=_NULLABLE_INT,
        spend_cap_period={"enum": ["total", "day", "week", "month", None]},
        spend_micros=_INT,
        spend_cap_resets_at={"type": ["number", "null"]},
    ),
    "KeyCreated": _obj(["key", "id", "account_id"], key=_STRING, id=_STRING, account_id=_STRING),
    "WebhookSecret": _obj(
        ["account", "webhook_secret", "released_jobs"],
        account=_STRING,
        webhook_secret=_STRING,
        released_jobs=_INT,
    ),
    "Reseal": _obj(
        ["resealed", "unchanged", "unreadable", "unreadable_count", "released_jobs"],
        resealed=_INT,
        unchanged=_INT,
        unreadable={"type": "array", "items": _STRING},
        unreadable_count=_INT,
        released_jobs=_INT,
    ),
    "Hold": _obj(
        ["id", "state", "amount_micros"],
        id=_STRING,
        amount_micros=_INT,
        state={"enum": ["open", "settled", "released", "reconciling"]},
    ),
    "Ledger": _obj(
        ["credits_micros", "balances_micros", "holds_micros", "revenue_micros", "balanced"],
        credits_micros=_INT,
        balances_micros=_INT,
        holds_micros=_INT,
        revenue_micros=_INT,
        balanced={"type": "boolean"},
    ),
    "Health": _obj(["status"], status=_const("ok")),
    "Ready": _obj(
        ["status", "products"],
        status={"enum": ["ready", "unready"]},
        products={"type": "object", "additionalProperties": {"type": "boolean"}},
        unavailable={
            "type": "array",
            "description": "each deployment that cannot serve (its probes fail, or its engine is broken) and why",
            "items": _obj(
                ["product", "deployment", "reason"], product=_STRING, deployment=_STRING, reason=_STRING
            ),
        },
    ),
}
"""Schemas of the answers (success and error), by component name."""
