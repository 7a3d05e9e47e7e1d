"""A detached job's webhook: one signed POST when the job ends, retried with capped,
jittered exponential back-off (:mod:`bourse.retrying`), to a target checked again at
each attempt (:func:`~bourse.services.webhooks.check_target`). A job whose account's
secret cannot be opened here is held, not sent unsigned. The job's state (the
webhook's too) is in the store; :class:`JobWebhooks` only delivers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import orjson

from bourse.domain.errors import GatewayError
from bourse.ports.observer import Observer
from bourse.ports.stores import FINAL_JOB_STATES, Job, JobStore, WebhookSecretStore, WebhookSecretUnreadable
from bourse.ports.webhooks import WebhookSender
from bourse.retrying import backoff_s
from bourse.services.webhooks import check_target, sign

log = logging.getLogger("bourse.jobs")

WEBHOOK_BACKOFF_CAP = 64
"""The jittered share of the wait between two webhook attempts is at most this many ``webhook_backoff_s``."""


class WebhookStore(JobStore, WebhookSecretStore, Protocol):
    """The store a webhook's delivery reads the job and the secret from, and records its state in."""


class WebhookLimits(Protocol):
    """The jobs' limits that bound a delivery (:class:`~bourse.services.jobs.JobLimits`)."""

    @property
    def allow_private_webhooks(self) -> bool: ...
    @property
    def allow_loopback_webhooks(self) -> bool: ...
    @property
    def webhook_attempts(self) -> int: ...
    @property
    def webhook_backoff_s(self) -> float: ...


class WebhookHost(Protocol):
    """What a delivery needs of the jobs (:class:`~bourse.services.jobs.JobService`), read
    at each delivery (an operator's or a test's sender swapped in is used from then on)."""

    @property
    def store(self) -> WebhookStore: ...
    @property
    def sender(self) -> WebhookSender: ...
    @property
    def limits(self) -> WebhookLimits: ...
    @property
    def observer(self) -> Observer: ...

    async def view(self, job: Job) -> dict[str, Any]:
        """The job as its webhook's body."""
        ...


class JobWebhooks:
    """Delivers ended jobs' webhooks for ``host``."""

    __slots__ = ("host", "sending")

    def __init__(self, host: WebhookHost) -> None:
        self.host = host
        self.sending: set[str] = set()
        """The jobs whose webhook is being sent now."""

    async def notify(self, job_id: str) -> None:
        """Send the webhook of the ended job ``job_id`` (once at a time per job)."""
        if job_id in self.sending:
            return
        self.sending.add(job_id)
        try:
            await self._deliver(job_id)
        finally:
            self.sending.discard(job_id)

    async def _deliver(self, job_id: str) -> None:
        job = await self.host.store.job(job_id)
        if (
            job is None
            or not job.webhook_url
            or job.webhook_state != "pending"
            or job.status not in FINAL_JOB_STATES
        ):
            return  # (one that has not ended, as stored: its final state may wait for the sweep)
        try:
            secret = await self.host.store.webhook_secret(job.account_id)
        except WebhookSecretUnreadable:
            secret = None
        if not secret:  # never signed with a key the receiver does not have, nor with ""
            await self._hold(job)
            return
        body = orjson.dumps(await self.host.view(job))
        attempts = self.host.limits.webhook_attempts
        for attempt in range(attempts):
            if attempt:  # at least webhook_backoff_s, then a full-jitter exponential share
                base = self.host.limits.webhook_backoff_s
                await asyncio.sleep(
                    base + backoff_s(attempt - 1, base_s=base, max_s=base * WEBHOOK_BACKOFF_CAP)
                )
            outcome = await self._post(job, job.webhook_url, secret, body, attempt)
            if outcome == "delivered":
                self.host.observer.webhook_result(job_id, "delivered")
                await self.host.store.update_job(job_id, webhook_state="delivered", webhook_error=None)
                return
            if outcome is not None:  # the target was refused: why
                await self.host.store.update_job(job_id, webhook_state="failed", webhook_error=outcome)
                return
        why = f"no 2xx answer in {attempts} attempts"
        self.host.observer.webhook_result(job_id, "failed", why)
        await self.host.store.update_job(job_id, webhook_state="failed", webhook_error=why)

    async def _hold(self, job: Job) -> None:
        """The account's secret cannot be opened here: the webhook is not sent (a
        signature the receiver cannot verify is no delivery); it waits, ``held``, until
        an admin sets a new secret or re-seals, which makes it pending again."""
        why = (
            f"not sent: the webhook secret of account {job.account_id} cannot be opened with this gateway's "
            "key (sealed by a replica with another BOURSE_SECRET_KEY, or with a key since lost); an admin "
            f"sets a new one with POST /admin/accounts/{job.account_id}/webhook_secret (or re-seals with "
            "POST /admin/webhook_secrets/reseal on a gateway that has the old key), then it is sent"
        )
        if await self.host.store.hold_webhook(job.id, why):  # (not when another gateway sent it meanwhile)
            self.host.observer.webhook_result(job.id, "held", why)

    async def _post(self, job: Job, url: str, secret: str, body: bytes, attempt: int) -> str | None:
        """One delivery attempt: "delivered", why the target is refused, or None to retry."""
        try:
            await check_target(
                url,
                allow_private=self.host.limits.allow_private_webhooks,
                allow_loopback=self.host.limits.allow_loopback_webhooks,
                resolve=self.host.sender.resolve,
            )
        except GatewayError as exc:
            why = f"target refused: {exc.message}"
            self.host.observer.webhook_result(job.id, "failed", why)
            return why
        headers = {
            "content-type": "application/json",
            # the receiver checks the stamp against its own clock: this host's (NTP) time
            "x-bourse-signature": sign(secret, int(time.time()), body),
            "x-bourse-event": "job." + job.status,
            "x-bourse-delivery": f"{job.id}.{attempt + 1}",
        }
        try:
            status = await self.host.sender.post(url, body, headers)
            if 200 <= status < 300:
                return "delivered"
            log.info("webhook of job %s answered %d (attempt %d)", job.id, status, attempt + 1)
        except OSError as exc:
            log.info("webhook of job %s failed: %s (attempt %d)", job.id, exc, attempt + 1)
        self.host.observer.webhook_result(job.id, "attempt_failed")
        return None
