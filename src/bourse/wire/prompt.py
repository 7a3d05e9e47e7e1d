"""The one walk over a request's prompt: its size for the quote and the gateway's own token estimate.

:func:`measure_prompt` reads the ``messages`` of a chat request (text, text parts,
tool calls, and the ``tools`` definitions) or the ``prompt`` of a legacy
completion once, and returns both numbers the gateway needs from it:

- ``bytes`` and ``messages`` feed the quote (SPEC section 3): one token per UTF-8
  byte is an upper bound no tokenizer exceeds; a part without text (an image)
  counts 64 bytes;
- ``estimated_tokens`` is the count settled on when an engine gives no usage (SPEC
  section 8): UTF-8 bytes / 4 + 1 of each text, plus 4 per chat message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from bourse.domain.values import immutable

PART_WITHOUT_TEXT_BYTES = 64
"""What a content part without text (an image, audio) adds to the quote."""
MESSAGE_ESTIMATE_TOKENS = 4
"""What each chat message adds to the gateway's own estimate (role markers, separators)."""


@immutable
class PromptSize:
    bytes: int
    """UTF-8 bytes of the prompt (texts, tool calls, tool definitions): the quote's bound."""
    messages: int
    """Chat messages (1 for a legacy prompt)."""
    estimated_tokens: int
    """The gateway's own prompt token count, used only when the engine reports none."""


def measure_prompt(body: Mapping[str, Any]) -> PromptSize:
    """The size of ``body``'s prompt (a validated chat or completion request body)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        nbytes, estimate = 0, MESSAGE_ESTIMATE_TOKENS * len(msgs)
        for m in msgs:
            if isinstance(m, dict):
                b, e = _message(m)
                nbytes += b
                estimate += e
        tools = body.get("tools")
        if tools:
            nbytes += len(orjson.dumps(tools))
        return PromptSize(nbytes, len(msgs), estimate)
    return _legacy_prompt(body.get("prompt"))


def _text(text: str) -> tuple[int, int]:
    n = len(text.encode())
    return n, n // 4 + 1


def _message(m: Mapping[str, Any]) -> tuple[int, int]:
    """(bytes, estimated tokens) of one chat message."""
    nbytes = estimate = 0
    c = m.get("content")
    if isinstance(c, str):
        nbytes, estimate = _text(c)
    elif isinstance(c, list):
        for part in c:
            if not isinstance(part, dict):
                continue
            t = part.get("text")
            if isinstance(t, str):
                b, e = _text(t)
                nbytes += b
                estimate += e
            else:
                nbytes += PART_WITHOUT_TEXT_BYTES
    for tc in m.get("tool_calls") or ():
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict):
            nbytes += len(str(fn.get("arguments", "")).encode()) + len(str(fn.get("name", "")).encode())
    return nbytes, estimate


def _legacy_prompt(p: Any) -> PromptSize:
    """A legacy completion's ``prompt``: a string or a list (of strings or token ids)."""
    if isinstance(p, str):
        b, e = _text(p)
        return PromptSize(b, 1, e)
    if isinstance(p, list):
        nbytes = estimate = 0
        for x in p:
            b, e = _text(x) if isinstance(x, str) else (1, 1)
            nbytes += b
            estimate += e
        return PromptSize(nbytes, 1, estimate)
    return PromptSize(0, 1, 0)
