"""Request ids: ``chatcmpl-…`` for chat, ``cmpl-…`` for legacy completions."""

from __future__ import annotations

import os


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return prefix + os.urandom(12).hex()
