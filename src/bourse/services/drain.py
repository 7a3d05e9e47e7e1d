"""The drain: how a gateway told to stop (SIGTERM, SIGINT) finishes what it started.

:class:`Drain` is called once, by the server's signal handler, while the server still
accepts connections:

1. From now on the gateway is draining: ``/readyz`` answers 503 and a new request
   (a completion, a job) gets 503 ``draining`` with ``retry-after``. The jobs'
   sweeper and claimer stop.
2. Orders still waiting in the book end at once with that same error (in-band for a
   stream that has its 200, then the policy's ``[DONE]``), settled by their policy
   (nothing was generated: released). A detached job waiting is handed back
   (:class:`~bourse.services.completion.HandedBack`).
3. Running generations go on for up to ``drain_timeout_s``; a requeued one ends as a
   waiting order does.
4. Those still running then end with an in-band error frame, settled by their policy;
   running jobs are handed back (hold released, no usage record, stored queued with no
   owner), so another gateway on the same ledger runs each exactly once.
5. Once the runs' settlements are done (at most ``GRACE_S``), the sweep runs once
   (:meth:`~bourse.services.housekeeping.Housekeeping.sweep_once`): what the store
   refused while it was unavailable is written, and this gateway's holds that no run
   holds are closed, so it exits with no hold open. If the store still refuses, what
   is left is logged; the next start reconciles it.
6. Until ``grace_s`` (``[server] drain_grace_s``) has passed since the signal, busy or
   idle, it waits: the listener stays open and ``/readyz`` answers 503, so that a load
   balancer polling it takes the gateway out before its connections are refused. A
   second signal cuts this short too.

When it returns the server shuts down; nothing it started is left running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from bourse.domain.errors import draining
from bourse.services.completion import CompletionService
from bourse.services.housekeeping import Sweep
from bourse.services.jobs import JobService
from bourse.services.run_state import Phase

log = logging.getLogger("bourse.drain")

POLL_S = 0.02
"""How often the drain looks whether everything has ended."""
GRACE_S = 10.0
"""How long runs ended at the deadline get to close their engines and settle."""


class Drain:
    """Drains a gateway: called once; :meth:`hurry` ends the wait for running generations."""

    def __init__(
        self,
        completions: CompletionService,
        jobs: JobService,
        timeout_s: float,
        sweep: Sweep | None = None,
        *,
        grace_s: float = 0.0,
    ) -> None:
        self.completions = completions
        self.jobs = jobs
        self.timeout_s = timeout_s
        self.sweep = sweep
        """Run once the runs have ended and settled (step 5)."""
        self.grace_s = grace_s
        """The least time from the signal to the return (step 6)."""
        self._hurry = False

    def hurry(self) -> None:
        """Stop waiting for running generations (a second signal): end them now."""
        self._hurry = True

    async def __call__(self) -> None:
        c = self.completions
        if c.draining:
            return
        c.draining = True
        began = asyncio.get_running_loop().time()
        await self.jobs.stop()
        waiting = [run for run in c.live if run.phase <= Phase.QUEUED]
        for run in waiting:
            run.interrupt(draining())
        log.warning(
            "draining: %d orders waiting ended, %d generations running get up to %g s",
            len(waiting), len(c.live) - len(waiting), self.timeout_s,
        )  # fmt: skip
        if await self._until(self._idle, self.timeout_s, hurry=True):
            log.warning("drained: every generation has ended")
        else:
            late = list(c.live)
            log.warning(
                "drain timeout (%g s): %d generations still running are ended", self.timeout_s, len(late)
            )
            message = (
                f"The gateway shut down before this generation ended (drain_timeout_s = {self.timeout_s:g}); "
                "what was generated is settled by the product's policy."
            )
            for run in late:
                run.interrupt(draining(message))
            if not await self._until(self._idle, GRACE_S, hurry=False):
                log.error("drain: %d runs did not end within %g s of the deadline", len(c.live), GRACE_S)
        await self._sweep()
        left = began + self.grace_s - asyncio.get_running_loop().time()
        if left > 0:  # step 6: the listener stays open while load balancers see the 503
            log.info("drain: /readyz answers 503 for %.2f s more before the listener closes", left)
            await self._until(lambda: False, left, hurry=True)

    async def _sweep(self) -> None:
        """Step 5: the sweep, once the runs' settlements are done (or kept for it)."""
        if self.sweep is None:
            return
        sweeper = self.completions.billing.sweeper
        if not await self._until(lambda: not sweeper.in_flight, GRACE_S, hurry=False):
            log.error("drain: %d holds are still being closed by their runs", len(sweeper.in_flight))
        try:
            closed = await asyncio.wait_for(self.sweep(), GRACE_S)
        except Exception as exc:  # the store still refuses (or the sweep took too long)
            log.error("drain: the sweep failed (%s); %d refused hold closes are left to the next start, "
                      "which reconciles their holds", exc or type(exc).__name__, len(sweeper.refused))  # fmt: skip
            return
        if closed:
            log.warning(
                "drain: the sweep closed or wrote %d holds and job states the database had refused", closed
            )

    def _idle(self) -> bool:
        return not self.completions.live and not self.jobs.active

    async def _until(self, done: Callable[[], bool], timeout_s: float, *, hurry: bool) -> bool:
        """Wait until ``done()`` (True), or ``timeout_s`` passed or, with ``hurry``,
        :meth:`hurry` was called (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done():
            left = deadline - loop.time()
            if left <= 0 or (hurry and self._hurry):
                return False
            await asyncio.sleep(min(POLL_S, left))
        return True
