"""The ``openai`` engine in front of llama.cpp's own ``llama-server``: its flavour found
by probing (``GET /props``), ``slots`` from its ``total_slots`` (a configured ``slots``
above it capped, with a WARNING), and the engine seen queueing requests itself
(``llamacpp:requests_deferred`` on ``/metrics``) shrinking the effective slots.

The server is the binary ``scripts/build-llama-server`` caches (the llama.cpp that
llama-cpp-python vendors), started by ``tests.support.real_engines.llama_server``, here
with ``--parallel 2``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engines.test_failures_real import error_of
from tests.support import real_engines
from tests.support.gateway import Gateway, breaker_openings, running_gateway
from tests.support.real_engines import SERVED_MODEL
from tests.support.sse import collect_sse


@contextmanager
def llama_server(folder: Path, parallel: int) -> Iterator[str]:
    """llama-server (``tests.support.real_engines``) with ``parallel`` slots; its root URL."""
    with real_engines.llama_server(folder, parallel=parallel) as engine:
        yield engine.root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with llama_server(tmp_path_factory.mktemp("llama-server"), parallel=2) as root:
        yield root


def _market(gw: Gateway) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(f"{gw.v1}/market/ls", timeout=30).json()["deployments"][0]
    return doc


def test_flavour_slots_capped_and_a_request_served(server: str, caplog: pytest.LogCaptureFixture) -> None:
    config = f"""
[products.ls]
[[products.ls.deployments]]
engine = "openai"
name = "ls-main"
base_url = "{server}/v1"
model = "{SERVED_MODEL}"
slots = 4
"""
    with caplog.at_level(logging.WARNING, "bourse.probes"), running_gateway(config) as gw:
        dep = _market(gw)
        assert dep["flavor"] == "llama.cpp" and dep["slots"] == 2 and dep["available"], dep
        assert any(
            "slots = 4 is above" in r.getMessage() and "capped to 2" in r.getMessage() for r in caplog.records
        )
        r = httpx.post(
            f"{gw.v1}/chat/completions", headers=gw.headers, timeout=120,
            json={"model": "ls", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4},
        )  # fmt: skip
        assert r.status_code == 200, r.text


def test_an_engine_queueing_behind_the_book_shrinks_the_effective_slots(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = f"""
[products.ls]
[[products.ls.deployments]]
engine = "openai"
name = "ls-main"
base_url = "{server}/v1"
model = "{SERVED_MODEL}"
probe_interval_s = 0.5
"""
    with caplog.at_level(logging.WARNING, "bourse.probes"), running_gateway(config) as gw:
        assert _market(gw)["slots"] == 2  # its total_slots
        # other clients of the same server, behind bourse's back: two run, two wait there
        body = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
        direct = [
            threading.Thread(
                target=httpx.post, args=(f"{server}/v1/completions",), kwargs={"json": body, "timeout": 300}
            )
            for _ in range(4)
        ]
        for t in direct:
            t.start()
        deadline = time.monotonic() + 60
        while _market(gw)["slots"] == 2:
            assert time.monotonic() < deadline, "the effective slots never shrank"
            time.sleep(0.1)
        assert _market(gw)["slots"] == 1
        assert any("its engine queues" in r.getMessage() for r in caplog.records)
        for t in direct:
            t.join(timeout=300)
        deadline = time.monotonic() + 30
        while _market(gw)["slots"] != 2:  # nothing queued there: given back, one a probe
            assert time.monotonic() < deadline, "the slots never came back"
            time.sleep(0.1)


def _post(gw: Gateway, body: dict[str, Any], done: dict[str, float], name: str) -> None:
    r = httpx.post(f"{gw.v1}/completions", json=body, headers=gw.headers, timeout=300)
    assert r.status_code == 200, r.text
    done[name] = time.monotonic()


def test_the_highest_bidder_that_arrived_last_is_admitted_next_on_a_one_slot_server(
    tmp_path: Path,
) -> None:
    """Defect 5 against llama-server ``--parallel 1`` (which takes bourse's request id):
    with ``slots`` 4 (the old default) the orders went to the engine at once and waited
    there by arrival, so the 5x bidder that came last was served last."""
    with llama_server(tmp_path, parallel=1) as root:
        config = f"""
[server]
book_timeout_s = 300
[products.ls]
[[products.ls.deployments]]
engine = "openai"
name = "ls-main"
base_url = "{root}/v1"
model = "{SERVED_MODEL}"
"""
        with running_gateway(config) as gw:
            base = {"model": "ls", "prompt": "Once upon a time", "ignore_eos": True}
            done: dict[str, float] = {}
            # A must outlast the four arrivals (0.6 s): with 32 tokens the C++ server
            # finished it first in a fresh-clone CI run, and B, alone in the book, went next
            first = threading.Thread(
                target=_post, args=(gw, {**base, "max_tokens": 256, "max_price": 1.0}, done, "a")
            )
            first.start()
            deadline = time.monotonic() + 60
            while httpx.get(f"{gw.v1}/market/ls", timeout=30).json()["slots"]["busy"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            threads = [first]
            for k, (name, bid) in enumerate((("b", 1.0), ("c", 1.0), ("d", 1.0), ("e", 5.0)), start=1):
                t = threading.Thread(
                    target=_post, args=(gw, {**base, "max_tokens": 2, "max_price": bid}, done, name)
                )
                t.start()
                threads.append(t)
                # arrivals in this order: each one in the book before the next is sent
                while httpx.get(f"{gw.v1}/market/ls", timeout=30).json()["waiting"] < k:
                    assert time.monotonic() < deadline + 30 and "a" not in done, done
                    time.sleep(0.02)
            waiting = httpx.get(f"{gw.v1}/market/ls", timeout=30).json()["waiting"]
            assert waiting == 4 and "a" not in done, (waiting, done)  # all four wait behind A
            for t in threads:
                t.join(timeout=300)
            assert set(done) == {"a", "b", "c", "d", "e"}, done
            order = sorted(done, key=done.__getitem__)
            assert order[:2] == ["a", "e"], order


def test_a_prompt_over_a_slots_context_is_the_clients_400_logged_and_opens_no_breaker(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt that passes bourse's byte pre-check against the slot's context it reads
    from the probe (3,200 bytes / 8 = 400 tokens, under 2,048 / 2 = 1,024) but is ~1,600
    tokens, which llama-server refuses: ``400 exceed_context_size_error``, streamed or not. The client gets 400 / an in-band ``context_length_exceeded``, the breaker
    (threshold 1) never opens, and the refusal is a WARNING with the engine's status and
    body."""
    config = f"""
[products.ls]
[[products.ls.deployments]]
engine = "openai"
name = "ls-main"
base_url = "{server}/v1"
model = "{SERVED_MODEL}"
breaker_threshold = 1
cooldown_s = 60
"""
    prompt = "a " * 1600
    with caplog.at_level(logging.INFO, "bourse.events"), running_gateway(config) as gw:
        assert _market(gw)["available"]
        body = {"model": "ls", "messages": [{"role": "user", "content": prompt}]}
        r = httpx.post(f"{gw.v1}/chat/completions", headers=gw.headers, json=body, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.headers["x-should-retry"] == "false"
        assert "exceeds the available context size" in r.json()["error"]["message"], r.text
        streamed = collect_sse(gw, {**body, "stream": True})
        if streamed.status == 200:
            assert error_of(streamed)["code"] == "context_length_exceeded", streamed.chunks
            assert not any(c.get("choices") for c in streamed.chunks)
        else:
            assert streamed.status == 400, streamed
        assert breaker_openings(gw) == 0
        assert _market(gw)["available"]
        ok = httpx.post(
            f"{gw.v1}/completions", headers=gw.headers, timeout=120,
            json={"model": "ls", "prompt": "Once upon a time", "max_tokens": 4},
        )  # fmt: skip
        assert ok.status_code == 200, ok.text
        assert breaker_openings(gw) == 0
    refusals = [
        r for r in caplog.records
        if r.name == "bourse.events" and "upstream failure on deployment ls-main (refused)" in r.getMessage()
    ]  # fmt: skip
    assert len(refusals) == 2, [r.getMessage() for r in caplog.records]
    for record in refusals:
        line = record.getMessage()
        assert record.levelno == logging.WARNING, line
        assert "the engine answered HTTP 400, body b'" in line and "exceed_context_size_error" in line, line
        assert len(line) < 1000, line  # the body bounded
