"""Ids of what a request writes to the ledger: request ids (``chatcmpl-…`` for chat,
``cmpl-…`` for legacy completions, ``req-…`` else) and hold ids (``hold_…``).

Each is 24 hex digits: the time in milliseconds (10 digits), then 56 random bits. Ids
made later sort later, so a new hold's and a new usage record's entries go at the end
of the indexes keyed by them (the holds' and the records' primary keys, the holds by
request), where the previous ones went: the commits of a busy gateway share those
pages and the checkpoint copies a few, where random ids put every entry on a page of
its own, anywhere in the index (issue 40; docs/design.md "Bytes written a request").
"""

from __future__ import annotations

import os
import time


def sortable_hex() -> str:
    """24 hex digits: milliseconds since the epoch (10; they wrap in 2318), then 14 random."""
    return f"{int(time.time() * 1000) & 0xFF_FFFF_FFFF:010x}" + os.urandom(7).hex()


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-" if kind == "completion" else kind + "-"
    return prefix + sortable_hex()


def new_hold_id() -> str:
    return "hold_" + sortable_hex()
