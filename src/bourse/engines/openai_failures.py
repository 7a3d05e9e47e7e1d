"""What an OpenAI-compatible upstream's failures mean: :class:`UpstreamFailures` maps an
error status, an error envelope (OpenAI's, or a vLLM or llama.cpp variant) or a transport
failure to the :class:`~bourse.ports.engine.EngineFailure` the run acts on: transient
before any output for connect errors, timeouts, 5xx and 429, except a non-streamed
answer that the upstream ran and failed (500 or 502) or did not give in time (it may
still be running it); a refusal such as a context length error, however it is worded,
is final; a 404 from the generation route, or refused credentials, is a configuration
error marked on the deployment's availability. The API key never appears in a message.
"""

from __future__ import annotations

import time

import aiohttp
import orjson

from bourse.domain.availability import Availability
from bourse.ports.engine import EngineFailure

_MESSAGE_MAX = 300
_TRANSIENT_CLIENT_STATUSES = frozenset({401, 403, 404, 408, 429})
"""4xx answers that say the deployment is wrong or busy, not that the request is."""
_CONFIG_STATUSES = frozenset({401, 403, 404})
"""Answers that say the deployment is set up wrong (its URL, its credentials, its model
name): a configuration error, marked on the deployment's availability."""
_BODY_LOGGED = 300
_MISROUTE_HOLD_S = 60.0
"""A deployment whose generation route answered 404 (or refused the credentials) stays
unavailable this long, though its probes pass: a probe cannot try that route without
generating. Then one request tries it again."""
_FAILED_ANSWER_STATUSES = frozenset({500, 502})
"""Answers to a non-streamed request that say the upstream ran the generation and it
failed, perhaps after some output: final, as a failure after output is in a stream
(the ``sim`` engine answers the same at once). 503, 504 and 429 say that it did not
run it (busy, unavailable, timed out): transient."""


def _error_details(error: object) -> tuple[str, str | None, str | None]:
    """(message, code, type) from an OpenAI error object, or a vLLM/llama.cpp variant."""
    if isinstance(error, dict):
        inner = error.get("error")
        if isinstance(inner, dict):
            error = inner
        elif isinstance(inner, str):
            return inner, None, None
        message = error.get("message")
        if message is None and "detail" in error:
            message = error["detail"]
        code = error.get("code")
        error_type = error.get("type")
        return (
            str(message) if message is not None else "",
            code if isinstance(code, str) and code else None,
            error_type if isinstance(error_type, str) else None,
        )
    if isinstance(error, str):
        return error, None, None
    return "", None, None


def _refusal_code(message: str, code: str | None, error_type: str | None) -> str:
    if code:
        return code
    if error_type == "exceed_context_size_error" or _says_context(message):
        return "context_length_exceeded"
    return "invalid_request"


_CONTEXT_WORDS = ("context length", "context_length", "context window", "context size")
"""How engines word a prompt over their context: vLLM's "maximum context length",
llama-server's "exceeds the available context size", llama-cpp-python's "maximum
context length", an OpenAI-like ``context_length_exceeded``."""


def _says_context(message: str) -> bool:
    lowered = message.lower()
    return any(w in lowered for w in _CONTEXT_WORDS)


def _is_refusal(error: object, code: str | None, error_type: str | None, message: str = "") -> bool:
    """An in-stream error that says the request itself is wrong (retrying won't help):
    by its code or type, or by its words when it says the prompt is over the context."""
    if code == "context_length_exceeded" or error_type in (
        "invalid_request_error",
        "exceed_context_size_error",
    ):
        return True
    if _says_context(message):
        return True
    if isinstance(error, dict):
        inner = error.get("error", error)
        status = inner.get("code") if isinstance(inner, dict) else None
        if isinstance(status, int) and 400 <= status < 500 and status not in _TRANSIENT_CLIENT_STATUSES:
            return True
    return False


class UpstreamFailures:
    """The failures of one deployment's upstream, as :class:`EngineFailure`: its name (in
    the operator's log lines), its API key (scrubbed from every message) and its
    availability (marked on a configuration error)."""

    __slots__ = ("_api_key", "_misrouted", "availability", "name")

    def __init__(self, name: str, api_key: str | None, availability: Availability | None) -> None:
        self.name = name
        self._api_key = api_key
        self.availability = availability
        """The deployment's availability, marked on a configuration error (None: probes off)."""
        self._misrouted: tuple[str, float] | None = None
        """(reason, monotonic time) of the last configuration error a request met."""

    def misrouted(self) -> str | None:
        """The configuration error a request last met, for :data:`_MISROUTE_HOLD_S` after
        it (the probes report it); None once that has passed, so one request tries again."""
        if self._misrouted is None:
            return None
        reason, at = self._misrouted
        if time.monotonic() - at < _MISROUTE_HOLD_S:
            return reason
        self._misrouted = None
        return None

    def scrub(self, text: str) -> str:
        """``text`` cut to a message's length, the API key in it masked."""
        text = text if len(text) <= _MESSAGE_MAX else text[: _MESSAGE_MAX - 3] + "..."
        if self._api_key and self._api_key in text:
            text = text.replace(self._api_key, "***")
        return text

    def status_failure(self, status: int, content: bytes, *, answer: bool = False) -> EngineFailure:
        """The failure an error status says; ``answer``: the request asked for one
        non-streamed answer (see ``_FAILED_ANSWER_STATUSES``)."""
        try:
            parsed: object = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = content.decode("utf-8", "replace").strip()
        message, code, error_type = _error_details(parsed)
        if status in _CONFIG_STATUSES or 300 <= status <= 399:
            return self.config_failure(status, message)
        if answer and status in _FAILED_ANSWER_STATUSES:
            detail = f": {message}" if message else ""
            return EngineFailure(
                self.scrub(f"upstream failed the answer (HTTP {status}){detail}"),
                transient=False,
                kind="status",
            )
        if status >= 500 or status < 400 or status in _TRANSIENT_CLIENT_STATUSES:
            detail = f": {message}" if message else ""
            return EngineFailure(
                self.scrub(f"upstream answered HTTP {status}{detail}"), transient=True, kind="status"
            )
        return EngineFailure(
            self.scrub(message or f"upstream refused the request (HTTP {status})"),
            transient=False,
            status=400,
            code=_refusal_code(message, code, error_type),
            error_type="invalid_request_error",
            kind="refused",
            upstream=self.answered(f"HTTP {status}", content),
        )

    def answered(self, status: str, content: bytes) -> str:
        """What the engine answered, for the operator's WARNING line (the run's): its
        status and at most :data:`_BODY_LOGGED` bytes of its body, the API key masked."""
        if self._api_key:  # masked before the cut, which could keep a part of it
            content = content.replace(self._api_key.encode(), b"***")
        text = repr(content[:_BODY_LOGGED]) + ("..." if len(content) > _BODY_LOGGED else "")
        return f"{status}, body {text}"

    def config_failure(self, status: int, message: str) -> EngineFailure:
        """A 404 from the generation route (a wrong ``base_url``, a model the upstream does
        not serve), a redirect (not followed) or refused credentials: the deployment is set up wrong. It is marked
        unavailable until a probe passes; the failure is transient (another deployment may
        serve the request) and not counted by the breaker (the deployment is unavailable)."""
        detail = f": {message}" if message else ""
        if status == 404:
            reason = (
                f"the upstream answered HTTP 404 to a generation request{detail}; check base_url "
                "(it usually ends in /v1), api and model"
            )
        elif 300 <= status <= 399:
            reason = (
                f"the upstream answered a redirect (HTTP {status}) to a generation request; bourse does "
                "not follow redirects: set base_url to the address it redirects to"
            )
        else:
            reason = f"the upstream refused bourse's credentials (HTTP {status}{detail}); check api_key_env"
        reason = self.scrub(reason)
        self._misrouted = (reason, time.monotonic())
        if self.availability is not None:
            self.availability.fail(reason)  # its on_change logs the change
        return EngineFailure(reason, transient=True, status=503, code="no_capacity", kind="config")

    def stream_failure(self, error: object, output_began: bool) -> EngineFailure:
        message, code, error_type = _error_details(error)
        message = self.scrub(message or "upstream reported an error")
        if not output_began and _is_refusal(error, code, error_type, message):
            return EngineFailure(
                message,
                transient=False,
                status=400,
                code=_refusal_code(message, code, error_type),
                error_type="invalid_request_error",
                kind="refused",
                upstream=self.answered("an in-band error", orjson.dumps(error, default=str)),
            )
        return EngineFailure(f"upstream error: {message}", transient=not output_began, kind="stream")

    @staticmethod
    def answer_timeout(timeout_s: float) -> EngineFailure:
        """A non-streamed request sent and not answered in time: final. The upstream may
        still be generating it (an engine does not stop a non-streamed generation when
        its client goes), so sending it again would run it twice on the same engine."""
        return EngineFailure(
            f"upstream did not answer within {timeout_s:g}s; the request was not sent again "
            "(the engine may still be running it)",
            transient=False,
            status=504,
            code="upstream_timeout",
            error_type="timeout_error",
            kind="timeout",
        )

    def early_failure(self, exc: BaseException, waited: str) -> EngineFailure:
        """A failure before any output (connect, status, first bytes): always transient.
        Not logged here: the run reports it to the observer, whose WARNING line names the
        deployment and the failure's kind."""
        if isinstance(exc, aiohttp.ServerTimeoutError):  # also a TimeoutError: checked first
            return EngineFailure(f"upstream timed out ({type(exc).__name__})", transient=True, kind="timeout")
        if isinstance(exc, TimeoutError):
            return EngineFailure(f"upstream sent {waited}", transient=True, kind="timeout")
        return EngineFailure(
            self.scrub(f"upstream unreachable ({type(exc).__name__}: {exc})"), transient=True, kind="connect"
        )
