"""Where the refusals every replica answered are kept together (issue 38's floor): a
bounded, shared list of the newest, each an opaque line (what the dashboard's feed
wrote), for :class:`~bourse.services.request_feed.RequestFeed`. With one process
there is none (the feed's own memory is the list)."""

from __future__ import annotations

from typing import Protocol


class SharedRefusals(Protocol):
    def add(self, line: str) -> None:
        """Keep ``line`` (newest first), soon and best effort: never waits, never
        raises (a refusal is not money; the ledger never sees it)."""

    async def recent(self) -> list[str]:
        """The lines kept, newest first (every replica's); raises when the store
        cannot be read (the caller lists its own then)."""
