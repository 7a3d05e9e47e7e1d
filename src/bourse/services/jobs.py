"""Detached jobs: an order that holds a place in the book without holding a socket.

A job is submitted with the same checks and hold as a direct request (401, 402,
403, 429 answer the submit), stored, and run by a task of its own that folds the
stream into one completion. Its state lives in the store, so a restarted gateway
resumes it: queued and running jobs re-enter the book in their original order (a
running job starts again from the beginning: nothing was delivered); the old hold,
which start-up moved to ``reconciling``, is released and a new one placed, so the
job is charged once. The stored body carries the terms the submit's headers gave
(``X-Max-Price``, ``X-Book-Timeout``, ``X-Deadline-S``), and a resumed deadline job
keeps its original deadline (the time left since ``created_at``; 408 ``book_timeout``
if none is). A job whose earlier run was already charged (the gateway
stopped between the settlement and storing the result) is not run again: it fails
with an error saying so. A draining gateway (SIGTERM) hands back the jobs it has not
finished: each is stopped, its hold released without a usage record, and it is stored
queued with no owner, for the next gateway to claim and run from the start. When a
job ends, its webhook (if any) receives one signed POST, retried with capped, jittered
exponential back-off (:mod:`bourse.retrying`). A job that ended reads ``expired``,
without its result, from ``expires_at`` on; a result stays readable at least
``min_result_s`` after its job ends, even when the job's TTL ran out while it ran (its
``expires_at`` moves). The sweeper frees the stored results later. A job's times are
on the database's clock (:class:`~bourse.services.clock.DatabaseClock`), since any
replica may judge them; which replica's lease lapsed is judged in the store's SQL. A job state the
database refuses (it is unavailable) is kept in memory and written by the job's next
write or by :meth:`JobService.sweep` once the database takes it again (see
:mod:`bourse.services.housekeeping`); its webhook waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from bourse.domain.errors import GatewayError, book_timeout, invalid_request
from bourse.domain.values import immutable
from bourse.ports.engine import ChunkEvent, Kind
from bourse.ports.limits import KeyLimits
from bourse.ports.observer import NULL_OBSERVER, Observer
from bourse.ports.stores import (
    FINAL_JOB_STATES,
    ApiKey,
    HoldNotOpen,
    Job,
    JobStore,
    KeyStore,
    LedgerStore,
    StoreUnavailable,
    WebhookSecretStore,
)
from bourse.ports.webhooks import WebhookSender
from bourse.services import billing
from bourse.services.auth import Principal
from bourse.services.completion import CompletionService
from bourse.services.ids import new_request_id
from bourse.services.job_webhooks import JobWebhooks
from bourse.services.run import Run
from bourse.services.run_events import Finished, HandedBack
from bourse.services.run_state import Phase
from bourse.services.run_terms import Ask
from bourse.services.webhooks import check_target
from bourse.wire.chunks import Aggregator
from bourse.wire.requests import check_storable, validate

log = logging.getLogger("bourse.jobs")

ENDPOINTS: dict[str, Kind] = {path: kind for kind, path in billing.ENDPOINTS.items()}
"""The kind of run each job endpoint is (billing's map, read the other way)."""
MAX_UNWRITTEN = 100_000
"""Job states the database refused, kept for the sweep; past it a job stays as stored
until the gateway's next start resumes it."""
_ENDED = FINAL_JOB_STATES - {"expired"}
"""The states whose result is kept until ``expires_at``."""


def _result_lost(job: Job, charged_micros: int) -> GatewayError:
    """A job whose run was charged but whose result the gateway never stored (it stopped
    between the two): it is not run again, so it is not charged twice."""
    return GatewayError(
        500,
        "internal_error",
        f"The gateway stopped after job {job.id} was generated and charged ({charged_micros} micro-USD; "
        f"its receipt is at GET /v1/usage/{job.request_id}) and before its result was stored: the result "
        "is lost. The job is not run again, so it is not charged twice; ask the operator for a refund.",
    )


class JobsStore(JobStore, LedgerStore, KeyStore, WebhookSecretStore, Protocol):
    single_node: bool
    """True for the embedded database: every unfinished job at start-up is this node's."""


@immutable
class JobLimits:
    ttl_s: float = 86_400.0
    min_result_s: float = 600.0
    """A result stays readable at least this long after its job ends."""
    max_ttl_s: float = 7 * 86_400.0
    allow_private_webhooks: bool = False
    allow_loopback_webhooks: bool = False
    webhook_attempts: int = 6
    webhook_backoff_s: float = 1.0
    sweep_interval_s: float = 30.0
    max_active: int = 100_000


@dataclass(slots=True, eq=False)
class Active:
    job: Job
    run: Run
    task: asyncio.Task[None] | None = None
    agg: Aggregator | None = None
    admit_task: asyncio.Task[None] | None = None
    tap: Callable[[dict[str, Any]], None] | None = None
    """Sees each chunk as it comes (a background response's stream)."""
    started_at: float | None = None
    """When the run got its slot (the ``running`` mark's time, shown before it is stored)."""
    cancelable: bool = True
    """The run still goes: a cancel stops it. False once it has ended (or a cancel is
    under way): the task writes the job's state, which nothing may interrupt (an
    interrupted write would leave the job ``running`` for ever, its hold settled)."""


@dataclass
class JobService:
    store: JobsStore
    completions: CompletionService
    sender: WebhookSender
    limits: JobLimits = field(default_factory=JobLimits)
    observer: Observer = NULL_OBSERVER
    active: dict[str, Active] = field(default_factory=dict)
    _sweeper: asyncio.Task[None] | None = None
    _claimer: asyncio.Task[None] | None = None
    _unwritten: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Job states the database refused (unavailable), by job id: the next write of the
    job carries them, or :meth:`sweep` writes them once the job no longer runs here."""
    _webhooks: JobWebhooks = field(init=False)
    """Sends the ended jobs' webhooks (:mod:`bourse.services.job_webhooks`)."""

    def __post_init__(self) -> None:
        self._webhooks = JobWebhooks(self)

    # -- submit -------------------------------------------------------------------

    async def submit(
        self,
        principal: Principal,
        endpoint: str,
        body: dict[str, Any],
        *,
        webhook_url: str | None = None,
        ttl_s: float | None = None,
        max_price_header: str | None = None,
        timeout_header: str | None = None,
        deadline_header: str | None = None,
        request_id: str | None = None,
        tap: Callable[[dict[str, Any]], None] | None = None,
        route: str | None = None,
    ) -> dict[str, Any]:
        """Accept a job at ``endpoint`` (one of :data:`ENDPOINTS`) and start it. ``route``:
        the route the client called when it is not ``endpoint`` (a background response,
        ``/v1/responses``, runs as a chat completion); the job keeps it as its endpoint."""
        kind = ENDPOINTS.get(endpoint)
        if kind is None:
            raise invalid_request(f"endpoint: expected one of {', '.join(ENDPOINTS)}", param="endpoint")
        if len(self.active) >= self.limits.max_active:
            raise GatewayError(
                503, "no_capacity", "Too many jobs are active; retry later.", headers={"retry-after": "5"}
            )
        ttl = self.limits.ttl_s if ttl_s is None else ttl_s
        if not 0 < ttl <= self.limits.max_ttl_s:
            raise invalid_request(f"ttl_s: expected 0 < ttl_s <= {self.limits.max_ttl_s:g}", param="ttl_s")
        if webhook_url is not None:
            await check_target(
                webhook_url,
                allow_private=self.limits.allow_private_webhooks,
                allow_loopback=self.limits.allow_loopback_webhooks,
                resolve=self.sender.resolve,
            )
        body = {k: v for k, v in body.items() if k != "detached"}
        body["stream"] = False
        req = validate(kind, body)
        check_storable(body, "body")  # the job's row keeps it: written once before the hold
        deadline = req.deadline_s is not None or deadline_header is not None  # its own timeout
        if req.timeout is None and timeout_header is None and not deadline:
            timeout_header = str(min(ttl, self.completions.limits.book_timeout_max_s))
        now = self._now()
        run = await self.completions.open(
            kind, body, req, principal,
            request_id=request_id or new_request_id(kind), max_price_header=max_price_header, timeout_header=timeout_header,
            deadline_header=deadline_header, route=route or endpoint,
        )  # fmt: skip
        job = Job(
            id="job_" + os.urandom(12).hex(),
            account_id=principal.account_id,
            key_id=principal.key.id,
            endpoint=route or endpoint,
            body=_recorded(body, run.terms.ask, max_price_header),
            status="queued",
            request_id=run.request_id,
            bid=run.bid,
            created_at=now,
            expires_at=now + ttl,
            hold_id=run.hold_id,
            webhook_url=webhook_url,
            webhook_state="pending" if webhook_url else "none",
            owner=self.completions.billing.owner,
        )
        try:
            await self.store.put_job(job)
        except BaseException:
            await run.abandon()
            raise
        self._start(job, run, tap)
        return await self.view(job)

    def _start(self, job: Job, run: Run, tap: Callable[[dict[str, Any]], None] | None = None) -> None:
        run.detach()
        act = Active(job, run, agg=Aggregator(run.kind, run.market.policy.reasoning_field), tap=tap)
        self.active[job.id] = act
        act.task = self._spawn(self._execute(act))

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        return self.completions.spawn(coro)

    def _now(self) -> float:
        """Now on the database's clock: a job's times are compared by every replica."""
        return self.completions.billing.clock.now()

    async def _execute(self, act: Active) -> None:
        run, job, agg = act.run, act.job, act.agg
        assert agg is not None
        fin: Finished | None = None
        canceled = False

        def admitted(r: Run) -> None:
            act.started_at = now = self._now()
            act.admit_task = self._spawn(self._update(job.id, status="running", started_at=now))

        try:
            try:
                async for ev in run.events(on_admit=admitted):
                    if type(ev) is ChunkEvent:
                        agg.add(ev.chunk)
                        if act.tap is not None:
                            act.tap(ev.chunk)
                    elif type(ev) is Finished:
                        fin = ev
                act.cancelable = False  # ended: a cancel from now on waits for the job's state
            except asyncio.CancelledError:
                act.cancelable = False
                canceled = True
                await run.abandon()  # done already by the run's own events, unless they never began
                fin = await run.settled()
            except HandedBack:
                act.cancelable = False
                if act.admit_task is not None:
                    await act.admit_task
                await self._hand_back(job, run)
                return
            if act.admit_task is not None:
                await act.admit_task  # the 'running' mark lands before the final state
            await self._record(job, run, agg, fin, canceled)
        except Exception:
            log.exception("job %s failed in the gateway", job.id)
            await self._failed_in_gateway(job, run, fin)
        finally:
            self.active.pop(job.id, None)
        if job.webhook_url and job.id not in self._unwritten:  # else the sweep notifies, once it is written
            await self._webhooks.notify(job.id)

    async def _failed_in_gateway(self, job: Job, run: Run, fin: Finished | None) -> None:
        if not await self._given_back(job, run, fin):
            err = GatewayError(500, "internal_error", f"The gateway failed while running job {job.id}.")
            await self._update(job.id, status="failed", error={"error": err.envelope()}, **self._ended(job))

    async def _given_back(self, job: Job, run: Run, fin: Finished | None) -> bool:
        """A job charged whose result could not be kept: it fails with its charge given
        back, in one transaction (never a charge without its answer). False when it was
        not charged, or the store refused that too (then the job fails as it can)."""
        if fin is None or fin.cost_micros <= 0 or run.hold_id is None:
            return False
        err = GatewayError(
            503, "no_capacity",
            f"The gateway could not keep job {job.id}'s result after its run; its charge of {fin.cost_micros} "
            "micro-USD was given back. Submit the job again.",
            headers={"retry-after": "5"},
        )  # fmt: skip
        fields = {
            "status": "failed",
            "error": {"error": err.envelope(), "status": err.status},
            **self._ended(job),
        }
        try:
            back = await self.store.fail_job_refunded(
                job.id,
                run.hold_id,
                fields,
                "its result could not be kept: the charge was given back",
                self._now(),
            )
        except Exception:
            log.exception("job %s: its charge could not be given back; it stays charged", job.id)
            return False
        log.warning(
            "job %s: its result could not be kept; its charge of %d micro-USD was given back", job.id, back
        )
        return True

    async def _hand_back(self, job: Job, run: Run) -> None:
        """The gateway drains: the job goes back to the store queued and unowned, its hold
        released without a usage record, for the next gateway to run from the start."""
        try:
            await self.completions.give_back(run)
            written = await self._update(job.id, status="queued", hold_id=None, started_at=None, owner=None)
        except Exception:  # still this gateway's: its next start (or a replica, its lease lapsed) resumes it
            log.exception("job %s could not be handed back", job.id)
            return
        if written:
            log.info("job %s handed back: the gateway is draining", job.id)

    async def _update(self, job_id: str, **fields: Any) -> bool:
        """Write a running job's state. One the database refuses (unavailable, after the
        adapter's own retries) is kept, not lost (a state lost here would strand the job
        as queued or running): the job's next write carries it, or :meth:`sweep` writes
        it (False)."""
        kept = self._unwritten.pop(job_id, None)
        if kept is not None:
            fields = {**kept, **fields}
        try:
            await self.store.update_job(job_id, **fields)
        except StoreUnavailable:
            if len(self._unwritten) < MAX_UNWRITTEN:
                self._unwritten[job_id] = fields
                log.error("job %s: the database refused its state (%s); the sweep writes it once the "
                          "database takes it", job_id, fields.get("status"))  # fmt: skip
            else:
                log.error("job %s: the database refused its state (%s) and %d states wait already; the "
                          "gateway's next start resumes the job", job_id, fields.get("status"), MAX_UNWRITTEN)  # fmt: skip
            return False
        except BaseException:  # not the database's unavailability: what was kept before stays kept
            if kept is not None:
                self._unwritten.setdefault(job_id, kept)
            raise
        return True

    async def sweep(self) -> int:
        """Write the states the database refused of the jobs that no longer run here
        (one attempt each; the store's failure is raised, what is left waits for the next
        sweep); the number written. A job that has ended then gets its webhook."""
        written = 0
        for job_id, fields in list(self._unwritten.items()):
            if job_id in self.active:  # its run writes again: that write carries these fields
                continue
            await self.store.update_job(job_id, **fields)
            if self._unwritten.get(job_id) is fields:
                del self._unwritten[job_id]
            written += 1
            if fields.get("status") in FINAL_JOB_STATES:
                self._spawn(self._webhooks.notify(job_id))
        if written:
            log.warning("job sweep: %d job states written (the database had refused them)", written)
        return written

    def _ended(self, job: Job) -> dict[str, float]:
        """The times of a job that ends now: ``finished_at``, and ``expires_at`` moved
        to ``finished_at + min_result_s`` when its TTL would throw the result away sooner
        (a job whose TTL ended while it ran is charged: its result stays readable)."""
        now = self._now()
        times = {"finished_at": now}
        if job.expires_at < now + self.limits.min_result_s:
            times["expires_at"] = now + self.limits.min_result_s
        return times

    async def _record(
        self, job: Job, run: Run, agg: Aggregator, fin: Finished | None, canceled: bool
    ) -> None:
        ended = self._ended(job)
        if fin is None:
            await self._update(job.id, status="canceled" if canceled else "failed", **ended)
            return
        doc = agg.build(run.request_id, run.product, run.created, fin.usage)
        doc[run.market.policy.receipt_name] = fin.receipt
        if canceled:
            await self._update(job.id, status="canceled", result=doc, **ended)
        elif fin.error is None:
            await self._update(job.id, status="succeeded", result=doc, **ended)
        else:
            err = {"error": fin.error.envelope(), "status": fin.error.status, "usage": fin.usage,
                   run.market.policy.receipt_name: fin.receipt}  # fmt: skip
            await self._update(job.id, status="failed", error=err, **ended)

    # -- read and cancel -------------------------------------------------------------

    async def view(self, job: Job) -> dict[str, Any]:
        act = self.active.get(job.id)
        if job.status in _ENDED and self._now() >= job.expires_at:  # the sweeper has yet to come
            job = replace(job, status="expired", result=None, error=None)
        status = job.status
        out: dict[str, Any] = {
            "id": job.id,
            "object": "bourse.job",
            "status": status,
            "endpoint": job.endpoint,
            "model": job.body.get("model"),
            "request_id": job.request_id,
            "created_at": job.created_at,
            "expires_at": job.expires_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "webhook_url": job.webhook_url,
        }
        if job.webhook_url:
            out["webhook"] = {"state": job.webhook_state, "error": job.webhook_error}
        if act is not None:
            run = act.run
            if run.phase >= Phase.ADMITTED:
                out["status"] = "running"
                if job.started_at is None:  # its mark is on its way to the database
                    out["started_at"] = act.started_at
                out["progress"] = {"tokens": run.tokens, "max_tokens": run.max_output_tokens}
            else:
                out["status"] = "queued"
                level, pos = await run.market.standing(run.order)
                out["queue"] = {"position": max(pos, 0), "bid": run.bid, "level": level,
                                "requeues": run.order.requeues if run.order else 0}  # fmt: skip
        if job.result is not None:
            out["result"] = job.result
        if job.error is not None:
            out["error"] = job.error
        return out

    async def get(self, job_id: str, account_id: str) -> dict[str, Any]:
        job = await self.store.job(job_id, account_id)
        if job is None:
            raise GatewayError(404, "not_found", f"No job '{job_id}' for this account.")
        return await self.view(job)

    async def list(self, account_id: str, limit: int, after: str | None) -> dict[str, Any]:
        rows = await self.store.jobs_page(account_id, limit=limit + 1, after=after)
        page = rows[:limit]
        more = len(rows) > limit
        return {"object": "list", "data": [await self.view(j) for j in page], "has_more": more,
                "next_after": page[-1].id if more and page else None}  # fmt: skip

    async def cancel(self, job_id: str, account_id: str) -> dict[str, Any]:
        job = await self.store.job(job_id, account_id)
        if job is None:
            raise GatewayError(404, "not_found", f"No job '{job_id}' for this account.")
        act = self.active.get(job_id)
        if act is not None and act.task is not None:
            if act.cancelable:  # else its run has ended: the job's own state stands
                act.cancelable = False
                act.task.cancel()
            await asyncio.wait([act.task])
        elif job.status not in FINAL_JOB_STATES:
            await self.store.update_job(job_id, status="canceled", finished_at=self._now())
        return await self.get(job_id, account_id)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> int:
        """Resume the jobs a previous run left queued or running; start the sweeper."""
        resumed = await self._claim(all_others=self.store.single_node, include_own=True)
        self._sweeper = asyncio.create_task(self._sweep())
        if not self.store.single_node:
            self._claimer = asyncio.create_task(self._claim_lapsed())
        return resumed

    async def _claim_lapsed(self) -> None:
        """Replicas: take over the jobs of a replica whose ledger lease lapsed."""
        every = self.completions.billing.lease_s / 3
        while True:
            await asyncio.sleep(every)
            try:
                n = await self._claim(all_others=False)
                if n:
                    log.warning("resumed %d jobs of a replica whose lease lapsed", n)
            except Exception:
                log.exception("claiming the jobs of lapsed replicas failed")

    async def _claim(self, *, all_others: bool, include_own: bool = False) -> int:
        """Resume the jobs left by a previous life of this instance or by others (all
        of them on one node at start-up; those whose owner's lease lapsed on replicas)."""
        resumed = 0
        owner = self.completions.billing.owner
        jobs = await self.store.claim_jobs(owner, all_others=all_others, include_own=include_own)
        for job in jobs:
            if job.id in self.active:
                continue
            try:
                await self._resume(job)
                resumed += 1
            except Exception:
                log.exception("could not resume job %s", job.id)
        return resumed

    async def _resume(self, job: Job) -> None:
        if job.hold_id is not None:
            try:  # nothing was delivered: the old attempt's hold goes back
                await self.store.release(job.hold_id, None, self._now())
            except HoldNotOpen as exc:
                charged = await self._charged(job.hold_id) if exc.state == "settled" else 0
                if charged:  # it ran to its charge; only its result was never stored
                    await self._fail_resumed(job, _result_lost(job, charged))
                    return
        kind = billing.ROUTES[job.endpoint]
        # the key's own record, so that its spend cap counts the new hold
        key = await self.store.key(job.key_id) or ApiKey(id=job.key_id, account_id=job.account_id)
        principal = Principal(key, KeyLimits())
        body = dict(job.body)
        deadline = body.get("deadline_s")
        if isinstance(deadline, int | float) and not isinstance(deadline, bool):
            left = job.created_at + deadline - self._now()  # its original deadline, not a new one
            if left <= 0:  # passed while no gateway ran it: the end its order would have had
                await self._fail_resumed(job, book_timeout(deadline))
                return
            body["deadline_s"] = float(left)
        try:
            req = validate(kind, body)
            # accepted long ago: it waits out open breakers in the book rather than fail
            run = await self.completions.open(
                kind, body, req, principal, request_id=job.request_id, fail_fast=False, route=job.endpoint
            )
        except GatewayError as exc:
            if exc.code == "draining":  # stopping meanwhile: left, unowned, for the next gateway
                await self._update(job.id, status="queued", hold_id=None, started_at=None, owner=None)
                return
            await self._fail_resumed(job, exc)
            return
        await self._update(job.id, status="queued", hold_id=run.hold_id, started_at=None)
        self._start(job, run)

    async def _charged(self, hold_id: str) -> int:
        """What the hold of a job's earlier run charged (0: released or reconciled)."""
        hold = await self.store.hold(hold_id)
        return hold.charged_micros if hold is not None and hold.state == "settled" else 0

    async def _fail_resumed(self, job: Job, exc: GatewayError) -> None:
        error = {"error": exc.envelope(), "status": exc.status}
        written = await self._update(job.id, status="failed", error=error, hold_id=None, **self._ended(job))
        if job.webhook_url and written:
            self._spawn(self._webhooks.notify(job.id))

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.limits.sweep_interval_s)
            try:
                n = await self.store.expire_jobs(self._now())
                if n:
                    log.info("%d job results expired", n)
                for job in await self.store.jobs_to_notify():
                    if (
                        job.id not in self._webhooks.sending
                        and job.id not in self.active
                        and job.id not in self._unwritten
                    ):
                        self._spawn(self._webhooks.notify(job.id))
            except Exception:
                log.exception("job sweep failed")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._claimer is not None:
            self._claimer.cancel()
            self._claimer = None


def _recorded(body: dict[str, Any], ask: Ask, max_price_header: str | None) -> dict[str, Any]:
    """The body a job's row keeps, which a later gateway resuming the job runs: the
    request's own, with the terms its headers gave (``X-Max-Price``, ``X-Book-Timeout``
    or the job's default timeout, ``X-Deadline-S``) written in as the body fields they
    stand for, so that it bids and waits as it was asked. A deadline order's
    ``deadline_s`` counts from the job's ``created_at``."""
    out = dict(body)
    if max_price_header is not None and out.get("max_price") is None:
        out["max_price"] = ask.bid
    if ask.deadline_s is not None:
        out["deadline_s"] = ask.deadline_s
    elif out.get("timeout") is None:
        out["timeout"] = ask.timeout_s
    return out
