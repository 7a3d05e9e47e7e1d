"""``GET /v1/models`` and ``GET /v1/models/{model}`` through the served gateway and the
official openai SDK: each product's context length on its model object, one model
answered by id (ids with a ``/`` too, as Hugging Face names are), an unknown id a 404
``model_not_found`` envelope, an id that is no id a 400, never a 500; and a product whose
only deployment is an ``openai`` upstream that is down still listed and answered (the
model list is the gateway's configuration, not the engines')."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import openai
import pytest

from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

SLASHED = "google/gemma-3-sim"
"""A product named as a Hugging Face model is: with a ``/`` in it."""


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with socket.socket() as dead:  # bound, never listening: the upstream is down
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        config = f"""
[products.sim-fast]
context_length = 4096
[[products.sim-fast.deployments]]
engine = "sim"
floor = 0.05

[products."{SLASHED}"]
context_length = 2048
[[products."{SLASHED}".deployments]]
engine = "sim"

[products.remote-dead]
context_length = 32768
[[products.remote-dead.deployments]]
engine = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "upstream-name"
"""
        with running_gateway(config) as g:
            yield g


def _get(gw: Gateway, path: str, **kw: object) -> httpx.Response:
    return httpx.get(gw.v1 + path, timeout=30, **kw)  # type: ignore[arg-type]


def test_the_list_carries_each_products_context_length(gw: Gateway) -> None:
    models = {m.id: m for m in gw.client().models.list()}
    assert set(models) == {"sim-fast", SLASHED, "remote-dead"}
    lengths = {name: (m.model_extra or {}).get("context_length") for name, m in models.items()}
    assert lengths == {"sim-fast": 4096, SLASHED: 2048, "remote-dead": 32768}
    assert all(m.object == "model" and m.owned_by == "bourse" for m in models.values())


def test_retrieve_answers_the_one_model_object_as_the_list_has_it(gw: Gateway) -> None:
    listed = {m["id"]: m for m in _get(gw, "/models").json()["data"]}
    model = gw.client().models.retrieve("sim-fast")
    assert model.id == "sim-fast" and model.object == "model" and model.owned_by == "bourse"
    assert (model.model_extra or {})["context_length"] == 4096
    assert model.model_dump(exclude_unset=True) == listed["sim-fast"]


def test_retrieve_needs_no_key_as_the_list_does(gw: Gateway) -> None:
    r = _get(gw, "/models/sim-fast")
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "sim-fast"
    assert r.headers.get("x-request-id")


@pytest.mark.parametrize("raw", [False, True], ids=["encoded", "raw"])
def test_an_id_with_a_slash_is_answered_encoded_or_not(gw: Gateway, raw: bool) -> None:
    """The SDK percent-encodes the ``/`` (``%2F``); curl and older clients send it as is."""
    path = SLASHED if raw else quote(SLASHED, safe="")
    r = _get(gw, "/models/" + path)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == SLASHED and r.json()["context_length"] == 2048
    assert gw.client().models.retrieve(SLASHED).id == SLASHED


def test_a_product_on_a_dead_openai_upstream_is_still_answered(gw: Gateway) -> None:
    r = _get(gw, "/models/remote-dead")
    assert r.status_code == 200, r.text
    assert r.json()["context_length"] == 32768
    assert "upstream-name" not in r.text and "127.0.0.1" not in r.text


def test_an_unknown_id_raises_not_found_in_the_sdk(gw: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        gw.client().models.retrieve("no-such-model")
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize(
    "path",
    ["no-such-model", "google/no-such", "sim-fast/", "sim-fast%2Fx", "%E2%98%83", "a%20b", "upstream-name"],
)
def test_an_unknown_id_is_a_404_model_not_found_envelope(gw: Gateway, path: str) -> None:
    assert_error_envelope(_get(gw, "/models/" + path), 404, "model_not_found")


@pytest.mark.parametrize("path", ["x" * 257, "a%00b", "a%09b", "%7F"])
def test_an_id_that_is_no_id_is_a_400_naming_the_model(gw: Gateway, path: str) -> None:
    """Over 256 characters, or with a control character: refused before any look-up."""
    err = assert_error_envelope(_get(gw, "/models/" + path), 400, "invalid_request")
    assert err["param"] == "model"


def test_a_newline_in_the_id_is_a_404_envelope(gw: Gateway) -> None:
    """Starlette's ``path`` convertor (``.*``) stops at a newline: no route matches, and
    the gateway's own 404 for an unknown route answers, still an envelope."""
    assert_error_envelope(_get(gw, "/models/a%0Ab"), 404, "not_found")


def test_a_long_id_within_the_bound_is_just_unknown(gw: Gateway) -> None:
    assert_error_envelope(_get(gw, "/models/" + "x" * 256), 404, "model_not_found")
