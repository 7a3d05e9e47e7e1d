"""What bourse knows about each kind of OpenAI-compatible server (its *flavour*).

One place for the differences between the servers an ``openai`` deployment may front:

==================  ===========================  =====================  ======================
flavour             found by (GET/POST at root)  ``x-request-id``        capacity (sequences)
==================  ===========================  =====================  ======================
``llama.cpp``       GET /props: ``total_slots``  ours                   /props ``total_slots``
``llama-cpp-python`` POST /extras/tokenize        a UUID (else 400)      1 (one at a time)
``vllm``            GET /metrics: ``vllm:`` names ours                   not said
``openai``          none of the above            ours                   not said
==================  ===========================  =====================  ======================

The root is the base URL without its trailing ``/v1``. Health: llama-server answers
``GET /health`` (503 while it loads its model); every flavour is also asked
``GET {base_url}/models``, which must list the deployment's model (or answer
``GET {base_url}/models/{model}``). The engine's own waiting count: llama-server's
``llamacpp:requests_deferred`` (with ``--metrics``), vLLM's ``vllm:num_requests_waiting``.

The HTTP calls go through a :data:`Fetch` the caller gives (the engine's own pooled
client), so the rules here are tested without a server.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import orjson

__all__ = [
    "FLAVORS",
    "Capacity",
    "Fetch",
    "Flavor",
    "detect",
    "read_capacity",
    "request_id_header",
    "root_of",
    "sends_stream_usage",
    "served_models",
]

Flavor = Literal["vllm", "llama.cpp", "llama-cpp-python", "openai"]
FLAVORS: tuple[Flavor, ...] = get_args(Flavor)

Fetch = Callable[[str, str, bytes | None], Awaitable[tuple[int, bytes]]]
"""``(method, url, body)`` -> ``(status, body)``; raises on a transport failure."""

_HEX = re.compile(r"[0-9a-fA-F]{1,32}")


def root_of(base_url: str) -> str:
    """The server's root: the base URL without a trailing ``/`` and ``/v1``."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def uuid_form(request_id: str) -> str:
    """A UUID that still shows the request id: its hex tail (bourse's ids end in 24 hex
    digits), zero-padded on the left (``chatcmpl-5f1e…`` -> ``00000000-5f1e-…``); an id
    with no hex tail gets a UUID derived from it (the same id, the same UUID)."""
    tail = request_id.rpartition("-")[2]
    if _HEX.fullmatch(tail):
        return str(uuid.UUID(hex=tail.rjust(32, "0")))
    return str(uuid.uuid5(uuid.NAMESPACE_URL, request_id))


def sends_stream_usage(flavor: str) -> bool | None:
    """Whether the flavour's streams carry usage when asked (``stream_options``): False
    for llama-cpp-python's server (never), True for llama-server and vLLM, None (not
    known) for any other server."""
    if flavor == "llama-cpp-python":
        return False
    return True if flavor in ("llama.cpp", "vllm") else None


def request_id_header(flavor: str, request_id: str) -> str:
    """The ``x-request-id`` to send to a server of ``flavor``: ours, except to
    llama-cpp-python, whose request-id middleware answers 400 to anything but a UUID."""
    return uuid_form(request_id) if flavor == "llama-cpp-python" else request_id


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


async def _get(fetch: Fetch, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    """A call whose transport failure reads as no answer (status 0): detection goes on."""
    try:
        return await fetch("POST" if body is not None else "GET", url, body)
    except Exception:  # a probe must never raise: any failure is "no such endpoint"
        return 0, b""


async def detect(fetch: Fetch, root: str) -> Flavor:
    """The flavour of the server at ``root``. Its first call's transport failure is
    raised (the server cannot be reached: the rest are not tried, so an unreachable
    upstream costs one timeout); a later one reads as "no such endpoint"."""
    status, body = await fetch("GET", root + "/props", None)
    props = _json(body) if status == 200 else None
    if isinstance(props, dict) and "total_slots" in props:
        return "llama.cpp"
    status, _ = await _get(fetch, root + "/extras/tokenize", b'{"input": "probe"}')
    if status == 200:
        return "llama-cpp-python"
    status, body = await _get(fetch, root + "/metrics")
    if status == 200 and b"vllm:" in body:
        return "vllm"
    return "openai"


@dataclass(slots=True)
class Capacity:
    slots: int | None = None
    """Sequences the engine runs at once, where it says."""
    waiting: int | None = None
    """Requests the engine has queued itself, where it says."""
    context_length: int | None = None


def metric_sum(text: str, name: str) -> float | None:
    """The sum of a Prometheus text metric's samples (every label set); None if absent."""
    total: float | None = None
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue  # another metric whose name starts with this one
        try:
            value = float(rest.rsplit("}", 1)[-1].split()[0])
        except (IndexError, ValueError):
            continue
        total = value if total is None else total + value
    return total


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def read_capacity(fetch: Fetch, root: str, flavor: str) -> Capacity:
    """What the server of ``flavor`` says of its capacity (nothing it cannot say)."""
    if flavor == "llama-cpp-python":
        # its server runs one generation at a time (one lock around the model)
        return Capacity(slots=1)
    if flavor == "llama.cpp":
        cap = Capacity()
        status, body = await _get(fetch, root + "/props")
        props = _json(body) if status == 200 else None
        if isinstance(props, dict):
            cap.slots = _positive(props.get("total_slots"))
            settings = props.get("default_generation_settings")
            if isinstance(settings, dict):
                cap.context_length = _positive(settings.get("n_ctx"))
        status, body = await _get(fetch, root + "/metrics")  # only with --metrics
        if status == 200:
            deferred = metric_sum(body.decode("utf-8", "replace"), "llamacpp:requests_deferred")
            cap.waiting = None if deferred is None else int(deferred)
        return cap
    if flavor == "vllm":
        cap = Capacity()
        status, body = await _get(fetch, root + "/metrics")
        if status == 200:
            waiting = metric_sum(body.decode("utf-8", "replace"), "vllm:num_requests_waiting")
            cap.waiting = None if waiting is None else int(waiting)
        return cap
    return Capacity()


def served_models(doc: object) -> list[str]:
    """The model ids a ``/models`` answer lists (``data[].id``; llama-server also lists
    ``models[].model`` / ``.name``)."""
    ids: list[str] = []
    if not isinstance(doc, dict):
        return ids
    for entry in doc.get("data") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            ids.append(entry["id"])
    for entry in doc.get("models") or []:
        if isinstance(entry, dict):
            for key in ("model", "name"):
                if isinstance(entry.get(key), str):
                    ids.append(entry[key])
    return ids


def context_of(doc: object, model: str) -> int | None:
    """The context length a ``/models`` answer gives ``model`` (vLLM's ``max_model_len``)."""
    if not isinstance(doc, dict):
        return None
    for entry in doc.get("data") or []:
        if isinstance(entry, dict) and entry.get("id") == model:
            return _positive(entry.get("max_model_len"))
    return None
