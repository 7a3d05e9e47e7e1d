"""Real third-party engines, one each for the whole session (they take seconds to load
the model): llama-cpp-python's server with its defaults (``n_ctx`` 2048,
``interrupt_requests`` on), and llama.cpp's ``llama-server`` (``n_ctx`` 2048, one slot,
``--metrics``; skipped outside CI when its binary is not built, see
``tests.support.real_engines.llama_server_binary``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import real_engines
from tests.support.real_engines import RealEngine, llama_cpp_python_server


@pytest.fixture(scope="session")
def llama_cpp_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    with llama_cpp_python_server(tmp_path_factory.mktemp("llama-cpp-python")) as engine:
        yield engine


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealEngine]:
    """llama.cpp's ``llama-server``. (A test module that also wants the context manager
    of the same name imports it as ``real_engines.llama_server``.)"""
    with real_engines.llama_server(tmp_path_factory.mktemp("llama-server")) as engine:
        yield engine
