"""The shipped ``gemma-3-270m`` product (default.toml as it ships) answers chat requests
sensibly through a served gateway: the 30 questions of prompts.json, asked as
bench/llama_eval.py asks them (greedy, 32 tokens), mostly answered right, and no answer
echoes its question back (through the ``gemma`` chat template this base model repeats
the question in a loop: 2 of 30, both by accident)."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator

import pytest
from bench.llama_eval import Answer, evaluate, shipped_config

from bourse.settings import parse_config
from tests.support.gateway import running_gateway

AT_LEAST = 19
"""Measured: 22 of 30 (bench.llama_eval, 2 threads); the margin allows for llama.cpp
builds whose arithmetic differs in the last bits."""


@pytest.fixture(scope="module")
def answers() -> Iterator[list[Answer]]:
    with running_gateway(shipped_config(None, threads=2)) as gw:
        yield evaluate(gw.v1, gw.api_key)


def test_the_shipped_product_uses_the_base_model_format() -> None:
    config = parse_config(tomllib.loads(shipped_config(None, threads=2)), "<default.toml>", env={})
    (deployment,) = config.products["gemma-3-270m"].deployments
    assert (deployment.engine, deployment.model_path, deployment.chat_format) == ("llamacpp", None, "base")


def test_most_questions_are_answered_right(answers: list[Answer]) -> None:
    right = [a for a in answers if a.correct]
    wrong = "\n".join(f"{a.prompt.question!r} -> {a.text!r}" for a in answers if not a.correct)
    assert len(answers) == 30
    assert len(right) >= AT_LEAST, f"{len(right)}/30 right; wrong:\n{wrong}"


def test_no_answer_echoes_its_question_or_runs_on(answers: list[Answer]) -> None:
    for a in answers:
        assert not a.echoed, f"{a.prompt.question!r} -> {a.text!r}"
        assert a.text == a.text.strip() and "\n\n" not in a.text and "Q:" not in a.text, a.text
