"""A mixed load on a served gateway, for the fault suite and the soak (``bench/soak.py``).

Each request picks one action at random (a seeded :class:`random.Random`):
streamed or not, complete answers of random length, clients that leave mid-stream
or at once (often while their order waits in the book), every scripted sim fault
(failures before and after output, stalls below and above the product's
``stall_timeout_s``, missing usage), book timeouts, and detached jobs (a third of
them canceled at once). The products (:func:`config`) cover the policies that change
what is charged: ``default``, ``openfill``, ``aigrid``, ``gopuram``, plus ``narrow``
(two slots) where orders queue.

What every client sees is checked as it comes: an HTTP status in
:data:`ALLOWED_STATUS`, never a 500, a stack trace or an ``internal_error`` frame.
:class:`Tally` counts the outcomes; transport errors (the gateway went away) are
counted, and a test decides whether any is allowed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

STALL_TIMEOUT_S = 1.0
"""The products' stall timeout: ``stall_long`` stalls past it (the gateway ends them)."""
POLICIES = {"pd": "default", "po": "openfill", "pa": "aigrid", "pg": "gopuram"}
PRODUCTS = [*POLICIES, "narrow"]
ALLOWED_STATUS = frozenset({200, 202, 408, 502})
"""200 (streams, answers), 202 (jobs), 408 (book timeouts), 502 (failures on every attempt)."""
USER = [{"role": "user", "content": "Tell me something about rivers."}]


def config(*, slots: int = 48, extra: str = "") -> str:
    """The products of the load: one per charging policy (``slots`` each) and ``narrow``."""
    out = ['[server]\nlog_level = "warning"\n', extra]
    products = {**POLICIES, "narrow": "default"}
    for name, policy in products.items():
        n = 2 if name == "narrow" else slots
        out.append(
            f'[products.{name}]\npolicy = "{policy}"\nsim_overrides = true\nmax_requeues = 1\n'
            f"stall_timeout_s = {STALL_TIMEOUT_S}\nmax_output_tokens = 256\n"
            f'[[products.{name}.deployments]]\nname = "{name}-a"\nengine = "sim"\nslots = {n}\n'
            "floor = 1.0\nbreaker_threshold = 1000\ncooldown_s = 0\n"
        )
    return "\n".join(out)


@dataclass
class Tally:
    """What the clients saw: outcome -> count, the job ids submitted, anything forbidden."""

    seen: Counter[str] = field(default_factory=Counter)
    jobs: list[str] = field(default_factory=list)
    forbidden: list[str] = field(default_factory=list)
    """A 500, a trace, an unexpected status or an internal_error frame (never allowed)."""

    @property
    def requests(self) -> int:
        return sum(self.seen.values())

    @property
    def transport_errors(self) -> int:
        return sum(n for k, n in self.seen.items() if k.startswith("transport:"))


Action = Callable[["Load", httpx.AsyncClient, str], Awaitable[str]]


class Load:
    """Requests against ``url`` as one of ``keys``, chosen at random from ``seed``."""

    def __init__(
        self,
        url: str,
        keys: list[str],
        *,
        seed: int = 0,
        jobs: bool = True,
        allowed: frozenset[int] = ALLOWED_STATUS,
    ) -> None:
        self.url = url
        self.allowed = allowed
        self.keys = keys
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.actions: list[tuple[Action, int]] = [(a, w) for a, w in ACTIONS if jobs or a is not job]

    # -- one request ---------------------------------------------------------------------

    def _check_text(self, what: str, status: int, text: str) -> None:
        if status not in self.allowed or "Traceback" in text or 'File "' in text:
            self.tally.forbidden.append(f"{what}: {status} {text[:300]}")

    def body(self, sim: dict[str, Any], *, product: str | None = None, **extra: Any) -> dict[str, Any]:
        model = product or self.rng.choice(list(POLICIES))
        return {"model": model, "messages": USER, "max_tokens": 40, "sim": sim, **extra}

    async def stream(
        self, client: httpx.AsyncClient, key: str, body: dict[str, Any], leave_after: int | None = None
    ) -> str:
        """A streamed request read to its end, or left after ``leave_after`` data frames
        (0: at the first frame of any kind); what the client saw."""
        headers = {"authorization": f"Bearer {key}"}
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                 headers=headers) as r:  # fmt: skip
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                self._check_text("stream", r.status_code, text)
                return f"stream:{r.status_code}"
            data = 0
            async for line in r.aiter_lines():
                if leave_after == 0 and line:
                    return "stream:left"
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload != "[DONE]" and b'"internal_error"' in payload.encode():
                    self.tally.forbidden.append(f"stream: internal_error frame {payload[:300]}")
                if '"error"' in payload:
                    return "stream:error"
                data += 1
                if leave_after is not None and data >= leave_after:
                    return "stream:left"
            return "stream:done"

    async def unary(self, client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> str:
        r = await client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
        self._check_text("unary", r.status_code, r.text)
        return f"unary:{r.status_code}"

    async def one(self, client: httpx.AsyncClient) -> None:
        actions, weights = zip(*self.actions, strict=True)
        action = self.rng.choices(actions, weights)[0]
        key = self.rng.choice(self.keys)
        try:
            outcome = await action(self, client, key)
        except httpx.TransportError as exc:
            outcome = f"transport:{type(exc).__name__}"
        self.tally.seen[f"{action.__name__}/{outcome}"] += 1

    # -- many ----------------------------------------------------------------------------

    async def run(
        self, *, requests: int, concurrency: int, seconds: float, stop: asyncio.Event | None = None
    ) -> Tally:
        """``requests`` requests (or until ``seconds`` pass, or ``stop`` is set), at most
        ``concurrency`` at once."""
        left = requests
        deadline = time.monotonic() + seconds
        stop = stop or asyncio.Event()
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
        timeout = httpx.Timeout(60.0, connect=10.0)

        async def worker(client: httpx.AsyncClient) -> None:
            nonlocal left
            while left > 0 and time.monotonic() < deadline and not stop.is_set():
                left -= 1
                await self.one(client)

        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return self.tally


# -- the actions -------------------------------------------------------------------------


async def complete(load: Load, client: httpx.AsyncClient, key: str) -> str:
    body = load.body({"output_tokens": load.rng.randint(1, 24)})
    if load.rng.random() < 0.5:
        return await load.stream(client, key, body)
    return await load.unary(client, key, body)


async def leave_streaming(load: Load, client: httpx.AsyncClient, key: str) -> str:
    body = load.body({"output_tokens": 40, "tokens_per_s": 200})
    return await load.stream(client, key, body, leave_after=load.rng.randint(1, 5))


async def leave_at_once(load: Load, client: httpx.AsyncClient, key: str) -> str:
    """Leaves at the first frame; on ``narrow`` the order usually still waits in the book."""
    body = load.body({"output_tokens": 8, "tokens_per_s": 100}, product="narrow")
    return await load.stream(client, key, body, leave_after=0)


async def fault(load: Load, client: httpx.AsyncClient, key: str) -> str:
    rng = load.rng
    sims: list[dict[str, Any]] = [
        {"fail_before_output": rng.choice([1, -1]), "output_tokens": 10},
        {"fail_after_tokens": rng.randint(0, 5), "output_tokens": 10},
        {"stall_after_tokens": rng.randint(0, 4), "stall_s": rng.choice([0.05, 0.2]), "output_tokens": 8},
        {"omit_usage": True, "output_tokens": rng.randint(1, 20)},
    ]
    body = load.body(rng.choice(sims))
    if rng.random() < 0.5:
        return await load.stream(client, key, body)
    return await load.unary(client, key, body)


async def stall_long(load: Load, client: httpx.AsyncClient, key: str) -> str:
    """A stall past the product's ``stall_timeout_s``: the gateway ends it."""
    sim = {"stall_after_tokens": load.rng.randint(0, 3), "stall_s": STALL_TIMEOUT_S * 3, "output_tokens": 8}
    return await load.stream(client, key, load.body(sim))


async def book_timeout(load: Load, client: httpx.AsyncClient, key: str) -> str:
    body = load.body({"output_tokens": 4}, product="narrow", timeout=0.05)
    return await load.unary(client, key, body)


async def job(load: Load, client: httpx.AsyncClient, key: str) -> str:
    auth = {"authorization": f"Bearer {key}"}
    body = load.body({"output_tokens": load.rng.randint(1, 30), "tokens_per_s": 200})
    r = await client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth)
    load._check_text("job", r.status_code, r.text)
    if r.status_code != 202:
        return f"job:{r.status_code}"
    job_id = orjson.loads(r.content)["id"]
    load.tally.jobs.append(job_id)
    if load.rng.random() < 1 / 3:
        c = await client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
        if c.status_code != 200:
            load.tally.forbidden.append(f"job cancel: {c.status_code} {c.text[:300]}")
        return "job:canceled"
    return "job:submitted"


ACTIONS: list[tuple[Action, int]] = [
    (complete, 40),
    (leave_streaming, 15),
    (leave_at_once, 8),
    (fault, 25),
    (stall_long, 2),
    (book_timeout, 4),
    (job, 6),
]
"""Each action and its weight."""
