"""Per-product policies (SPEC section 12): the knobs, their allowed values and the named presets.

A :class:`Policy` is immutable; a product's policy is its preset with the
product's own overrides applied (:func:`resolve_policy`). This module is the one
place that names the knobs and their words: the allowed values of a word knob are
its ``Literal`` type, read back with :func:`typing.get_args`, and the config
(:mod:`bourse.settings`) takes the knob names from :data:`KNOBS`.

Besides the knobs, a policy carries what a preset's sheet fixes in what the client
sees: the receipt object and its quote field, the header prefix, the request-id
header and id prefix, the error frame's fields and the code of an engine failure,
the comment before the first token, and where the usage rides in a stream.
Presets set them, the config does not; no code asks for a preset by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, Literal, get_args, get_origin, get_type_hints

from bourse.domain.values import immutable

UsageChunk = Literal["opt_in", "always"]
OnDisconnect = Literal["cancel", "drain"]
Charge = Literal["generated", "none"]
MissingUsage = Literal["estimate", "reconcile"]
ReasoningField = Literal["reasoning_content", "reasoning"]
ErrorFrame = Literal["chunk", "envelope", "envelope_id"]
"""The in-band error frame's top level (SPEC 6): ``chunk``: the chunk's ``id``,
``object``, ``created`` and ``model`` beside ``error``; ``envelope``: ``error`` alone
(the HTTP error's body); ``envelope_id``: ``error`` and ``id``. With
``error_finish_reason`` the frame also carries ``choices: [{…, "finish_reason": "error"}]``.

Every OpenAI client raises on a frame with an ``error`` object and no ``choices``
(the OpenAI SDKs, LangChain through them, and the AI SDK's ``openai`` and
``openai-compatible`` providers); the AI SDK's ``openai`` provider reads a frame that
has ``choices`` as an ordinary chunk and drops its ``error``: the default frame has none."""


@immutable
class Policy:
    name: str = "default"
    usage_chunk: UsageChunk = "opt_in"
    done_after_error: bool = True
    error_finish_reason: bool = False
    on_disconnect: OnDisconnect = "cancel"
    charge_on_disconnect: Charge = "generated"
    charge_on_error: Charge = "none"
    missing_usage: MissingUsage = "estimate"
    quiet_interval_s: float = 2.0
    reasoning_field: ReasoningField = "reasoning_content"
    max_requeues: int = 3
    error_frame: ErrorFrame = "chunk"
    # -- names (set by presets, not knobs) --
    receipt_name: str = "receipt"
    """Name of the top-level receipt object (``hips`` for preset hips)."""
    receipt_quote_field: str = "quote_micros"
    """Name of the quote in the receipt (``quote`` for preset hips)."""
    receipt_ttft: bool = True
    """Whether the receipt carries ``ttft_ms`` (not in preset hips's receipt)."""
    header_prefix: str = "x-bourse-"
    """Prefix of the receipt headers (``x-hips-`` for preset hips)."""
    request_id_header: str | None = None
    """A header that repeats the request id, besides ``x-request-id``."""
    id_prefix: str | None = None
    """The request id's prefix instead of ``chatcmpl-`` / ``cmpl-`` (``gen-``)."""
    error_fields: tuple[str, ...] = ("message", "type", "param", "code")
    """The keys of the ``error`` object of an in-band error frame."""
    engine_error_code: str = "upstream_error"
    """The ``code`` of an engine failure (HTTP 502 or in band)."""
    engine_error_type: str = "upstream_error"
    """The ``type`` of an engine failure."""
    waiting_comment: str = "waiting"
    """The quiet-interval comment between admission and the first token."""
    usage_before_error: bool = True
    """Whether a usage chunk may precede the error frame of a failed stream."""
    usage_on_last_choice: bool = False
    """The usage rides on the terminal chunk, the one with the last choice's
    ``finish_reason``, instead of a chunk of its own with ``choices: []``."""
    split_role_and_finish: bool = False
    """The role alone on the first chunk (``delta: {"role": …}``) and the
    ``finish_reason`` alone on the last (``delta: {}``)."""

    def request_id(self, request_id: str) -> str:
        """``request_id`` (``<prefix>-<random>``) with this policy's id prefix."""
        if self.id_prefix is None:
            return request_id
        return self.id_prefix + request_id.partition("-")[2]

    def id_headers(self, request_id: str) -> dict[str, str]:
        """The headers that carry the request id."""
        out = {"x-request-id": request_id}
        if self.request_id_header is not None:
            out[self.request_id_header] = request_id
        return out

    def engine_error(self, code: str, error_type: str) -> tuple[str, str]:
        """The (code, type) a client sees for an engine failure given as (code, type)."""
        if code == "upstream_error":
            return self.engine_error_code, self.engine_error_type
        return code, error_type


_SHEETS: dict[str, Policy] = {
    "default": Policy(),
    # 000: the keep-alive comment while nothing is produced; a failure is one data line
    # holding the error envelope (no usage chunk before it), then the stream closes
    # without [DONE]; the receipt object is named `hips` with `cost_micros`,
    # `latency_ms`, `quote`; `x-hips-*` headers.
    "hips": Policy(
        done_after_error=False,
        error_frame="envelope",
        receipt_name="hips",
        receipt_quote_field="quote",
        receipt_ttft=False,
        header_prefix="x-hips-",
        waiting_comment="keep-alive",
        usage_before_error=False,
    ),
    # 001: a disconnect while running drains the engine and is charged; a failure
    # after start is never charged; the error is `data: {"error": {…}}`, then [DONE].
    "openfill": Policy(
        on_disconnect="drain",
        charge_on_disconnect="generated",
        charge_on_error="none",
        error_frame="envelope",
    ),
    # 002: usage always, on the terminal chunk; disconnect drains and settles; missing
    # usage reconciles; the invocation id in `X-AIGrid-Invocation`; the error frame
    # `{"error": {"code": "provider_failed", "message": …}, "id": …}`.
    "aigrid": Policy(
        usage_chunk="always",
        on_disconnect="drain",
        missing_usage="reconcile",
        error_frame="envelope_id",
        request_id_header="x-aigrid-invocation",
        error_fields=("code", "message"),
        engine_error_code="provider_failed",
        usage_on_last_choice=True,
    ),
    # 004: usage chunk always (with `cost`); the error frame has finish_reason "error"
    # and `{message, type: "api_error", code: "provider_error"}`, then [DONE];
    # disconnect cancels and charges generated; errors charge generated; `reasoning`;
    # `gen-…` ids in `X-Gopuram-Request-Id`; the role and the finish_reason on chunks
    # of their own.
    "gopuram": Policy(
        usage_chunk="always",
        error_finish_reason=True,
        on_disconnect="cancel",
        charge_on_disconnect="generated",
        charge_on_error="generated",
        reasoning_field="reasoning",
        request_id_header="x-gopuram-request-id",
        id_prefix="gen-",
        error_fields=("message", "type", "code"),
        engine_error_code="provider_error",
        engine_error_type="api_error",
        split_role_and_finish=True,
    ),
}
PRESETS: dict[str, Policy] = {name: replace(sheet, name=name) for name, sheet in _SHEETS.items()}
"""The presets by name, each policy carrying its name (written once, as the key)."""

_NAMES = frozenset(
    {
        "name",
        "receipt_name",
        "receipt_quote_field",
        "receipt_ttft",
        "header_prefix",
        "request_id_header",
        "id_prefix",
        "error_fields",
        "engine_error_code",
        "engine_error_type",
        "waiting_comment",
        "usage_before_error",
        "usage_on_last_choice",
        "split_role_and_finish",
    }
)
KNOBS: frozenset[str] = frozenset(f.name for f in fields(Policy)) - _NAMES
"""The keys an operator may set per product (SPEC section 12)."""

_TYPES: dict[str, Any] = get_type_hints(Policy)
CHOICES: dict[str, tuple[str, ...]] = {
    k: get_args(t) for k, t in _TYPES.items() if k in KNOBS and get_origin(t) is Literal
}
"""The allowed words of each word knob, from its ``Literal`` type."""
_RANGES: dict[str, tuple[float, float]] = {"quiet_interval_s": (0.05, 3600.0), "max_requeues": (0, 20)}


def check_knob(key: str, value: Any) -> Any:
    """``value`` as the knob ``key`` takes it; ValueError names the key and what it expects."""
    if key not in KNOBS:
        raise ValueError(f"{key}: not a policy knob (knobs: {', '.join(sorted(KNOBS))})")
    kind = _TYPES[key]
    if key in CHOICES:
        if value not in CHOICES[key]:
            raise ValueError(f"{key}: expected one of {', '.join(CHOICES[key])}, got {value!r}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {value!r}")
        return value
    low, high = _RANGES[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{key}: expected an integer from {low:g} to {high:g}, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{key}: expected a number of seconds from {low:g} to {high:g}, got {value!r}")
    return float(value)


def resolve_policy(preset: str, overrides: Mapping[str, Any]) -> Policy:
    """The preset named ``preset`` with ``overrides`` applied; ValueError names a bad key."""
    if preset not in PRESETS:
        raise ValueError(f"policy: expected one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    return replace(PRESETS[preset], **{k: check_knob(k, v) for k, v in overrides.items()})
