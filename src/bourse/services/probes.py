"""The probes of the deployments' upstreams: at start, then every ``probe_interval_s``.

Owns what a probe's result does to a deployment (the check itself is the engine's,
:class:`~bourse.ports.engine.Probed`):

- availability: a failed probe makes the deployment unavailable with its one-line
  reason (WARNING), a passing one available again (INFO); an unavailable deployment
  takes no order (:mod:`bourse.domain.availability`), and the book is told at each
  probe (a shared book holds it out on the other replicas for ``hold_s``);
- capacity: ``slots`` unset takes the engine's own (or 4 where it says none); a
  configured ``slots`` above the engine's is capped to it, with a WARNING; where the
  engine says it queues requests itself (llama-server's deferred requests, vLLM's
  waiting ones), the effective slots shrink by that many (a WARNING) and come back one
  a probe while it queues none;
- the flavour found is logged once, at start.

With ``probe_interval_s = 0`` the start probe runs alone (flavour, capacity and
availability) unless it fails: then the deployment is unavailable and probed again every
:data:`START_RETRY_S` until a probe passes, and no more after that.

A probe that would disturb the engine is skipped: llama-cpp-python's server answers
``/v1/models`` only between generations and, with its ``interrupt_requests`` on,
ends the running stream when another request arrives; while this replica runs a
generation there (on any of its deployments on that server), that generation is proof
enough that the upstream serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from bourse.domain.book import Deployment
from bourse.ports.engine import Probe, Probed
from bourse.services.market import Market

log = logging.getLogger("bourse.probes")

START_RETRY_S = 10.0
"""With ``probe_interval_s = 0``, how often a deployment whose start probe failed is
probed again, until one passes (the default ``probe_interval_s``)."""

DEFAULT_SLOTS = 4
"""The slots of a deployment whose ``slots`` is unset and whose engine says none."""


@dataclass(slots=True, eq=False)
class ProbeTarget:
    product: str
    deployment: Deployment
    engine: Probed
    interval_s: float
    configured_slots: int | None
    capped: int | None = None
    """The engine capacity a configured ``slots`` was last capped to (warned once each)."""
    shrunk: int = 0
    """Slots taken off because the engine was seen queueing requests itself."""
    engine_slots: int | None = None
    """The engine's own capacity, as its last passing probe said (None: it did not say)."""


class Prober:
    """Every probed deployment of the gateway, and the tasks that probe them."""

    def __init__(self, retry_s: float = START_RETRY_S) -> None:
        self._retry_s = retry_s
        self._targets: list[ProbeTarget] = []
        self._markets: Mapping[str, Market] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._task_targets: dict[asyncio.Task[None], ProbeTarget] = {}

    def add(self, target: ProbeTarget) -> None:
        self._targets.append(target)

    def bind(self, markets: Mapping[str, Market]) -> None:
        """The markets whose books hear of a deployment's change (filled after the targets)."""
        self._markets = markets

    @property
    def targets(self) -> list[ProbeTarget]:
        return list(self._targets)

    # -- the changes ----------------------------------------------------------------------

    def changed(self, product: str, deployment: str, reason: str | None) -> None:
        """A deployment's availability changed (a probe, or a request that met a
        configuration error): say it, and tell the book."""
        fields = {"fields": {"product": product, "deployment": deployment, "reason": reason}}
        if reason is None:
            log.info("deployment %s of %s is available again", deployment, product, extra=fields)
        else:
            log.warning("deployment %s of %s is unavailable: %s", deployment, product, reason, extra=fields)
        self._tell_book(product, deployment)

    def _tell_book(self, product: str, deployment: str) -> None:
        market = self._markets.get(product)
        if market is None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop (built, not started)
            asyncio.get_running_loop()
            market.book.deployment_changed(deployment)

    def apply(self, target: ProbeTarget, probe: Probe) -> None:
        """What one probe found, applied to its deployment."""
        d = target.deployment
        changed = d.availability.set(probe.reason)
        if probe.reason is not None and not changed:
            self._tell_book(target.product, d.name)  # renew the hold on the shared book
        if probe.reason is None:
            self._resize(target, probe)
            market = self._markets.get(target.product)
            if market is not None:
                market.engine_context(d.name, probe.context_length)

    def configure(self, product: str, deployment: str, slots: int | None) -> bool:
        """An operator's new ``slots`` for a probed deployment (None: the engine's own),
        held to its engine's capacity as at start; False if no probe owns it."""
        for target in self._targets:
            if target.product == product and target.deployment.name == deployment:
                target.configured_slots, target.capped = slots, None
                self._resize(target, Probe(None, target.engine.flavor, target.engine_slots))
                return True
        return False

    def _resize(self, target: ProbeTarget, probe: Probe) -> None:
        d = target.deployment
        configured, engine = target.configured_slots, probe.slots
        target.engine_slots = engine
        if engine is None:
            slots = DEFAULT_SLOTS if configured is None else configured
        elif configured is None or configured <= engine:
            slots = engine if configured is None else configured
        else:
            slots = engine
            if target.capped != engine:
                target.capped = engine
                log.warning(
                    "deployment %s of %s: slots = %d is above what its engine (%s) runs at once (%d); "
                    "capped to %d",
                    d.name, target.product, configured, probe.flavor, engine, engine,
                )  # fmt: skip
        base, slots = slots, self._effective(target, slots, probe.waiting)
        if slots != d.slots:
            source = "its engine's" if configured is None and engine is not None else "configured"
            if slots < base:
                source = f"of {base}: its engine queues requests itself"
            log.info("deployment %s of %s: %d slots (%s)", d.name, target.product, slots, source)
            d.resize(slots)
            self._tell_book(target.product, d.name)

    @staticmethod
    def _effective(target: ProbeTarget, base: int, waiting: int | None) -> int:
        """The slots to give out of ``base`` when the engine says it has ``waiting``
        requests queued itself: requests queued inside the engine wait by arrival, not by
        bid, so the deployment takes that many fewer (never fewer than one), and takes
        them back one a probe while the engine queues nothing."""
        if waiting is not None and waiting > 0:
            shrunk = min(base - 1, target.shrunk + waiting)
            if shrunk > target.shrunk:
                log.warning(
                    "deployment %s of %s: its engine queues %d requests itself, behind bourse's book; "
                    "effective slots %d (of %d)",
                    target.deployment.name, target.product, waiting, base - shrunk, base,
                )  # fmt: skip
            target.shrunk = shrunk
        elif waiting == 0 and target.shrunk > 0:
            target.shrunk -= 1
        target.shrunk = min(target.shrunk, base - 1)
        return base - target.shrunk

    # -- the probing ----------------------------------------------------------------------

    async def start(self) -> None:
        """The start probes, all at once (the gateway serves after them), then the loops."""
        await self._begin(list(self._targets))

    async def add_live(self, targets: list[ProbeTarget]) -> None:
        """Targets of a product or deployment added while serving: probed at once (their
        deployments take no order before), then looped as at start."""
        self._targets.extend(targets)
        await self._begin(targets)

    def remove(self, product: str, deployment: str | None = None) -> None:
        """Stop probing ``product``'s ``deployment`` (None: every one of the product)."""

        def gone(t: ProbeTarget) -> bool:
            return t.product == product and deployment in (None, t.deployment.name)

        self._targets = [t for t in self._targets if not gone(t)]
        for task in [t for t in self._tasks if gone(self._task_targets[t])]:
            task.cancel()
            self._tasks.remove(task)
            del self._task_targets[task]

    async def _begin(self, targets: list[ProbeTarget]) -> None:
        probes = await asyncio.gather(*(self._probe(t) for t in targets))
        for target, probe in zip(targets, probes, strict=True):
            self.apply(target, probe)
            d = target.deployment
            state = "available" if probe.reason is None else f"unavailable: {probe.reason}"
            log.info("deployment %s of %s: flavour %s, %d slots, %s",
                     d.name, target.product, probe.flavor, d.slots, state)  # fmt: skip
            if target.interval_s > 0 or probe.reason is not None:
                task = asyncio.create_task(self._loop(target), name=f"probe {d.name}")
                self._tasks.append(task)
                self._task_targets[task] = target

    async def _loop(self, target: ProbeTarget) -> None:
        """Every ``interval_s``; with periodic probes off, every ``retry_s`` until one passes."""
        periodic = target.interval_s > 0
        while periodic or not target.deployment.availability.ok:
            await asyncio.sleep(target.interval_s if periodic else self._retry_s)
            if self._disturbs(target):
                continue
            self.apply(target, await self._probe(target))

    @staticmethod
    async def _probe(target: ProbeTarget) -> Probe:
        """The engine's probe; one that breaks (it should not) reads as a failed probe."""
        try:
            return await target.engine.probe()
        except Exception as exc:  # the probing must go on: say it, and keep the deployment out
            log.exception("the probe of deployment %s failed", target.deployment.name)
            return Probe(f"its probe failed ({type(exc).__name__})", target.engine.flavor)

    def _disturbs(self, target: ProbeTarget) -> bool:
        """A probe now would hold up or end a generation this replica runs on that server
        (any deployment on it: several products may share one engine)."""
        if target.engine.flavor != "llama-cpp-python":
            return False
        server = target.engine.upstream
        return any(t.deployment.busy > 0 for t in self._targets if t.engine.upstream == server)

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        self._task_targets.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
