"""Routes for detached jobs: POST /v1/jobs, GET /v1/jobs, GET /v1/jobs/{id}, POST /v1/jobs/{id}/cancel."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.http import idempotency
from bourse.http.deps import Services, page_limit, parse_model, read_body
from bourse.http.responses import JSON
from bourse.wire.requests import check_id, optional_id


class NewJob(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    endpoint: str
    body: dict[str, Any]
    webhook_url: str | None = Field(default=None, max_length=2048)
    ttl_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


def routes(services: Services) -> list[Route]:
    auth = services.auth
    jobs = services.jobs

    async def submit(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        raw = await read_body(request, services.max_body_bytes)
        body = parse_model(raw, NewJob, services.max_json_depth)
        key = idempotency.scoped(p, request.headers.get("idempotency-key"))
        replay = await idempotency.begin(services, p.account_id, key, "job", raw)
        if replay is not None:
            return replay
        try:
            job = await jobs.submit(
                p, body.endpoint, body.body, webhook_url=body.webhook_url, ttl_s=body.ttl_s,
                max_price_header=request.headers.get("x-max-price"),
                timeout_header=request.headers.get("x-book-timeout"),
                deadline_header=request.headers.get("x-deadline-s"),
            )  # fmt: skip
        except BaseException:
            await idempotency.forget(services, p.account_id, key)
            raise
        return await idempotency.keep(
            services, p.account_id, key, JSON(job, status_code=202, request_id=job["request_id"])
        )

    async def get(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        return JSON(await jobs.get(check_id(request.path_params["job_id"], "job_id"), p.account_id))

    async def list_jobs(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        limit = page_limit(request)
        after = optional_id(request.query_params.get("after"), "after")
        return JSON(await jobs.list(p.account_id, limit, after))

    async def cancel(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        return JSON(await jobs.cancel(check_id(request.path_params["job_id"], "job_id"), p.account_id))

    return [
        Route("/v1/jobs", submit, methods=["POST"]),
        Route("/v1/jobs", list_jobs, methods=["GET"]),
        Route("/v1/jobs/{job_id}", get, methods=["GET"]),
        Route("/v1/jobs/{job_id}/cancel", cancel, methods=["POST"]),
    ]
