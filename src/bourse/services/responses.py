"""Stored and background responses of the Responses API.

A response runs as a chat generation (:mod:`bourse.wire.responses` translates it); this
service keeps what the Responses API adds around the run:

- the stored response (``store``, true by default), owned by its account (another
  account's id reads 404) and kept ``retention_s`` (a sweeper deletes expired ones;
  they are hidden from the instant they expire), with its input items and its
  *context*: the conversation through it, which ``previous_response_id`` prepends;
- background responses (``background: true``): a detached job
  (:class:`~bourse.services.jobs.JobService`) runs the chat request, with the book, the
  hold, restart survival and replica takeover jobs have; the response reads the job's
  state (``queued`` → ``in_progress`` → ``completed`` | ``incomplete`` | ``failed`` |
  ``cancelled``) and, once the job ended, keeps its output as its own (the job's result
  expires sooner than a stored response);
- a background stream (``stream`` and ``background``): the run's typed events are kept
  while it runs, so that ``GET /v1/responses/{id}?stream=true&starting_after=N`` can
  resume it on the replica that runs it (:class:`EventLog`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.values import immutable
from bourse.ports.stores import ResponseRecord, ResponseStore
from bourse.services.auth import Principal
from bourse.services.billing import ENDPOINTS, RESPONSES
from bourse.services.jobs import JobService
from bourse.wire.responses import (
    FINAL_STATUSES,
    ResponseBuilder,
    ResponsesRequest,
    referenced,
    response_object,
)

log = logging.getLogger("bourse.responses")

CHAT = ENDPOINTS["chat"]
"""The job endpoint a background response runs as (its kind of run)."""
LOG_GRACE_S = 300.0
"""How long a background stream's events are kept after its end, for late readers."""
_JOB_STATUS = {"queued": "queued", "running": "in_progress"}


@immutable
class ResponseLimits:
    retention_s: float = 30 * 86_400.0
    sweep_interval_s: float = 600.0


def not_found(response_id: str, param: str | None = None) -> GatewayError:
    return GatewayError(404, "not_found", f"No response '{response_id}' for this account.", param=param)


@dataclass(eq=False)
class EventLog:
    """The typed events of a background stream, kept while it runs (and ``LOG_GRACE_S``
    after) for the readers that follow or resume it. Its events are numbered from 0, so
    an event's ``sequence_number`` is its index."""

    builder: ResponseBuilder
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _extend(self, done: bool = False) -> None:
        self.events.extend(self.builder.take())
        self.done = self.done or done
        self._changed.set()
        self._changed = asyncio.Event()

    def queued(self) -> None:
        self.builder.queued()
        self._extend()

    def tap(self, chunk: dict[str, Any]) -> None:
        """A chunk of the job's run (:attr:`bourse.services.jobs.Active.tap`)."""
        self.builder.add(chunk)
        self._extend()

    def finished(self) -> None:
        self._extend(done=True)

    async def follow(
        self, starting_after: int | None, keep_alive_s: float
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """The events after sequence number ``starting_after``, as they come, to the end;
        an empty batch after ``keep_alive_s`` without one."""
        at = 0 if starting_after is None else max(starting_after + 1, 0)
        while True:
            changed = self._changed
            if at < len(self.events):
                batch = self.events[at:]
                at += len(batch)
                yield batch
                continue
            if self.done:
                return
            try:
                await asyncio.wait_for(changed.wait(), keep_alive_s)
            except TimeoutError:
                yield []


class ResponseService:
    """Stored responses, ``previous_response_id`` and background responses."""

    def __init__(
        self,
        store: ResponseStore,
        jobs: JobService,
        limits: ResponseLimits | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.clock = clock
        """The database's clock: a stored response's expiry is judged by every replica."""
        self.jobs = jobs
        self.limits = limits or ResponseLimits()
        self.logs: dict[str, EventLog] = {}
        """The event logs of the background streams running here, by response id."""
        self._sweeper: asyncio.Task[None] | None = None

    # -- the conversation ------------------------------------------------------------

    async def history(self, previous_id: str | None, account_id: str) -> list[dict[str, Any]]:
        """The stored conversation ``previous_response_id`` names (empty without one)."""
        if previous_id is None:
            return []
        rec = await self._record(previous_id, account_id, "previous_response_id")
        if rec.status not in FINAL_STATUSES:
            raise invalid_request(
                f"previous_response_id: the response '{previous_id}' is still {rec.status}; wait for it to end.",
                param="previous_response_id",
            )
        return [dict(item) for item in rec.context]

    async def resolve(self, items: Sequence[Mapping[str, Any]], account_id: str) -> list[dict[str, Any]]:
        """``items`` with each ``item_reference`` replaced by the output item it names (of
        one of the account's stored responses); 404 naming the reference otherwise."""
        out: list[dict[str, Any]] = []
        records: dict[str, ResponseRecord | None] = {}
        for i, item in enumerate(items):
            if item.get("type") != "item_reference":
                out.append(dict(item))
                continue
            found = await self._referenced(str(item["id"]), account_id, records)
            if found is None:
                raise GatewayError(
                    404, "not_found", f"No item '{item['id']}' for this account.", param=f"input.{i}.id"
                )
            out.append(found)
        return out

    async def _referenced(
        self, item_id: str, account_id: str, records: dict[str, ResponseRecord | None]
    ) -> dict[str, Any] | None:
        where = referenced(item_id)
        if where is None:
            return None
        response_id, index = where
        if response_id not in records:
            records[response_id] = await self.store.response(response_id, account_id, self.clock())
        rec = records[response_id]
        output = [] if rec is None else rec.body.get("output") or []
        if index >= len(output) or output[index].get("id") != item_id:
            return None
        return dict(output[index])

    async def save(
        self,
        account_id: str,
        items: Sequence[Mapping[str, Any]],
        history: Sequence[Mapping[str, Any]],
        response: Mapping[str, Any],
    ) -> None:
        """Keep a finished response (its input ``items`` after the ``history`` it continued)."""
        now = self.clock()
        context = [*history, *items, *response["output"]]
        await self.store.put_response(
            ResponseRecord(
                id=response["id"],
                account_id=account_id,
                status=response["status"],
                body=response,
                input_items=list(items),
                context=context,
                created_at=now,
                expires_at=now + self.limits.retention_s,
            )
        )

    # -- background ------------------------------------------------------------------

    async def submit(
        self,
        principal: Principal,
        req: ResponsesRequest,
        chat: dict[str, Any],
        items: Sequence[Mapping[str, Any]],
        history: Sequence[Mapping[str, Any]],
        *,
        request_id: str,
        max_price_header: str | None = None,
        timeout_header: str | None = None,
        deadline_header: str | None = None,
    ) -> dict[str, Any]:
        """Start a background response as a detached job; the response, ``queued``. With
        ``stream``, its events are kept (:attr:`logs`) from ``response.created`` on."""
        now = self.clock()
        response = response_object(request_id, req, req.model, int(now), "queued")
        events = EventLog(ResponseBuilder(response, events=True)) if req.stream else None
        if events is not None:
            events.queued()
            self.logs[request_id] = events
        ttl = min(self.limits.retention_s, self.jobs.limits.max_ttl_s)
        try:
            job = await self.jobs.submit(
                principal, CHAT, chat, ttl_s=ttl, max_price_header=max_price_header,
                timeout_header=timeout_header, deadline_header=deadline_header, request_id=request_id,
                route=RESPONSES,
                tap=None if events is None else events.tap,
            )  # fmt: skip
        except BaseException:
            self.logs.pop(request_id, None)
            raise
        queued = {**response, "status": "queued", "output": []}  # the builder's goes on changing
        rec = ResponseRecord(
            id=job["request_id"],
            account_id=principal.account_id,
            status="queued",
            body=queued,
            input_items=list(items),
            context=[*history, *items],
            created_at=now,
            expires_at=now + self.limits.retention_s,
            job_id=job["id"],
        )
        try:
            await self.store.put_response(rec)
        except BaseException:
            await self.jobs.cancel(job["id"], principal.account_id)
            raise
        self._watch(rec)
        return queued

    def _watch(self, rec: ResponseRecord) -> None:
        """Keep the output (and end a background stream) when the job ends; a read would
        keep it too, later."""
        act = self.jobs.active.get(rec.job_id or "")
        task = None if act is None else act.task

        async def watch() -> None:
            if task is not None:
                await asyncio.wait([task])
            try:
                await self._settle(rec)
            except Exception:
                log.exception("background response %s: its end could not be kept", rec.id)

        self.jobs.completions.spawn(watch())

    async def _settle(self, rec: ResponseRecord) -> ResponseRecord:
        """A background response as its job stands: the final one is kept."""
        if rec.job_id is None or rec.status in FINAL_STATUSES:
            return rec
        try:
            job = await self.jobs.get(rec.job_id, rec.account_id)
        except GatewayError:
            job = {"status": "expired"}
        status = _JOB_STATUS.get(job["status"])
        if status is not None:
            return replace(rec, status=status, body={**rec.body, "status": status})
        current = await self.store.response(rec.id, rec.account_id, self.clock())
        if current is not None and current.status in FINAL_STATUSES:
            return current  # kept meanwhile (a watcher and a read)
        body = self._final(rec, job)
        rec = replace(rec, status=body["status"], body=body, context=[*rec.context, *body["output"]])
        await self.store.put_response(rec)
        return rec

    def _final(self, rec: ResponseRecord, job: Mapping[str, Any]) -> dict[str, Any]:
        """The response of an ended job: its result's output, usage and receipt, or its
        error. A background stream's own builder ends it (its items keep their ids)."""
        events = self.logs.get(rec.id)
        if events is not None and events.done:  # ended meanwhile (a watcher and a read)
            return dict(events.builder.response)
        builder = (
            ResponseBuilder({**rec.body, "output": []}, events=False) if events is None else events.builder
        )
        result = job.get("result")
        receipt = self._receipt_name(str(rec.body.get("model")))
        if events is None and isinstance(result, Mapping):
            choice = (result.get("choices") or [{}])[0]
            builder.add_message(choice.get("message") or {}, choice.get("finish_reason"))
        response = _finish(builder, job, receipt)
        if events is not None:
            events.finished()
            asyncio.get_running_loop().call_later(LOG_GRACE_S, self.logs.pop, rec.id, None)
        return response

    def _receipt_name(self, product: str) -> str:
        """The product's receipt object's name (its policy's)."""
        market = self.jobs.completions.markets.get(product)
        return "receipt" if market is None else market.policy.receipt_name

    # -- reads -----------------------------------------------------------------------

    async def _record(self, response_id: str, account_id: str, param: str | None = None) -> ResponseRecord:
        rec = await self.store.response(response_id, account_id, self.clock())
        if rec is None:
            raise not_found(response_id, param)
        return await self._settle(rec)

    async def get(self, response_id: str, account_id: str) -> dict[str, Any]:
        rec = await self._record(response_id, account_id)
        return dict(rec.body)

    async def cancel(self, response_id: str, account_id: str) -> dict[str, Any]:
        """Cancel a background response: a queued one is never charged, a running one by
        its product's policy; an ended one is returned unchanged."""
        rec = await self._record(response_id, account_id)
        if rec.job_id is None:
            raise invalid_request("Only a background response can be cancelled.", param="response_id")
        if rec.status in FINAL_STATUSES:
            return dict(rec.body)
        await self.jobs.cancel(rec.job_id, account_id)
        return dict((await self._settle(rec)).body)

    async def delete(self, response_id: str, account_id: str) -> dict[str, Any]:
        rec = await self._record(response_id, account_id)
        if rec.job_id is not None and rec.status not in FINAL_STATUSES:
            await self.jobs.cancel(rec.job_id, account_id)
        if not await self.store.delete_response(response_id, account_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def input_items(
        self, response_id: str, account_id: str, *, limit: int, after: str | None, order: str
    ) -> dict[str, Any]:
        """A page of the response's input items (``order``: ``asc`` or ``desc``, OpenAI's default)."""
        rec = await self._record(response_id, account_id)
        items = [dict(i) for i in rec.input_items]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i.get("id") for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    # -- the sweeper -----------------------------------------------------------------

    async def purge_once(self, batch: int = 1000) -> int:
        now, total = self.clock(), 0
        while True:
            n = await self.store.purge_responses(now, batch)
            total += n
            if n < batch:
                return total

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="bourse-responses-sweeper")

    async def stop(self) -> None:
        task, self._sweeper = self._sweeper, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _sweep(self) -> None:
        while True:
            try:
                n = await self.purge_once()
                if n:
                    log.info("%d stored responses expired", n)
            except Exception:
                log.exception("deleting expired responses failed; the next pass retries")
            await asyncio.sleep(self.limits.sweep_interval_s)


def _finish(builder: ResponseBuilder, job: Mapping[str, Any], receipt: str) -> dict[str, Any]:
    """End ``builder``'s response as the ended ``job`` says: completed with its result's
    usage and receipt, cancelled, or failed with its error."""
    result = job.get("result")
    usage: Mapping[str, Any] | None = None
    extra: dict[str, Any] = {}
    if isinstance(result, Mapping):
        usage = result.get("usage")
        extra = {receipt: result[receipt]} if receipt in result else {}
    status = job["status"]
    if status == "succeeded":
        return builder.finish(usage, extra=extra, completed_at=job.get("finished_at"))
    if status == "canceled":
        return builder.finish(usage, cancelled=True, extra=extra)
    failure = job.get("error") or {}
    env = failure.get("error") or {}
    error = {
        "code": env.get("code") or status,
        "message": env.get("message") or f"The background response's job is {status}.",
    }
    if receipt in failure:
        extra = {receipt: failure[receipt]}
    return builder.finish(failure.get("usage", usage), error, extra=extra)
