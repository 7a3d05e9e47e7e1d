"""What OpenAI clients rely on beyond the frames: one ``created`` per response, the
reasoning tokens in the usage details, ``x-should-retry`` on every error status (and
``false`` on a 408 ``book_timeout``, which the SDKs would otherwise resubmit), and the
``openai`` and ``sim`` engines agreeing on a non-streamed answer that fails upstream,
without making the next request wait on a breaker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.money.support import new_caller, read_until
from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import ENGINE_KINDS, Env, start_env
from tests.support.sse import collect_sse, open_sse

SLOW = {"tokens_per_s": 20, "output_tokens": 400}
HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
REASONING_TOKENS = 6  # bourse.engines.sim.REASONING_TOKENS


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    products = [
        Product("p", [Dep("p-a", slots=4, floor=1.0)]),
        Product("one", [Dep("one-a", slots=1)]),
        # the default breaker (3 failures, 5 s cooldown)
        Product("late", [Dep("late-a", slots=2)]),
    ]
    with start_env(request.param, products, server={"quiet_interval_s": 0.2}) as e:
        yield e


@contextmanager
def _one_held(env: Env) -> Iterator[None]:
    """Product ``one``'s only slot busy with a slow stream until the ``with`` ends."""
    with open_sse(env, {"model": "one", "sim": SLOW}) as s:
        read_until(s, data_chunks=1)
        yield


# -- 13. one created per response --------------------------------------------------------------


def test_one_created_per_response(env: Env) -> None:
    """The engine starts a second after the order arrived: every frame, the usage chunk
    included, still says the same ``created``."""
    body = {"model": "p", "seed": 3, "sim": {"ttft_ms": 1100, "output_tokens": 4},
            "stream_options": {"include_usage": True}}  # fmt: skip
    res = collect_sse(env, body)
    assert res.kinds()[-2:] == ["usage", "DONE"], res.kinds()
    assert len({c["created"] for c in res.chunks}) == 1, [c["created"] for c in res.chunks]


# -- 14. reasoning tokens -------------------------------------------------------------------------


def test_reasoning_tokens_are_in_the_usage_details(env: Env) -> None:
    body = {"model": "p", "seed": 3, "sim": {"reasoning": True, "output_tokens": 4},
            "stream_options": {"include_usage": True}}  # fmt: skip
    res = collect_sse(env, body)
    usage = res.chunks[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == REASONING_TOKENS, usage
    assert usage["completion_tokens"] == REASONING_TOKENS + 4, usage
    whole = env.client().chat.completions.create(
        model="p", messages=USER, seed=3, extra_body={"sim": {"reasoning": True, "output_tokens": 4}}
    )
    assert whole.usage is not None and whole.usage.completion_tokens_details is not None
    assert whole.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    plain = collect_sse(env, {"model": "p", "seed": 3, "stream_options": {"include_usage": True}})
    assert "completion_tokens_details" not in plain.chunks[-1]["usage"], plain.chunks[-1]


# -- 11. x-should-retry ---------------------------------------------------------------------------


def test_a_book_timeout_is_not_resubmitted_by_the_sdk(env: Env) -> None:
    me = new_caller(env.gateway, f"retry-{env.kind}", 10.0)
    client = openai.OpenAI(base_url=env.gateway.v1, api_key=me.key, timeout=30)  # default retries
    with _one_held(env), pytest.raises(openai.APIStatusError) as info:
        t0 = time.monotonic()
        try:
            client.chat.completions.create(model="one", messages=HI, extra_body={"timeout": 0.3})
        finally:
            took = time.monotonic() - t0
            client.close()
    assert info.value.status_code == 408
    assert info.value.response.headers["x-should-retry"] == "false"
    records = me.get("/v1/usage", params={"limit": "100"}).json()["data"]
    assert [r["outcome"] for r in records] == ["timeout"], records
    assert took < 2.0, took


def test_every_error_status_states_x_should_retry(env: Env) -> None:
    url, auth = env.url, env.auth
    poor = new_caller(env.gateway, f"poor-{env.kind}", 0.000001)
    limited = new_caller(env.gateway, f"rpm-{env.kind}", 10.0, rpm=1)
    chat = url + "/v1/chat/completions"
    ok = {"model": "p", "messages": USER, "max_tokens": 2}
    cases: list[tuple[int, str, httpx.Response]] = [
        (400, "false", httpx.post(chat, content=b"{", headers=auth)),
        (401, "false", httpx.post(chat, json=ok, headers={"authorization": "Bearer bk_nope"})),
        (402, "false", httpx.post(chat, json=ok, headers=poor.auth)),
        (404, "false", httpx.post(chat, json={**ok, "model": "nope"}, headers=auth)),
        (404, "false", httpx.get(url + "/v1/nowhere", headers=auth)),
        (405, "false", httpx.get(chat, headers=auth)),
        (413, "false", httpx.post(chat, content=b" " * (4 * 1024 * 1024 + 1), headers=auth)),
        (  # failed after output: sent again it would run (and may be charged) again
            502,
            "false",
            httpx.post(chat, json={**ok, "sim": {"fail_after_tokens": 1}}, headers=auth, timeout=30),
        ),
        (  # failed before any output, on every attempt: nothing ran to the end, a retry may pass
            502,
            "true",
            httpx.post(chat, json={**ok, "sim": {"fail_before_output": -1}}, headers=auth, timeout=30),
        ),
    ]
    first = httpx.post(chat, json=ok, headers=limited.auth, timeout=30)
    assert first.status_code == 200, first.text
    cases.append((429, "true", httpx.post(chat, json=ok, headers=limited.auth, timeout=30)))
    key = {"idempotency-key": f"k-{env.kind}"}
    assert httpx.post(chat, json=ok, headers={**auth, **key}, timeout=30).status_code == 200
    other = {**ok, "max_tokens": 3}
    cases.append((409, "false", httpx.post(chat, json=other, headers={**auth, **key}, timeout=30)))
    for status, retry, r in cases:
        assert r.status_code == status, (status, r.status_code, r.text[:200])
        assert r.headers.get("x-should-retry") == retry, (status, dict(r.headers))


# -- 12. the openai and sim engines agree on an upstream 502 --------------------------------------


def test_a_non_streamed_upstream_failure_is_answered_at_once_and_opens_no_breaker(env: Env) -> None:
    """The engine fails after some output of a non-streamed request (the ``openai``
    engine sees its upstream answer HTTP 502): one attempt, 502 at once, as the ``sim``
    engine does; the next ordinary request does not wait for a breaker to cool."""
    for _ in range(2):  # twice: a breaker that counted these would open (3 failures)
        started = env.stats("late-a")["started"]
        t0 = time.monotonic()
        r = env.post(
            "/v1/chat/completions", {"model": "late", "messages": USER, "sim": {"fail_after_tokens": 3}}
        )
        took = time.monotonic() - t0
        assert r.status_code == 502, r.text
        assert env.stats("late-a")["started"] - started == 1
        assert took < 2.0, took
    t0 = time.monotonic()
    r = env.post("/v1/chat/completions", {"model": "late", "messages": USER, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 2.0
