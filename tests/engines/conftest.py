"""Real third-party engines, one each for the whole session (they take seconds to load
the model): llama-cpp-python's server with its defaults (``n_ctx`` 2048,
``interrupt_requests`` on)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.real_engines import RealEngine, llama_cpp_python_server


@pytest.fixture(scope="session")
def llama_cpp_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    with llama_cpp_python_server(tmp_path_factory.mktemp("llama-cpp-python")) as engine:
        yield engine
