"""Request bodies the tests send: the default conversation, and a streamed body with
its defaults filled in."""

from __future__ import annotations

from typing import Any

from openai.types.chat import ChatCompletionMessageParam

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me something about rivers."}]
"""The default conversation: one user message."""


def streamed(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``stream: true`` (unless it says otherwise) and the default
    conversation when it has neither ``messages`` nor ``prompt``."""
    out = {"stream": True, **body}
    if "messages" not in out and "prompt" not in out:
        out["messages"] = USER
    return out
