"""The ``openai`` engine: any OpenAI-compatible HTTP upstream (vLLM, llama.cpp, SGLang, Ollama, ...).

Owns the upstream side of the relay: one pooled HTTP client per deployment
(:mod:`bourse.engines.upstream_http`: aiohttp's connector and C parser), the
request it sends (the gateway's body, streamed with usage when the client streams; for
a client that asked for one answer, one non-streamed upstream answer, handed on as one
chunk whose ``delta`` is the message, then its usage), and the stream's three steps:
connect (send, status, first bytes), parse (:mod:`bourse.engines.openai_parse`, on the
hot path: each upstream chunk handed on as it arrives, the upstream's usage kept aside)
and finish (``[DONE]`` seen, after a ``finish_reason`` if output began, else the
generation was interrupted; the usage as a :class:`UsageEvent`: the upstream's, or,
when it sent none and the deployment has a counter
(:mod:`bourse.engines.upstream_tokens`), the engine's own counts). Closing the
generator closes the upstream response, so the upstream sees its connection go away
and aborts the generation. What its statuses, error envelopes and transport failures
mean is :mod:`bourse.engines.openai_failures`'s.

The API key is sent only as a header; it never appears in a failure message.

Its upstream's flavour (:mod:`bourse.engines.flavors`: configured, or found by the first
probe that reaches it) decides the ``x-request-id`` sent. :meth:`OpenAIHTTPEngine.probe`
checks the upstream (health, its model list) and reads its capacity; a 404 from the
generation route, or refused credentials, is a configuration error: the deployment's
:class:`~bourse.domain.availability.Availability` is marked (as a failed probe would)
and the failure is one the breaker does not count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

import aiohttp
import orjson
import yarl

from bourse.domain.availability import Availability
from bourse.engines import flavors
from bourse.engines.openai_failures import UpstreamFailures
from bourse.engines.openai_parse import CountingParse, ResponsesParse, StopParse, StreamParse, parse_answer
from bourse.engines.upstream_http import Target, UpstreamClient, UpstreamResponse, header_value
from bourse.engines.upstream_tokens import TokenCounts
from bourse.ports.engine import (
    Engine,
    EngineEvent,
    EngineFailure,
    GenerationRequest,
    Kind,
    Probe,
    UsageEvent,
)
from bourse.wire.responses import upstream_request
from bourse.wire.stops import stop_list

__all__ = ["OpenAIHTTPEngine"]

log = logging.getLogger("bourse.engines")


class OpenAIHTTPEngine(Engine):
    """An engine that streams from ``{base_url}/chat/completions`` or ``/completions``,
    or, for a request that is not streamed (``GenerationRequest.stream`` false) and
    when ``unary`` is on, asks there for one non-streamed answer.

    The HTTP client is one :class:`~bourse.engines.upstream_http.UpstreamClient`
    (aiohttp's C HTTP parser, one keep-alive connection pool of up to
    ``max_connections``, made on first use inside the running event loop).
    ``first_byte_timeout_s`` bounds the wait from sending the request to the first
    bytes of the answer body, including the wait for a free connection (a failure
    there is transient); ``read_timeout_s`` bounds each silence after that. A non-streamed answer arrives only once it is generated: its wait
    (connection, request, the whole answer) is bounded by the larger of the two; a
    connection failure, a timeout or an upstream that says it did not run the request
    (429, 503, ...) is transient (no output was relayed), so the gateway requeues it,
    while an upstream that ran it and failed (500, 502) is final, as the failure of a
    stream after output is.

    It has nothing to load: the port's defaults for ``start``, ``loaded`` and
    ``broken`` apply (an unreachable upstream shows per request, as a transient failure).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        connect_timeout_s: float = 5,
        first_byte_timeout_s: float = 60,
        read_timeout_s: float = 300,
        max_connections: int = 4096,
        unary: bool = True,
        name: str = "openai",
        api: str = "chat",
        flavor: str = "auto",
        availability: Availability | None = None,
        tokens: TokenCounts | None = None,
    ) -> None:
        self.name = name
        """The deployment's name (its failures are logged by the observer, which names it too)."""
        base = base_url.rstrip("/")
        self._base = base
        self._root = flavors.root_of(base)
        self._path = yarl.URL(base).path.rstrip("/")
        """The base URL's path (reasons name it, never the host: clients may read them)."""
        self._flavor = flavor
        """``auto`` until a probe reaches the upstream and finds what it is."""
        self._probe_timeout_s = connect_timeout_s + min(10.0, first_byte_timeout_s)
        self._failures = UpstreamFailures(name, api_key or None, availability)
        """What its upstream's failures mean (its availability, marked on a configuration error)."""
        self._chat_url = yarl.URL(base + "/chat/completions")
        self._completion_url = yarl.URL(base + "/completions")
        self._responses_url = yarl.URL(base + "/responses")
        self._api = api
        """``chat``, or ``responses``: the upstream speaks the Responses API (chat requests
        are sent there, translated; their answers come back as chat chunks)."""
        self._model = model
        self._connect_timeout_s = connect_timeout_s
        self._first_byte_timeout_s = first_byte_timeout_s
        self._read_timeout_s = read_timeout_s
        self._whole = unary and api != "responses"
        """A request that is not streamed gets one unary upstream call (``_answer``):
        ``unary`` (not ``always_stream``) on the chat API. The Responses API is always
        read as a stream (its events become chat chunks), so a request there is never
        answered whole, and its gaps are timed by the stall clock."""
        self._answer_timeout_s = max(first_byte_timeout_s, read_timeout_s)
        headers = {  # and accept, per request (a stream, or one JSON answer)
            "accept-encoding": "identity",
            "content-type": "application/json",
        }
        if api_key:  # sent only as this header; scrubbed from every message (UpstreamFailures)
            headers["authorization"] = f"Bearer {api_key}"
        self._client = UpstreamClient(
            headers, max_connections=max_connections, connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
        )  # fmt: skip
        self._targets: dict[str, Target] = {}
        """The generation routes' targets (``chat``, ``completion``, ``responses``), made on first use."""
        self._tokens = tokens
        """The engine's own token counts (None: it has none; a stream without usage is
        then charged the gateway's estimate)."""
        self._upstream_counts = False
        """True once the upstream has sent usage on a stream: from then on the streams
        are parsed without counting their chunks (no cost for an upstream that counts)."""
        self._warned_estimate = False

    async def start(self) -> None:
        """Load the counter's tokenizer, if there is one (off the event loop)."""
        if self._tokens is not None:
            await self._tokens.start()

    @property
    def context_length(self) -> int:
        """The upstream's context (``TokenCounter``), 0 when not known."""
        return (self._tokens.context_length if self._tokens is not None else None) or 0

    async def count_prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        """The prompt's tokens as the upstream counts them (``TokenCounter``); None when
        the counter is not ready or the upstream's context is not known, so that the
        gateway's pre-check falls back on its byte bound."""
        tokens = self._tokens
        if tokens is None or not tokens.ready or not tokens.context_length:
            return None
        return await tokens.prompt_tokens(kind, body)

    @property
    def flavor(self) -> str:
        """The upstream's flavour: configured, or probed (``auto`` until found)."""
        return self._flavor

    @property
    def upstream(self) -> str:
        """The server's root URL (deployments on one server share it; never shown to clients)."""
        return self._root

    @property
    def answers_whole(self) -> bool:
        """A non-streamed request is one unary upstream call, bounded by the answer
        timeout: on the chat API unless ``always_stream``; never on the Responses API."""
        return self._whole

    async def aclose(self) -> None:
        self._targets.clear()
        await self._client.close()
        if self._tokens is not None:
            await self._tokens.aclose()

    def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        if not request.stream and self._whole:
            return self._answer(request)
        return self._stream(request)

    def _post(
        self, request: GenerationRequest, body: dict[str, Any], *, json: bool
    ) -> Awaitable[UpstreamResponse]:
        """Send ``body`` to the request kind's URL; ``json``: ask for a JSON answer, not a
        stream. The caller awaits the client's request itself (no coroutine of ours between:
        each of the request's suspensions would resume it)."""
        # the header lines as bytes, made here at once (not a dict the client joins)
        rid = header_value(flavors.request_id_header(self._flavor, request.request_id))
        headers = b"accept: %s\r\nx-request-id: %s\r\nx-bourse-attempt: %d\r\n" % (
            b"application/json" if json else b"text/event-stream", rid.encode(), request.attempt,
        )  # fmt: skip
        if request.traceparent is not None:
            headers += b"traceparent: %s\r\n" % header_value(request.traceparent).encode()
        route = "responses" if self._api == "responses" else request.kind
        target = self._targets.get(route)
        if target is None:
            url = {"responses": self._responses_url, "chat": self._chat_url}.get(route, self._completion_url)
            target = self._targets[route] = self._client.target("POST", url)
        return self._client.request(target, orjson.dumps(body), headers)

    async def _answer(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """One non-streamed upstream answer, as one chunk (``delta`` = the message) and its usage."""
        body = dict(request.body)
        body.pop("stream_options", None)
        body["model"] = self._model
        body["stream"] = False
        response, content = await self._connect(request, body, json=True)
        response.release()  # read to its end: the connection goes back to the pool
        chunk, usage = parse_answer(content, request.kind == "chat", self._failures.stream_failure)
        if chunk is not None:
            yield chunk
        if usage is not None:
            yield usage

    def _stream_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body to stream: the gateway's as it is when it already asks this model
        for a stream with usage (it does), else a copy with those set."""
        options = body.get("stream_options")
        if (
            body.get("stream") is True
            and body.get("model") == self._model
            and isinstance(options, dict)
            and options.get("include_usage") is True
        ):
            return body
        options = {**options, "include_usage": True} if isinstance(options, dict) else {"include_usage": True}
        return {**body, "model": self._model, "stream": True, "stream_options": options}

    async def _connect(
        self, request: GenerationRequest, body: dict[str, Any], *, json: bool
    ) -> tuple[UpstreamResponse, bytes]:
        """The connect step, nothing yielded yet: send ``body``, check the status, then
        read the first body bytes of a stream, or the whole answer (``json``). Bounded by
        ``first_byte_timeout_s`` (a stream) or the answer's timeout; every failure is
        transient, and closes the response."""
        timeout_s = self._answer_timeout_s if json else self._first_byte_timeout_s
        response: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._post(request, body, json=json)
                if not 200 <= response.status < 300:
                    answer = await response.read()
                    response.release()  # read to its end: the connection goes back to the pool
                    raise self._failures.status_failure(response.status, answer, answer=json)
                return response, await (response.read() if json else response.content.readany())
        except BaseException as exc:
            if response is not None:
                response.close()  # (a no-op for an error answer, already back in the pool)
            if json and isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise self._failures.answer_timeout(timeout_s) from None
            if isinstance(exc, TimeoutError | aiohttp.ClientError):
                waited = f"no answer within {timeout_s:g}s" if json else f"nothing within {timeout_s:g}s"
                raise self._failures.early_failure(exc, waited) from None
            raise

    def _stream_parts(self, request: GenerationRequest) -> tuple[dict[str, Any], StreamParse]:
        """The body to stream upstream and the parse step for its answer, by the upstream's API."""
        if self._api != "responses":
            body = self._stream_body(request.body)
            stops = stop_list(body.get("stop")) if self._counting() else []
            if stops and body.get("n", 1) == 1:
                body = {k: v for k, v in body.items() if k != "stop"}  # applied here: see StopParse
                return body, StopParse(self._failures.stream_failure, stops, request.kind == "chat")
            return body, self._chat_parse()
        if request.kind != "chat":
            raise EngineFailure(
                "this deployment's upstream speaks the Responses API: legacy completions are not served",
                transient=False, status=400, code="invalid_request", error_type="invalid_request_error",
            )  # fmt: skip
        return upstream_request(request.body, self._model), ResponsesParse(self._failures.stream_failure)

    async def _stream(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        """Connect, then relay each read's chunks as they come (the parse step), then the
        usage once the stream has ended well (the finish step)."""
        body, parse = self._stream_parts(request)
        response, piece = await self._connect(request, body, json=False)
        try:
            while True:
                for event in parse.events(piece):
                    yield event
                if parse.failure is not None:
                    raise parse.failure
                if not piece or parse.cut:
                    break
                try:
                    piece = await response.content.readany()
                except aiohttp.ServerTimeoutError:
                    silent = f"upstream went silent for {self._read_timeout_s:g}s"
                    raise EngineFailure(silent, transient=not parse.output_began, kind="timeout") from None
                except (aiohttp.ClientError, TimeoutError) as exc:
                    broke = self._failures.scrub(f"upstream stream broke ({type(exc).__name__})")
                    raise EngineFailure(broke, transient=not parse.output_began, kind="stream") from None
        except BaseException:
            # not read to its end (closed early, cancelled, failed): drop the connection,
            # so the upstream sees it go and stops generating
            response.close()
            raise
        if parse.done and not parse.cut:
            response.release()  # read to its end: the connection goes back to the pool
        else:  # cut by a stop string, or closed without [DONE] (llama-cpp-python then closes it too)
            response.close()
        usage = parse.finish()
        if usage is None or not self._upstream_counts:
            usage = await self._own_usage(request, parse, usage)
        if usage is not None:
            yield usage

    # -- probes ---------------------------------------------------------------------

    async def _fetch(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        target = self._client.target(method, yarl.URL(url))
        async with asyncio.timeout(self._probe_timeout_s):
            response = await self._client.request(target, body, {"accept": "application/json"})
            try:
                content = await response.read()
            except BaseException:
                response.close()
                raise
            response.release()
            return response.status, content

    async def probe(self) -> Probe:
        """Find the flavour (``auto``, once the upstream answers), check that the upstream
        serves this deployment's model, read what it says of its capacity. Never raises."""
        try:
            if self._flavor == "auto":
                self._flavor = await flavors.detect(self._fetch, self._root)
            self._warn_uncounted()
            reason, listing = await self._check()
        except (TimeoutError, aiohttp.ClientError) as exc:
            reason, listing = self._unreachable(exc), None
        if reason is not None:
            return Probe(self._failures.scrub(reason), self._flavor)
        cap = await flavors.read_capacity(self._fetch, self._root, self._flavor)
        context = cap.context_length or flavors.context_of(listing, self._model)
        return Probe(None, self._flavor, cap.slots, cap.waiting, context)

    def _warn_uncounted(self) -> None:
        """Once, as soon as the flavour is known: a WARNING naming the deployment when its
        server sends no usage on streams and the deployment has no tokenizer to count
        with (its streams are then charged the gateway's estimate, ``usage_estimated``)."""
        if self._warned_estimate or self._tokens is not None:
            return
        if flavors.sends_stream_usage(self._flavor) is False:
            self._warned_estimate = True
            log.warning(
                "%s: its upstream (%s) sends no usage on streams and the deployment has no tokenizer: "
                "streams are charged the gateway's estimate (usage_estimated); set tokenizer to the "
                "GGUF the server runs for its own counts (docs/engines.md)",
                self.name, self._flavor,
            )  # fmt: skip

    def _unreachable(self, exc: BaseException) -> str:
        """A probe's transport failure, in one line (no address)."""
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return f"the upstream did not accept a connection within {self._connect_timeout_s:g} s"
        if isinstance(exc, aiohttp.ClientConnectorError):
            errno = exc.os_error.errno  # its strerror names the address: the errno's words only
            cause = os.strerror(errno) if errno else type(exc.os_error).__name__
            return f"the upstream is unreachable ({cause})"
        if isinstance(exc, TimeoutError):
            return f"the upstream did not answer a probe within {self._probe_timeout_s:g} s"
        return f"the upstream is unreachable ({type(exc).__name__})"

    async def _check(self) -> tuple[str | None, object]:
        """(why the upstream cannot serve this deployment or None, its model listing)."""
        misrouted = self._failures.misrouted()
        if misrouted is not None:
            return misrouted, None
        if self._flavor == "llama.cpp":
            status, _ = await self._fetch("GET", self._root + "/health", None)
            if status != 200:
                loading = " (loading its model)" if status == 503 else ""
                return f"its health check answered HTTP {status}{loading}", None
        models = f"{self._path}/models"
        status, content = await self._fetch("GET", self._base + "/models", None)
        if status == 404:
            return f"GET {models} answered 404: is base_url right (it usually ends in /v1)?", None
        if status in (401, 403):
            return f"the upstream refused bourse's credentials (HTTP {status}); check api_key_env", None
        if status != 200:
            return f"GET {models} answered HTTP {status}", None
        try:
            listing: object = orjson.loads(content)
        except orjson.JSONDecodeError:
            return f"GET {models} answered something other than JSON", None
        served = flavors.served_models(listing)
        if self._model in served:
            return None, listing
        # a server that serves any name says so for the name itself (GET /models/{id})
        one = self._base + "/models/" + urllib.parse.quote(self._model, safe="")
        if (await self._fetch("GET", one, None))[0] == 200:
            return None, listing
        shown = ", ".join(repr(m) for m in served[:5]) or "none"
        return f"the upstream does not serve the model {self._model!r} (it lists {shown})", listing

    def _chat_parse(self) -> StreamParse:
        """The parse step of a chat or completion stream: counting its chunks while the
        engine has a counter and the upstream has not yet shown that it counts itself."""
        return (CountingParse if self._counting() else StreamParse)(self._failures.stream_failure)

    def _counting(self) -> bool:
        """Whether this deployment counts its streams itself: it has a counter and its
        upstream has not shown that it counts them."""
        return self._tokens is not None and not self._upstream_counts

    async def _own_usage(
        self, request: GenerationRequest, parse: StreamParse, usage: UsageEvent | None
    ) -> UsageEvent | None:
        """The usage of a stream that ended well: the upstream's (noting that it counts),
        else the engine's own counts; None (the gateway's estimate, ``usage_estimated``)
        when it has no counter that can tell."""
        if usage is not None:
            self._upstream_counts = True
            return usage
        tokens = self._tokens
        prompt = None
        if tokens is not None and tokens.ready and isinstance(parse, CountingParse):
            prompt = await tokens.prompt_tokens(request.kind, request.body)
        if prompt is None:
            if not self._warned_estimate:
                self._warned_estimate = True
                log.warning(
                    "%s: the upstream sent no usage on a stream and bourse has no tokenizer loaded "
                    "for it (the deployment's tokenizer): streams are charged the gateway's estimate "
                    "(usage_estimated)",
                    self.name,
                )
            return None
        assert tokens is not None and isinstance(parse, CountingParse)
        return UsageEvent(prompt, tokens.completion_tokens(parse.tokens))
