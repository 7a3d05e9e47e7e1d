"""The end of a streamed answer (:mod:`bourse.http.relay`): the frames the relay writes
after the run's last chunk. The usage (a chunk of its own, or the terminal chunk held
back to carry it, policy ``usage_on_last_choice``), the error frame of a run that
failed, and ``[DONE]``, each as the product's policy says. Pure: it reads the run's
terms and its end, and writes nothing.
"""

from __future__ import annotations

from typing import Any

import orjson

from bourse.services.completion import Finished, Run
from bourse.wire import sse
from bourse.wire.chunks import error_frame, terminal_chunk, usage_chunk


def tail(run: Run, fin: Finished, held: dict[str, Any] | None, hold_terminal: bool) -> bytes:
    """The frames after the last chunk of ``run``, ended by ``fin``: the usage (or
    ``held``, the terminal chunk held back for it), the error frame, ``[DONE]``."""
    terms = run.terms
    policy = terms.ask.market.policy
    failed = fin.error is not None
    with_usage = terms.ask.include_usage and (
        not failed or (policy.usage_before_error and (fin.text_tokens > 0 or policy.usage_chunk == "always"))
    )
    if with_usage:
        out = _usage_frame(run, fin, held, hold_terminal)
    else:
        out = b"" if held is None else sse.data_frame(orjson.dumps(held))
    if fin.error is None:
        return out + sse.DONE
    frame = error_frame(
        terms.ask.kind,
        terms.request_id,
        terms.ask.market.product,
        run.created,
        fin.error,
        shape=policy.error_frame,
        fields=policy.error_fields,
        finish_reason=policy.error_finish_reason,
    )
    out += sse.data_frame(orjson.dumps(frame))
    return out + sse.DONE if policy.done_after_error else out


def _usage_frame(run: Run, fin: Finished, held: dict[str, Any] | None, hold_terminal: bool) -> bytes:
    terms, created = run.terms, run.created
    ask = terms.ask
    policy = ask.market.policy
    if hold_terminal:  # on the terminal chunk
        chunk = held or terminal_chunk(ask.kind, terms.request_id, ask.market.product, created)
        chunk["usage"] = fin.usage
        chunk[policy.receipt_name] = fin.receipt
    else:
        chunk = usage_chunk(
            ask.kind,
            terms.request_id,
            ask.market.product,
            created,
            fin.usage,
            policy.receipt_name,
            fin.receipt,
        )
    return sse.data_frame(orjson.dumps(chunk))
