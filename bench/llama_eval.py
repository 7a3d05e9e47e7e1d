"""How many of 30 short questions the local model answers correctly, asked as chat
requests through a served gateway (``bourse serve`` in its own process, the
built-in ``gemma-3-270m`` product as shipped in ``default.toml``).

    .venv/bin/python -m bench.llama_eval [--chat-format NAME] [--threads 2] [--show]

The prompts and their expected keywords are ``tests/e2e/local/prompts.json``; an
answer is correct when it holds any one of its keywords as a whole word (or its
plural), whatever the case. Generation is greedy (temperature 0) and short (``max_tokens`` 32), so the
share is the same on every run. tests/e2e/local/test_answers.py runs the same
evaluation (:func:`evaluate`) against an in-process gateway.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

PROMPTS = Path(__file__).resolve().parent.parent / "tests" / "e2e" / "local" / "prompts.json"
MODEL = "gemma-3-270m"
MAX_TOKENS = 32


@dataclass(frozen=True)
class Prompt:
    """One question, an optional system message, and the keywords a right answer holds."""

    question: str
    expect: tuple[str, ...]
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        """The chat messages that ask it."""
        first = [{"role": "system", "content": self.system}] if self.system else []
        return [*first, {"role": "user", "content": self.question}]


@dataclass(frozen=True)
class Answer:
    """What the model said to one prompt, and how it scored."""

    prompt: Prompt
    text: str
    correct: bool
    echoed: bool


def load_prompts(path: Path = PROMPTS) -> list[Prompt]:
    """The evaluation prompts."""
    rows: list[dict[str, Any]] = json.loads(path.read_text())["prompts"]
    return [Prompt(r["q"], tuple(r["expect"]), r.get("system")) for r in rows]


def is_correct(text: str, expect: tuple[str, ...]) -> bool:
    """Whether ``text`` holds one of ``expect`` as a whole word, or its plural (-s, -es),
    whatever the case."""
    return any(re.search(rf"(?<!\w){re.escape(k)}(?:e?s)?(?!\w)", text, re.IGNORECASE) for k in expect)


def echoes(text: str, question: str) -> bool:
    """Whether ``text`` repeats the question (its words, in order, case and punctuation aside)."""

    def words(s: str) -> str:
        return " ".join(re.findall(r"\w+", s.lower()))

    return words(question) in words(text)


def ask(client: httpx.Client, base: str, prompt: Prompt, model: str = MODEL) -> Answer:
    """One prompt as a non-streamed chat request to ``base`` (…/v1)."""
    body = {"model": model, "messages": prompt.messages(), "max_tokens": MAX_TOKENS, "temperature": 0}
    r = client.post(base + "/chat/completions", json=body)
    r.raise_for_status()
    text: str = r.json()["choices"][0]["message"]["content"] or ""
    return Answer(prompt, text, is_correct(text, prompt.expect), echoes(text, prompt.question))


def evaluate(
    base: str, api_key: str, model: str = MODEL, prompts: list[Prompt] | None = None
) -> list[Answer]:
    """Every prompt, in order, through the gateway at ``base`` (…/v1)."""
    with httpx.Client(timeout=120, headers={"authorization": f"Bearer {api_key}"}) as client:
        return [ask(client, base, p, model) for p in prompts or load_prompts()]


def shipped_config(chat_format: str | None, threads: int) -> str:
    """The built-in default.toml, its llamacpp deployment given ``n_threads`` (and
    ``chat_format``, when one is asked for)."""
    text = resources.files("bourse").joinpath("default.toml").read_text()
    keys = f"n_threads = {threads}\n" + (f'chat_format = "{chat_format}"\n' if chat_format else "")
    marker = 'engine = "llamacpp"'
    assert marker in text, "default.toml has no llamacpp deployment"
    return text.replace(marker, keys + marker, 1)


def main() -> None:
    from bench.common import gateway

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chat-format", default=None, help="override the deployment's chat_format")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", action="store_true", help="print every answer")
    a = ap.parse_args()
    with gateway(shipped_config(a.chat_format, a.threads)) as (base, key):
        t0 = time.perf_counter()
        answers = evaluate(base, key)
        took = time.perf_counter() - t0
    for n, ans in enumerate(answers, 1):
        if a.show or not ans.correct:
            mark = "ok " if ans.correct else "BAD"
            echo = " [echoes the question]" if ans.echoed else ""
            print(f"{n:2d} {mark} {ans.prompt.question!r} -> {ans.text!r}{echo}")
    right = sum(a.correct for a in answers)
    echoed = sum(a.echoed for a in answers)
    print(
        f"{MODEL} (chat_format {a.chat_format or 'as configured'}): {right}/{len(answers)} correct "
        f"({right / len(answers):.0%}), {echoed} echo the question; {took:.1f} s"
    )


if __name__ == "__main__":
    main()
