"""Stop strings applied to text as it streams: held back while it may begin one, cut at
the first. Used by the embedded engine (its own generation) and by the ``openai``
engine where bourse applies a request's ``stop`` itself (an upstream it counts tokens
for: see ``bourse.engines.openai_http``)."""

from __future__ import annotations

from typing import Any

__all__ = ["StopStrings", "stop_list"]


def stop_list(stop: Any) -> list[str]:
    """A request's ``stop`` (a string, a list of them, or None) as a list of the
    non-empty strings in it."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return [s for s in stops if isinstance(s, str) and s]


class StopStrings:
    """Cuts the answer at the first stop string; text that may be the start of one is
    held back until the next piece shows it is not. With ``strip_lead``, the whitespace
    the answer starts with is dropped."""

    __slots__ = ("_held", "_lead", "_stops")

    def __init__(self, stops: list[str], *, strip_lead: bool = False) -> None:
        self._stops = stops
        self._held = ""
        self._lead = strip_lead

    def push(self, piece: str) -> tuple[str, bool]:
        """The text that can be shown now, and whether a stop string ended the answer
        (the stop string and anything after it are dropped)."""
        text, stopped = self._cut(self._held + piece)
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        return text, stopped

    def _cut(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = max(self._overlap(text, s) for s in self._stops)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        """The length of the longest end of ``text`` that begins ``stop``."""
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        """The text still held: the answer ended without completing a stop string."""
        held, self._held = self._held, ""
        return held.lstrip() if self._lead else held
