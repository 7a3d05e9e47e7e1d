"""Request ids: ``chatcmpl-…`` for chat, ``cmpl-…`` for legacy completions, ``req-…`` else."""

from __future__ import annotations

import os


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-" if kind == "completion" else kind + "-"
    return prefix + os.urandom(12).hex()
