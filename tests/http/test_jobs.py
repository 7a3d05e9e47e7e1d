"""Detached jobs (SPEC section 9) from the app in process: submit (202), the job's
states and result, a failure, cancelling a queued job (nothing charged) and a running
one (the generated tokens charged), the submit errors and the paged list. Webhooks
need a receiver on a socket: they are tested end to end."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

FINAL = ("succeeded", "failed", "canceled", "expired")
SLOW = {"output_tokens": 400, "tokens_per_s": 50}
"""A job that runs for 8 s unless cancelled."""


@dataclass
class Caller:
    """One funded account of the in-process gateway, calling with its own key."""

    gw: InProcessGateway
    account: str
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    async def submit(self, body: dict[str, Any], endpoint: str = "/v1/chat/completions") -> dict[str, Any]:
        r = await self.gw.post("/v1/jobs", {"endpoint": endpoint, "body": body}, headers=self.auth)
        assert r.status_code == 202, r.text
        job: dict[str, Any] = r.json()
        assert r.headers["x-request-id"] == job["request_id"]
        return job

    async def job(self, job_id: str) -> dict[str, Any]:
        r = await self.gw.get(f"/v1/jobs/{job_id}", headers=self.auth)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def wait(self, job_id: str, *statuses: str) -> dict[str, Any]:
        async def reached() -> dict[str, Any] | None:
            job = await self.job(job_id)
            return job if job["status"] in statuses else None

        return await await_until(reached, what=f"job {job_id} in {statuses}")

    async def cancel(self, job_id: str) -> dict[str, Any]:
        r = await self.gw.post(f"/v1/jobs/{job_id}/cancel", headers=self.auth)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def balance(self) -> int:
        return await self.gw.balance(self.account)

    async def usage(self, request_id: str) -> dict[str, Any]:
        r = await self.gw.get(f"/v1/usage/{request_id}", headers=self.auth)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


@pytest.fixture
async def me(gw: InProcessGateway) -> Caller:
    """A new account with 1 USD of credit."""
    account = "jobs-" + os.urandom(4).hex()
    return Caller(gw, account, await gw.new_account(account, 1.0))


def _chat(model: str = "default", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": USER, "seed": 3, "max_tokens": 50, **extra}


async def test_a_job_runs_to_its_result_and_is_charged_once(me: Caller) -> None:
    before = await me.balance()
    job = await me.submit(_chat(sim={"output_tokens": 12}))
    assert job["id"].startswith("job_") and job["object"] == "bourse.job"
    assert (job["status"], job["endpoint"], job["model"]) == ("queued", "/v1/chat/completions", "default")
    done = await me.wait(job["id"], *FINAL)
    assert done["status"] == "succeeded", done
    result = done["result"]
    assert (result["id"], result["object"], result["model"]) == (
        job["request_id"],
        "chat.completion",
        "default",
    )
    assert result["choices"][0]["message"]["content"]
    assert result["usage"]["completion_tokens"] == 12
    assert result["receipt"]["outcome"] == "completed"
    cost = result["usage"]["cost_micros"]
    assert cost == result["usage"]["total_tokens"] > 0  # one micro-USD per token
    assert done["started_at"] <= done["finished_at"]
    assert (await me.usage(job["request_id"]))["usage"]["cost_micros"] == cost
    assert before - await me.balance() == cost


async def test_detached_on_the_endpoint_is_a_job(me: Caller) -> None:
    r = await me.gw.post(
        "/v1/completions",
        {"model": "default", "prompt": "Once", "max_tokens": 5, "detached": True},
        headers=me.auth,
    )
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["endpoint"] == "/v1/completions"
    done = await me.wait(job["id"], *FINAL)
    assert done["status"] == "succeeded", done
    assert done["result"]["object"] == "text_completion" and done["result"]["choices"][0]["text"]


async def test_a_job_whose_engine_fails_is_failed_with_the_envelope(me: Caller) -> None:
    job = await me.submit(_chat(sim={"fail_after_tokens": 2, "output_tokens": 10}))
    done = await me.wait(job["id"], *FINAL)
    assert done["status"] == "failed", done
    assert done["error"]["status"] == 502
    assert done["error"]["error"]["code"] == "upstream_error"
    assert "result" not in done


async def test_cancel_a_queued_job_charges_nothing_and_a_running_one_the_generated_tokens(me: Caller) -> None:
    before = await me.balance()
    running = await me.submit(_chat("single", max_tokens=400, sim=SLOW))
    await await_until(lambda: _has_tokens(me, running["id"]), what="the first job running with output")
    queued = await me.submit(_chat("single"))
    view = await me.job(queued["id"])
    assert view["status"] == "queued" and view["queue"]["position"] == 0, view

    out = await me.cancel(queued["id"])
    assert out["status"] == "canceled", out
    assert out["result"]["usage"]["completion_tokens"] == out["result"]["usage"]["cost_micros"] == 0, out
    out = await me.cancel(running["id"])
    assert out["status"] == "canceled", out
    tokens = out["result"]["usage"]["completion_tokens"]
    assert 0 < tokens < 400, out
    charged = out["result"]["usage"]["cost_micros"]
    assert charged == out["result"]["usage"]["total_tokens"]
    assert (await me.usage(queued["request_id"]))["usage"]["cost_micros"] == 0
    assert before - await me.balance() == charged
    # a finished job stays as it is
    assert (await me.cancel(running["id"]))["status"] == "canceled"


async def _has_tokens(me: Caller, job_id: str) -> bool:
    job = await me.job(job_id)
    return bool(job["status"] == "running" and job["progress"]["tokens"] > 0)


async def test_jobs_are_listed_newest_first_in_pages(me: Caller) -> None:
    ids = [(await me.submit(_chat(sim={"output_tokens": 2})))["id"] for _ in range(3)]
    r = await me.gw.get("/v1/jobs?limit=2", headers=me.auth)
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["has_more"] is True and len(page["data"]) == 2
    r = await me.gw.get(f"/v1/jobs?limit=2&after={page['next_after']}", headers=me.auth)
    rest = r.json()
    assert rest["has_more"] is False
    assert [j["id"] for j in page["data"] + rest["data"]] == ids[::-1]


@pytest.mark.parametrize(
    ("doc", "status", "code"),
    [
        ({"endpoint": "/v1/embeddings", "body": {"model": "default"}}, 400, "invalid_request"),
        ({"endpoint": "/v1/chat/completions", "body": {"model": "default"}}, 400, "invalid_request"),
        (
            {"endpoint": "/v1/chat/completions", "body": {"model": "nope", "messages": USER}},
            404,
            "model_not_found",
        ),
        ({"body": {"model": "default", "messages": USER}}, 400, "invalid_request"),
        (
            {"endpoint": "/v1/chat/completions", "body": {"model": "default", "messages": USER}, "ttl_s": 0},
            400,
            "invalid_request",
        ),
    ],
    ids=["endpoint", "body", "model", "no-endpoint", "ttl"],
)
async def test_a_bad_submit_is_an_http_error(
    gw: InProcessGateway, doc: dict[str, Any], status: int, code: str
) -> None:
    assert_error_envelope(await gw.post("/v1/jobs", doc), status, code)


async def test_a_job_the_balance_cannot_hold_is_402_at_submit(gw: InProcessGateway) -> None:
    poor = await gw.new_account("poor-jobs-" + os.urandom(4).hex(), 0.0001)
    r = await gw.post(
        "/v1/jobs",
        {"endpoint": "/v1/chat/completions", "body": _chat(max_tokens=1000)},
        headers={"authorization": f"Bearer {poor}"},
    )
    assert_error_envelope(r, 402, "insufficient_funds")


async def test_another_accounts_job_is_not_found(gw: InProcessGateway, me: Caller) -> None:
    job = await me.submit(_chat(sim={"output_tokens": 2}))
    assert_error_envelope(await gw.get(f"/v1/jobs/{job['id']}"), 404, "not_found")
    assert_error_envelope(await gw.post(f"/v1/jobs/{job['id']}/cancel"), 404, "not_found")
