"""The flavour rules (:mod:`bourse.engines.flavors`) without a server: detection from
what each kind of server answers, the request id each accepts, capacity reading."""

from __future__ import annotations

import uuid

import pytest

from bourse.engines import flavors

ROOT = "http://h:1"


def fake(answers: dict[str, tuple[int, bytes]], *, unreachable: bool = False) -> flavors.Fetch:
    """A fetch that answers ``answers[url]`` (404 for anything else)."""

    async def fetch(method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        if unreachable:
            raise ConnectionRefusedError(url)
        return answers.get(url, (404, b'{"detail":"Not Found"}'))

    return fetch


LLAMA_SERVER = {
    ROOT + "/props": (200, b'{"total_slots": 3, "default_generation_settings": {"n_ctx": 4096}}'),
    ROOT + "/metrics": (200, b"# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 2\n"),
}
LLAMA_CPP_PYTHON = {ROOT + "/extras/tokenize": (200, b'{"tokens": [2, 9259]}')}
VLLM = {
    ROOT + "/metrics": (
        200,
        b'vllm:num_requests_waiting{model_name="m"} 5.0\nvllm:num_requests_waiting_total 99\n',
    )
}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answers", "flavor"),
    [(LLAMA_SERVER, "llama.cpp"), (LLAMA_CPP_PYTHON, "llama-cpp-python"), (VLLM, "vllm"), ({}, "openai")],
)
async def test_detect(answers: dict[str, tuple[int, bytes]], flavor: str) -> None:
    assert await flavors.detect(fake(answers), ROOT) == flavor


@pytest.mark.anyio
async def test_detect_an_unreachable_server_raises_after_one_call() -> None:
    with pytest.raises(ConnectionRefusedError):
        await flavors.detect(fake({}, unreachable=True), ROOT)


@pytest.mark.anyio
async def test_props_without_total_slots_is_not_llama_server() -> None:
    assert await flavors.detect(fake({ROOT + "/props": (200, b'{"x": 1}')}), ROOT) == "openai"


def test_root_of() -> None:
    assert flavors.root_of("http://h:1/v1") == ROOT
    assert flavors.root_of("http://h:1/v1/") == ROOT
    assert flavors.root_of("http://h:1") == ROOT
    assert flavors.root_of("http://h:1/api/v1") == ROOT + "/api"


def test_llama_cpp_python_gets_a_uuid_that_still_shows_the_request_id() -> None:
    rid = "chatcmpl-0123456789abcdef01234567"
    sent = flavors.request_id_header("llama-cpp-python", rid)
    assert str(uuid.UUID(sent)) == sent  # what its middleware accepts
    assert sent.replace("-", "").endswith("0123456789abcdef01234567")
    odd = flavors.request_id_header("llama-cpp-python", "client-id-not-hex!")
    assert uuid.UUID(odd) and odd == flavors.request_id_header("llama-cpp-python", "client-id-not-hex!")


@pytest.mark.parametrize("flavor", ["vllm", "llama.cpp", "openai", "auto"])
def test_other_flavours_get_our_request_id(flavor: str) -> None:
    assert flavors.request_id_header(flavor, "chatcmpl-ab") == "chatcmpl-ab"


def test_metric_sum_adds_label_sets_and_ignores_longer_names() -> None:
    text = 'a{x="1"} 2\na{x="2"} 3.5\na_total 100\n# HELP a doc\n'
    assert flavors.metric_sum(text, "a") == 5.5
    assert flavors.metric_sum(text, "b") is None


@pytest.mark.anyio
async def test_capacity_per_flavour() -> None:
    cap = await flavors.read_capacity(fake(LLAMA_SERVER), ROOT, "llama.cpp")
    assert (cap.slots, cap.waiting, cap.context_length) == (3, 2, 4096)
    cap = await flavors.read_capacity(fake({}), ROOT, "llama-cpp-python")
    assert cap.slots == 1
    cap = await flavors.read_capacity(fake(VLLM), ROOT, "vllm")
    assert (cap.slots, cap.waiting) == (None, 5)
    cap = await flavors.read_capacity(fake({}), ROOT, "openai")
    assert (cap.slots, cap.waiting) == (None, None)
    # llama-server without --metrics: slots, no waiting count
    cap = await flavors.read_capacity(
        fake({ROOT + "/props": LLAMA_SERVER[ROOT + "/props"]}), ROOT, "llama.cpp"
    )
    assert (cap.slots, cap.waiting) == (3, None)


def test_served_models() -> None:
    assert flavors.served_models({"data": [{"id": "a"}, {"id": "b"}]}) == ["a", "b"]
    assert flavors.served_models({"models": [{"model": "m.gguf", "name": "n"}], "data": []}) == [
        "m.gguf",
        "n",
    ]
    assert flavors.served_models([1, 2]) == []
    assert flavors.context_of({"data": [{"id": "a", "max_model_len": 2048}]}, "a") == 2048
    assert flavors.context_of({"data": [{"id": "a"}]}, "a") is None
