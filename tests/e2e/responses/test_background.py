"""Background responses (``background: true``) run as detached jobs: created at once
``queued``, read ``queued`` → ``in_progress`` → ``completed`` with
``responses.retrieve``; ``responses.cancel`` removes a queued one (never charged) and
cancels a running one (its generated tokens charged by the policy)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.jobs.support import Jobs, slot_held, unique
from tests.e2e.money.support import As, assert_ledger_balanced, new_caller
from tests.e2e.responses.support import PRODUCTS, SERVER, WAIT_S, Caller
from tests.support.env import Env, start_env


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with start_env("sim", PRODUCTS, server=SERVER) as e:
        yield e


def _caller(env: Env, prefix: str) -> tuple[Caller, As]:
    money = new_caller(env.gateway, unique(prefix), 10.0)
    return Caller(env.url, money.key, money.account), money


def test_background_create_then_retrieve_until_completed(env: Env) -> None:
    me, money = _caller(env, "bg")
    client = env.client(api_key=me.key)
    created = client.responses.create(model="fast", input="Tell me about rivers.", background=True)
    assert created.status == "queued" and created.background is True and created.output == [], created
    final = created
    deadline = time.monotonic() + WAIT_S
    while final.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, final
        time.sleep(0.02)
        final = client.responses.retrieve(created.id)
    assert final.status == "completed" and final.output_text, final
    assert final.usage is not None and final.usage.output_tokens == 6
    usage: dict[str, Any] = final.model_dump()["usage"]
    assert (
        usage["cost_micros"] > 0 and money.usage(created.id)["usage"]["cost_micros"] == usage["cost_micros"]
    )
    chained = client.responses.create(model="fast", input="And then?", previous_response_id=created.id)
    assert chained.status == "completed" and chained.usage is not None
    assert chained.usage.input_tokens > final.usage.input_tokens


def test_a_background_response_goes_queued_in_progress_completed(env: Env) -> None:
    me, _ = _caller(env, "states")
    with slot_held(env.gateway, "one") as blocker:
        created = me.create(
            {
                "model": "one",
                "input": "Hi",
                "background": True,
                "sim": {"tokens_per_s": 20, "output_tokens": 20},
            }
        )
        assert created["status"] == me.retrieve(created["id"])["status"] == "queued"
        blocker.response.close()  # the slot frees: the job is admitted and runs for about 1 s
        running, seen = me.wait(created["id"], lambda d: d["status"] != "queued")
    done, more = me.wait_final(created["id"])
    assert running["status"] == "in_progress", seen
    assert [*seen, *more[1:]] == ["in_progress", "completed"], (seen, more)
    assert done["output"][0]["type"] == "message" and done["output"][0]["status"] == "completed"


def test_cancel_a_queued_background_response_charges_nothing(env: Env) -> None:
    me, money = _caller(env, "cq")
    before = money.balance()
    with slot_held(env.gateway, "one"):
        started = env.stats("one-a")["started"]
        created = me.create({"model": "one", "input": "Hi", "background": True})
        assert money.account_view()["open_holds_micros"] > 0
        out = me.cancel(created["id"])
        assert out["status"] == "cancelled" and out["id"] == created["id"], out
        assert me.retrieve(created["id"])["status"] == "cancelled"
    assert money.wait_settled() == []
    assert money.balance() == before and money.account_view()["spent_micros"] == 0
    assert env.stats("one-a")["started"] == started  # it never ran
    assert me.cancel(created["id"])["status"] == "cancelled"  # an ended one comes back unchanged
    assert_ledger_balanced(env.gateway)


def test_cancel_a_running_background_response_charges_its_generated_tokens(env: Env) -> None:
    me, money = _caller(env, "cr")
    jobs = Jobs(env.url, me.key, me.account)
    before = env.stats("slow-a")
    created = me.create({"model": "slow", "input": "Talk for a while.", "background": True})
    job = jobs.list()["data"][0]
    assert job["request_id"] == created["id"], job
    jobs.wait(job["id"], lambda j: j.get("progress", {}).get("tokens", 0) >= 3, what="3 tokens")
    assert me.retrieve(created["id"])["status"] == "in_progress"
    out = me.cancel(created["id"])
    assert out["status"] == "cancelled", out
    stats, _ = env.wait_stats("slow-a", lambda s: s["cancelled"] > before["cancelled"], timeout=1.0)
    assert stats["cancelled"] == before["cancelled"] + 1 and stats["completed"] == before["completed"], stats
    assert money.wait_settled() == []
    record = money.usage(created["id"])
    generated = record["usage"]["completion_tokens"]
    assert 3 <= generated < 60 and record["usage"]["cost_micros"] > 0, record
    assert out["usage"]["output_tokens"] == generated and out["output"][0]["status"] == "incomplete", out
    money.assert_books()


def test_a_background_response_is_the_accounts_own(env: Env) -> None:
    me, _ = _caller(env, "bg-own")
    other, _ = _caller(env, "bg-other")
    created = me.create({"model": "fast", "input": "Hi", "background": True})
    r = other.get_raw(f"/v1/responses/{created['id']}")
    assert r.status_code == 404, r.text
    denied = other.create_raw({"model": "fast", "input": "x"})  # the other account works
    assert denied.status_code == 200
    cancel = httpx.post(env.url + f"/v1/responses/{created['id']}/cancel", headers=other.auth, timeout=30)
    assert cancel.status_code == 404, cancel.text
    me.wait_final(created["id"])


def test_cancelling_a_response_that_is_not_in_the_background_is_a_400(env: Env) -> None:
    me, _ = _caller(env, "sync")
    done = me.create({"model": "fast", "input": "Hi"})
    r = httpx.post(env.url + f"/v1/responses/{done['id']}/cancel", headers=me.auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_a_background_stream_is_resumed_after_a_disconnect(env: Env) -> None:
    me, _ = _caller(env, "resume")
    client = env.client(api_key=me.key)
    stream = client.responses.create(
        model="slow", input="Talk.", background=True, stream=True,
        extra_body={"sim": {"tokens_per_s": 20, "output_tokens": 20}},
    )  # fmt: skip
    first: list[Any] = []
    for event in stream:
        first.append(event)
        if sum(e.type == "response.output_text.delta" for e in first) == 3:
            break
    stream.close()  # the client leaves; the background response runs on
    assert [e.type for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    created = first[0].response
    assert created.status == "queued" and created.background is True
    last = first[-1].sequence_number
    rest = list(client.responses.retrieve(created.id, stream=True, starting_after=last))
    assert rest[0].sequence_number == last + 1, rest[0]
    numbers = [e.sequence_number for e in [*first, *rest]]
    assert numbers == list(range(len(numbers))), numbers
    assert rest[-1].type == "response.completed", [e.type for e in rest]
    text = "".join(e.delta for e in [*first, *rest] if e.type == "response.output_text.delta")
    final = client.responses.retrieve(created.id)
    assert final.status == "completed" and final.output_text == text and len(text.split()) == 20
    assert final.output[0].id == rest[-1].response.output[0].id  # the stream's items are the stored ones
    again = list(client.responses.retrieve(created.id, stream=True, starting_after=last + 4))
    assert [e.sequence_number for e in again] == numbers[last + 5 :]  # read again, after its end
    not_streamed = me.create({"model": "fast", "input": "Hi", "background": True})
    r = me.get_raw(f"/v1/responses/{not_streamed['id']}", stream="true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
