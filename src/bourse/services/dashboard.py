"""The dashboard's use cases: what a signed-in person may see and do.

Every method takes the caller's :class:`~bourse.services.sessions.Session`. The admin
key and every operator see every account; they may settle or release a reconciling
hold and cancel any job as their role allows (checked by the routes' guard,
:mod:`bourse.http.dashboard.guard`, with the admin API's least roles); a user (signed
in with an API key) sees their own account only and may cancel their own jobs.
Operator actions are written to the ledger's audit log (``GET /admin/audit``): a
hold's settle or release in the same transaction as the change (through
:class:`~bourse.services.accounts.AdminService`), a job cancel right after it, with
the actor the admin API would write: ``operator:<name>``, or ``admin:dashboard`` for
the admin key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bourse.domain.errors import GatewayError
from bourse.ports.reports import ReportStore, SpendPoint, UsageFilter
from bourse.ports.stores import Account, HoldState, JobStatus, UsageRecord
from bourse.services.accounts import AdminService
from bourse.services.jobs import JobService
from bourse.services.request_feed import REFUSED, RequestFeed
from bourse.services.sessions import Session, Sessions
from bourse.services.tape import MarketTape

MAX_LIST = 200
MAX_SPEND_POINTS = 20_000


def forbidden(message: str) -> GatewayError:
    return GatewayError(403, "admin_only", message)


class Dashboard:
    def __init__(
        self,
        *,
        sessions: Sessions,
        reports: ReportStore,
        admin: AdminService,
        jobs: JobService,
        tape: MarketTape,
        feed: RequestFeed,
    ) -> None:
        self.sessions = sessions
        self.reports = reports
        self.admin = admin
        self.jobs = jobs
        self.tape = tape
        self.feed = feed

    async def stop(self) -> None:
        await self.tape.aclose()

    # -- scope --------------------------------------------------------------------

    @staticmethod
    def scope(s: Session, account: str | None = None) -> str | None:
        """The account a query covers: the user's own; for an operator ``account``
        (``None``: every account)."""
        return account if s.operator else s.account_id

    @staticmethod
    def _actor(s: Session) -> str:
        """The audit log's actor of an action taken in session ``s``."""
        if s.operator_name is not None:
            return "operator:" + s.operator_name
        return "admin:dashboard" if s.operator else f"dashboard:user:{s.account_id}"

    @classmethod
    def actor(cls, s: Session) -> str:
        """The audit log's actor of what the session does (the admin use cases take it)."""
        return cls._actor(s)

    # -- money ----------------------------------------------------------------------

    async def accounts(self, s: Session) -> Sequence[Account]:
        if s.operator:
            return await self.reports.accounts(MAX_LIST)
        assert s.account_id is not None
        acc = await self.admin.store.account(s.account_id)
        return [] if acc is None else [acc]

    async def holds(self, s: Session, state: HoldState) -> list[dict[str, Any]]:
        return await self.admin.holds(state, self.scope(s), MAX_LIST)

    async def settle(self, s: Session, hold_id: str, amount_micros: int | None) -> dict[str, Any]:
        if not s.operator:
            raise forbidden("Only the admin key or an operator may settle a hold.")
        return await self.admin.settle_hold(hold_id, amount_micros, actor=self._actor(s))

    async def release(self, s: Session, hold_id: str) -> dict[str, Any]:
        if not s.operator:
            raise forbidden("Only the admin key or an operator may release a hold.")
        return await self.admin.release_hold(hold_id, actor=self._actor(s))

    async def spend(self, s: Session, since: float, bucket_s: int) -> Sequence[SpendPoint]:
        points = await self.reports.spend(UsageFilter(account_id=self.scope(s), since=since), bucket_s)
        return points[-MAX_SPEND_POINTS:]

    # -- requests -------------------------------------------------------------------

    async def requests(
        self, s: Session, where: UsageFilter, limit: int, after: str | None
    ) -> Sequence[UsageRecord]:
        scoped = UsageFilter(self.scope(s, where.account_id), where.key_id, where.product, where.outcome,
                             where.since, where.until)  # fmt: skip
        return await self.reports.usage_rows(scoped, limit=limit, after=after)

    async def request(self, s: Session, request_id: str, account: str | None) -> UsageRecord:
        """A request's usage record, or a refusal kept (:meth:`refusals`)."""
        owner = self.scope(s, account)
        rec = None if owner is None else await self.admin.store.usage(owner, request_id)
        if rec is None:
            where = UsageFilter(account_id=account)
            rec = next(iter(await self.refusals(s, where, 1, lambda r: r.request_id == request_id)), None)
        if rec is None:
            raise GatewayError(404, "not_found", f"No usage record '{request_id}' here.")
        return rec

    async def refusals(
        self, s: Session, where: UsageFilter, limit: int, also: Callable[[UsageRecord], bool] | None = None
    ) -> list[UsageRecord]:
        """The requests refused before the book (newest first; this process's and, with
        replicas, every replica's: :class:`~bourse.services.request_feed.RequestFeed`) that the session may
        see and ``where`` takes: none when it asks for another outcome."""
        if where.outcome not in (None, REFUSED):
            return []
        account = self.scope(s, where.account_id)

        def match(r: UsageRecord) -> bool:
            return (
                (account is None or r.account_id == account)
                and (where.key_id is None or r.record.get("key_id") == where.key_id)
                and (where.product is None or r.product == where.product)
                and (where.since is None or r.created_at >= where.since)
                and (where.until is None or r.created_at <= where.until)
                and (also is None or also(r))
            )

        return await self.feed.refusals(match, limit)

    # -- jobs -----------------------------------------------------------------------

    async def job_list(self, s: Session, status: JobStatus | None) -> list[dict[str, Any]]:
        out = []
        for job in await self.reports.jobs(self.scope(s), status, MAX_LIST):
            view = await self.jobs.view(job)
            view["account"] = job.account_id
            out.append(view)
        return out

    async def cancel_job(self, s: Session, job_id: str) -> dict[str, Any]:
        job = await self.jobs.store.job(job_id, self.scope(s))
        if job is None:
            raise GatewayError(404, "not_found", f"No job '{job_id}' here.")
        out = await self.jobs.cancel(job_id, job.account_id)
        if s.operator:
            await self.admin.audit.record(
                self._actor(s), "job.cancel", job_id, {"account": job.account_id, "status": out["status"]}
            )
        return out
