"""Deterministic text for the ``sim`` engine: words, lengths, seeds, prompt counts.

Pure functions, no I/O. Everything here is a function of a seed, so the same
request (same ``seed`` or same messages) always produces the same answer, and the
simulator's token counts are exact: :func:`count_prompt_tokens` is the sim's own
"tokenizer" and the number of tokens it generates is the number of chunks it yields.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = [
    "ANSWER_LENGTH_MAX",
    "ANSWER_LENGTH_MIN",
    "VOCABULARY",
    "answer_length",
    "count_prompt_tokens",
    "natural_length",
    "reasoning_seed",
    "seed_of",
    "sim_tokens",
]

ANSWER_LENGTH_MIN = 8
ANSWER_LENGTH_MAX = 40

_WORDS = """
    the a an and or but so if then when while because after before since until
    of in on at by for with from into onto over under between through about
    across along around behind beyond near past toward within without upon
    i you he she it we they me him her us them my your his its our their this
    that these those here there where what which who whom whose why how
    is are was were be been being have has had do does did will would shall
    should can could may might must need make made take took give gave find
    found think thought know knew see saw come came go went look looked want
    use used work worked call called try tried ask asked feel felt leave left
    keep kept begin began show showed hear heard play played run ran move
    moved live lived believe hold held bring brought write wrote stand stood
    learn learned change changed lead led understand watch follow stop create
    speak read allow add spend grow open walk win offer remember love consider
    appear buy wait serve die send expect build stay fall cut reach kill remain
    time year people way day man woman child world life hand part place case
    week company system program question government number night point home
    water room mother area money story fact month lot right study book eye job
    word business issue side kind head house service friend father power hour
    game line end member law car city community name president team minute idea
    kid body information back parent face others level office door health
    person art war history party result morning reason research girl guy moment
    air teacher force education river mountain garden window market harbor
    bridge forest ocean island valley desert village station engine signal
    price order token stream answer letter paper music table light color
    good new first last long great little own other old big high different
    small large next early young important few public bad same able only
    quiet bright simple clear warm cold green blue red golden silver gentle
    careful quick slow steady calm strong soft deep wide narrow distant close
    ready certain whole free true full open late real best better sure
    not also very often always never sometimes still just now even again
    soon already almost perhaps together away today tomorrow yesterday
    well rather quite really finally nearly
"""

VOCABULARY: tuple[str, ...] = tuple(dict.fromkeys(_WORDS.split()))
"""The sim's vocabulary: plain English words, no punctuation, no duplicates."""
_SPACED: tuple[str, ...] = tuple(" " + w for w in VOCABULARY)
"""Each word with its leading space, made once: a drawn token is one of these (shared),
not a new string a token (~0.8 KB an open 16-token stream, bench (e))."""

_REASONING_SALT = 0x5EA5
_LENGTH_SALT = 0x1E9


def sim_tokens(seed: int, n: int) -> list[str]:
    """``n`` tokens drawn from :data:`VOCABULARY` by ``random.Random(seed)``.

    Every token but the first has a leading space, so ``"".join(tokens)`` reads
    as text. The same seed gives the same tokens, and the first ``k`` tokens of a
    longer draw equal a draw of ``k``.
    """
    if n <= 0:
        return []
    choice = random.Random(seed).choice
    tokens = [choice(VOCABULARY)]
    spaced = _SPACED  # the same draws as from VOCABULARY: same length, same order
    tokens.extend([choice(spaced) for _ in range(n - 1)])
    return tokens


def reasoning_seed(seed: int) -> int:
    """The seed of a request's reasoning tokens, distinct from its answer's."""
    return seed ^ _REASONING_SALT


def natural_length(seed: int) -> int:
    """The answer's natural length in tokens, seeded, in [8, 40]."""
    return random.Random(seed ^ _LENGTH_SALT).randint(ANSWER_LENGTH_MIN, ANSWER_LENGTH_MAX)


def answer_length(seed: int, cap: int) -> int:
    """:func:`natural_length` capped at ``cap``."""
    return min(natural_length(seed), cap)


def _words(text: object) -> int:
    return len(text.split()) if isinstance(text, str) else 0


def _content_words(content: object) -> int:
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                total += _words(part.get("text"))
        return total
    return 0


def count_prompt_tokens(kind: str, body: Mapping[str, Any]) -> int:
    """The sim's exact prompt token count.

    - ``chat``: for each message, the number of whitespace-separated words of its
      text content (``content`` may be a string, ``None``, or a list of parts of
      which only ``{"type": "text", "text": ...}`` parts count) plus 4; then plus 2.
      Other message fields (name, tool calls) do not count.
    - ``completion``: the number of whitespace-separated words of ``prompt`` (a
      string, or a list whose first element is a string) plus 1.
    """
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 2
        total = 2
        for message in messages:
            total += 4
            if isinstance(message, Mapping):
                total += _content_words(message.get("content"))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt else None
    return _words(prompt) + 1


def seed_of(body: Mapping[str, Any]) -> int:
    """The request's ``seed`` if it is an int, else a stable hash of its prompt.

    The hash is ``zlib.crc32`` of the orjson dump (keys sorted) of ``messages``,
    or of ``prompt`` when there are no messages.
    """
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    source = body.get("messages")
    if source is None:
        source = body.get("prompt")
    try:
        dumped = orjson.dumps(source, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        dumped = repr(source).encode()
    return zlib.crc32(dumped)
