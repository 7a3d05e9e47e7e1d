"""One request's run from the book to its outcome: :class:`Run`.

A run is its :class:`~bourse.services.run_terms.Terms` (fixed), its
:class:`~bourse.services.run_meter.Meter` (counts and timings) and its
:class:`~bourse.services.run_state.RunState` (the phase, moved only along one
table), with the book's order and the engine attempt it holds now. :meth:`Run.events`
is the single async iterator the HTTP relay and the jobs consume, for streamed and
non-streamed answers alike::

    Queued -> (engine chunks ... | Requeued -> ...) -> Finished

Chunks are the engine's own dicts with ``id``, ``model``, ``created`` (one value per
response: the request's arrival) and the reasoning field rewritten in place; nothing
is copied or buffered. Every run ends in exactly one :class:`Finished` (or in an
abandonment when its consumer stops), and every slot it took is given back exactly
once. Only the run writes its own state: its consumers read ``phase``, ``tokens``
and ``order``, tell it that the client left with :meth:`Run.client_gone`, and a job
marks its run with :meth:`Run.detach`. A draining gateway stops a run with
:meth:`Run.interrupt`: it ends with the drain's error (settled by its policy), or, a
detached job's run, raises :class:`HandedBack` unsettled, for the jobs to give back.
The run's settlement and its report are the host's
(:class:`~bourse.services.completion.CompletionService`), seen here as :class:`Host`.
"""

from __future__ import annotations

import asyncio
from asyncio import Future
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from bourse.domain.book import Admission, Order
from bourse.domain.charging import Outcome
from bourse.domain.errors import GatewayError, draining
from bourse.domain.policy import Policy
from bourse.ports.book import ClientGone
from bourse.ports.engine import ChunkEvent, EngineEvent, EngineFailure, GenerationRequest, Kind
from bourse.ports.observer import NULL_SPAN, Observer, Span
from bourse.services.billing import Closing, Quote
from bourse.services.deadline import start_bid
from bourse.services.market import Market
from bourse.services.run_events import Finished, HandedBack, Queued, Requeued, RunEvent, resolving
from bourse.services.run_failures import (
    after_output,
    close_quietly,
    empty_refusal,
    engine_error,
    engine_failure,
)
from bourse.services.run_meter import Meter, reasoning_count
from bourse.services.run_report import closing_of, report_of
from bourse.services.run_state import ADMITTED, DONE, QUEUED, STREAMING, Phase, RunState
from bourse.services.run_terms import Grant, Terms
from bourse.services.stall_clock import StallClock

T = TypeVar("T")


class Host(Protocol):
    """What a run needs of the service that opened it."""

    @property
    def observer(self) -> Observer: ...

    @property
    def models(self) -> Mapping[str, str]:
        """deployment name -> the engine's internal model name"""

    @property
    def draining(self) -> bool: ...

    @property
    def live(self) -> set[Run]: ...

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]: ...

    async def settle(
        self,
        closing: Closing,
        error: GatewayError | None,
        grant: Grant,
        text_tokens: int,
        run: Run | None = None,
    ) -> Finished: ...


PRESENT_FRESH_S = 0.01
"""A client found connected this recently (loop time) is not asked again: the run's
second look (after its admission) right after the book's (at its dispatch). An order
admitted at once, in its submission, is not asked at all (its request was just read). Each look is a ``poll()``, a
system call that gives up the GIL to the database thread: ~22 µs of the event loop's
thread per request under load, in py-spy. A client that leaves after a look is seen
by the relay (on bourse's own server the connection watch calls it back, on another
ASGI server its listener hears ``http.disconnect``), which cancels the run and so the
engine; the looks are for orders that waited in the book, whose clients may have left
unseen."""


class Run:
    """One request from the book to its outcome.

    Its :attr:`terms` are fixed when it is built; its :attr:`meter`, its phase and the
    order and slot it holds are written by its own methods only. The terms its
    consumers read are properties of it (``request_id``, ``product``, ``stream``, ...)."""

    __slots__ = (
        "_attempt_span",
        "_clock",
        "_deadline",
        "_detached",
        "_engine_iter",
        "_fut",
        "_present",
        "_present_at",
        "_settlement",
        "_state",
        "_stop",
        "_stop_cancelled",
        "_task",
        "admission",
        "cleared",
        "client_left",
        "created",
        "host",
        "meter",
        "order",
        "span",
        "terms",
    )

    def __init__(self, host: Host, terms: Terms, present: Callable[[], bool] | None = None) -> None:
        self.host = host
        self.terms = terms
        self.created = int(terms.created_at)
        """The chunks' ``created``."""
        self.span = host.observer.start_span(
            "bourse.run", None if terms.caller is None else terms.caller.traceparent, terms.t0
        )
        self._present = present
        """Asks whether the client is still connected (the relay's; None for a job)."""
        self._present_at = -PRESENT_FRESH_S
        """When (loop time) ``present`` last found the client connected."""
        self._clock = asyncio.get_running_loop().time
        """The loop's time, as :meth:`Market.now` reads it (one call, not three)."""
        # -- state (written by the run only) --
        self.meter = Meter(terms.t0)
        self._state = RunState()
        self.order: Order | None = None
        self.admission: Admission | None = None
        """The slot held now."""
        self.cleared: Admission | None = None
        """The last admission's terms, kept after its slot is given back."""
        self.client_left = False
        self._fut: asyncio.Future[Admission] | None = None
        self._deadline = 0.0
        self._engine_iter: AsyncIterator[EngineEvent] | None = None
        self._settlement: asyncio.Task[Finished] | None = None
        self._detached = False
        """The run of a detached job (:meth:`detach`): a drain hands it back rather than ending it."""
        self._stop: GatewayError | None = None
        """Set by :meth:`interrupt`: the error the run ends with."""
        self._stop_cancelled = False
        self._task: asyncio.Task[Any] | None = None
        """The task reading :meth:`events` (where :meth:`interrupt` stops it)."""
        self._attempt_span: Span = NULL_SPAN

    # -- what its consumers read -----------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._state.phase

    @property
    def done(self) -> bool:
        return self._state.phase is DONE

    @property
    def detached(self) -> bool:
        return self._detached

    @property
    def tokens(self) -> int:
        """Completion tokens generated so far (the meter's)."""
        return self.meter.generated

    @property
    def queued_ms(self) -> float | None:
        return self.meter.queued_ms

    @property
    def request_id(self) -> str:
        return self.terms.request_id

    @property
    def market(self) -> Market:
        return self.terms.ask.market

    @property
    def policy(self) -> Policy:
        return self.terms.ask.market.policy

    @property
    def product(self) -> str:
        return self.terms.ask.market.product

    @property
    def kind(self) -> Kind:
        return self.terms.ask.kind

    @property
    def bid(self) -> float:
        """The order's bid now (a deadline order's is raised while it waits)."""
        order = self.order
        return self.terms.ask.bid if order is None else order.bid

    @property
    def stream(self) -> bool:
        return self.terms.ask.stream

    @property
    def include_usage(self) -> bool:
        return self.terms.ask.include_usage

    @property
    def max_output_tokens(self) -> int:
        return self.terms.ask.max_output_tokens

    @property
    def quote(self) -> Quote:
        return self.terms.quote

    @property
    def hold_id(self) -> str:
        return self.terms.hold_id

    @property
    def account_id(self) -> str:
        return self.terms.account_id

    @property
    def grant(self) -> Grant:
        return self.terms.grant

    def detach(self) -> None:
        """The run is a detached job's (the jobs' call, before its events begin): a
        drain hands it back (:class:`HandedBack`) rather than ending it, and a requeue
        waits out cooling deployments rather than fail."""
        self._detached = True

    def interrupt(self, error: GatewayError) -> None:
        """A drain ends the run now, wherever it waits (an order leaves the book, an
        engine is stopped): it ends with ``error``, settled by its policy, or, a
        detached job's run, raises :class:`HandedBack`. Once; nothing if it has ended."""
        if self.phase is DONE or self._stop is not None:
            return
        self._stop = error
        task = self._task
        if task is not None and not task.done():  # else it stops at its next attempt
            self._stop_cancelled = True
            task.cancel()

    def take_back_stop(self) -> bool:
        """The consumer caught a cancellation: True (once) if it is the one
        :meth:`interrupt` sent, which landed in the consumer rather than in the run (a
        relay blocked writing to a slow client). It is taken back; the run has been
        abandoned, settled by its policy."""
        if not self._stop_cancelled:
            return False
        self._stop_cancelled = False
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return True

    def client_gone(self) -> None:
        """The client disconnected: an abandonment from now on is ``disconnected``."""
        self.client_left = True

    def _still_there(self) -> bool:
        """Whether the client is still connected, as far as can be told now (asked at
        admission: the relay may not have seen a disconnect the socket already has)."""
        if self.client_left:
            return False
        present = self._present
        if present is not None:
            now = self._clock()
            if now - self._present_at >= PRESENT_FRESH_S:
                if not present():
                    self.client_left = True
                    return False
                self._present_at = now
        return True

    async def submit(self) -> None:
        """Rest the order in the book (may admit at once); 503 if the book is full."""
        ask = self.terms.ask
        m = ask.market
        if ask.deadline_s is None:
            self.order = order = m.new_order(self.terms.request_id, ask.bid)
        else:  # a deadline order: it starts low, raised while it waits (up to ask.bid)
            first = await start_bid(m, ask.deadline_s, ask.bid)
            self.order = order = m.new_order(self.terms.request_id, first)
            order.ceiling, order.start_bid = ask.bid, first
        order.present = self._still_there
        # its request was read from the client just now: an order admitted at once is
        # not asked (a client that left meanwhile is seen by the relay: the connection
        # watch, or the listener on another server)
        self._present_at = self._clock()
        self._deadline = order.arrived_at + ask.timeout_s  # a requeue or re-entry keeps it
        self._fut = fut = await m.submit(order, deadline=self._deadline, tokens=ask.max_output_tokens)
        if not fut.done():  # resting in the book: its client is asked when a slot comes
            self._present_at = -PRESENT_FRESH_S
        self._state.go(QUEUED)

    # -- the run -------------------------------------------------------------------

    async def events(self, on_admit: Callable[[Run], None] | None = None) -> AsyncGenerator[RunEvent, None]:
        """The run's events; ``on_admit`` is called once, when the order first gets a
        slot (detached jobs mark themselves running)."""
        assert self.order is not None, "submit() first"
        ask, meter, state = self.terms.ask, self.meter, self._state
        target = ask.market.policy.reasoning_field
        other = "reasoning" if target == "reasoning_content" else "reasoning_content"
        chat = ask.kind == "chat"
        rid = self.terms.request_id
        product = ask.market.product
        created = self.created
        streaming = STREAMING
        self._task = asyncio.current_task()
        try:
            yield Queued(self.order.bid)
            while True:
                it, clock = await self._attempt(on_admit)
                try:
                    clock.pull = 1
                    async for ev in it:
                        clock.pull = 0
                        if type(ev) is ChunkEvent:
                            chunk = ev.chunk
                            chunk["id"] = rid
                            chunk["model"] = product
                            chunk["created"] = created
                            # the reasoning field renamed and counted, inline (once per chunk;
                            # a legacy completion's choices have no delta)
                            for choice in chunk["choices"] if chat else ():
                                delta = choice.get("delta")
                                if delta is not None:
                                    if other in delta:
                                        delta[target] = delta.pop(other)
                                    if delta.get(target):
                                        meter.reasoning += reasoning_count(delta[target], ev.tokens)
                            if state.phase is not streaming:
                                self._first_output()
                            meter.generated += ev.tokens
                            yield ev
                            meter.delivered += ev.tokens  # the consumer came back for more
                            del ev, chunk  # not held while the engine waits for the next (bench (e))
                            choice = delta = None
                        else:
                            meter.engine_usage = ev
                        clock.pull = 1
                except (EngineFailure, asyncio.CancelledError) as exc:
                    clock.stop()
                    end = await self._failed(await engine_failure(exc, clock, it, ask.market.product))
                    yield end
                    if type(end) is Finished:
                        return
                    continue
                finally:
                    clock.stop()
                self._engine_iter = None
                yield await self._settled("disconnected" if self.client_left else "completed", None)
                return
        except (GatewayError, ClientGone, asyncio.CancelledError, GeneratorExit) as exc:
            yield await self._ended(exc)
        finally:
            self._task = None

    async def _ended(
        self, exc: GatewayError | ClientGone | asyncio.CancelledError | GeneratorExit
    ) -> Finished:
        """The end of a run by an error: the book's or the engine's, or a drain's stop;
        or a slot that came after the client left (no engine started on it). Or its
        consumer stopped it (``exc`` raised again once the run is abandoned), unless
        ``exc`` is the cancellation a drain's stop sent."""
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            await self._abandon_unless_stopped(exc)
            return await self._interrupted()
        if exc is self._stop:
            return await self._interrupted()
        if isinstance(exc, ClientGone):
            self.client_left = True
            return await self._settled("disconnected", None)
        return await self._settled("timeout" if exc.status == 408 else "error", exc)

    async def _abandon_unless_stopped(self, exc: asyncio.CancelledError | GeneratorExit) -> None:
        """The consumer stops (``exc`` raised again, the run abandoned), unless ``exc`` is
        the cancellation :meth:`interrupt` sent: that one is taken back, and the task goes
        on to end the run with the drain's error."""
        if type(exc) is GeneratorExit or not self.take_back_stop():
            await self._abandon()
            raise exc

    async def _attempt(
        self, on_admit: Callable[[Run], None] | None
    ) -> tuple[AsyncIterator[EngineEvent], StallClock]:
        """Wait for a slot (408 at the deadline), start the engine on it and its stall clock."""
        if self._stop is None and self.host.draining:
            self._stop = draining()
        if self._stop is not None:
            raise self._stop
        terms, order, fut = self.terms, self.order, self._fut
        m = terms.ask.market
        assert order is not None and fut is not None
        observer, run_span = self.host.observer, self.span
        traced = run_span is not NULL_SPAN  # else no child span either (nothing is traced)
        wait = observer.start_span("bourse.book.wait", run_span) if traced else NULL_SPAN
        try:
            adm = await m.wait(order, fut, self._deadline)  # ClientGone: the book saw the client had left
        except BaseException as exc:
            wait.end(type(exc).__name__)
            if isinstance(exc, asyncio.CancelledError):
                # the book withdrew the order itself (or gave back the slot it had just
                # given): the abandonment must not withdraw it a second time
                self._fut = None
            raise
        if traced:
            wait.end()
        if not self._still_there():  # left since: give the slot to the next order, start nothing
            m.release(adm)
            raise ClientGone(order.id)
        self.admission = self.cleared = adm
        self._state.go(ADMITTED)
        if self.meter.admitted(self._clock() - order.arrived_at) and on_admit is not None:
            on_admit(self)
        body = terms.ask.body
        body["model"] = self.host.models[adm.deployment]
        traceparent = None if terms.caller is None else terms.caller.traceparent
        if traced:
            span = self._attempt_span = observer.start_span("bourse.engine.attempt", run_span)
            span.set("bourse.deployment", adm.deployment)
            span.set("bourse.attempt", order.requeues)
            traceparent = span.traceparent or traceparent
        engine = m.engine_for(adm.deployment)
        it = engine.generate(
            GenerationRequest(
                terms.request_id, terms.ask.kind, body, attempt=order.requeues, stream=terms.engine_stream,
                traceparent=traceparent,
            )
        )  # fmt: skip
        self._engine_iter = it
        whole = not terms.engine_stream and engine.answers_whole
        return it, StallClock(None if whole else m.stall_timeout_s)

    def _first_output(self) -> None:
        self._state.go(STREAMING)
        self.meter.first_output()
        if self.admission is not None:
            self.terms.ask.market.report_success(self.admission.deployment)

    async def _failed(self, failure: EngineFailure) -> Requeued | Finished:
        """The engine failed: requeue a transient failure before any output (up to
        ``max_requeues``), else finish with the error. A final failure says
        ``x-should-retry: false``: it ran (perhaps produced, perhaps was charged), or
        refused the request, or may still be running; sent again, it would run again."""
        self._engine_iter = None
        m, order, adm = self.terms.ask.market, self.order, self.admission
        assert order is not None and adm is not None
        streaming = self._state.phase is STREAMING
        if failure.kind == "empty" and not streaming:
            failure = await empty_refusal(
                self.terms.ask, self.terms.prompt, self.terms.request_id, adm.deployment, failure
            )
        self._end_attempt(failure.message)
        if not streaming:
            m.attempt_failed(adm)  # nothing came out: nobody paid it, it cleared nothing
        self.host.observer.upstream_failed(
            m.product, adm.deployment, failure.kind, failure.message, self.terms.request_id, failure.upstream
        )
        if streaming or not failure.transient:
            if failure.kind == "timeout" and not streaming:
                m.report_failure(adm.deployment, order)  # no answer in time: the deployment's, once
            err = GatewayError(
                failure.status, failure.code, failure.message, error_type=failure.error_type, retry=False
            )
            return await self._settled("error", engine_error(m.policy, err))
        if order.requeues < m.policy.max_requeues:
            self.host.observer.requeued(m.product, adm.deployment)
            self._fut = fut = await m.requeue(order, adm)
            self.admission = None
            self._state.go(QUEUED)
            cooling = None if self._detached else m.cooling()
            if cooling is not None:  # every deployment cools down: nothing could run it now
                m.withdraw(order, fut)
                return await self._settled("error", cooling)
            return Requeued(adm.deployment)
        m.report_failure(adm.deployment, order)
        return await self._settled("error", engine_error(m.policy, m.failure_after_requeues(failure.message)))

    async def _settled(self, outcome: Outcome, error: GatewayError | None) -> Finished:
        if self._state.phase is not DONE:  # its settlement, a task of its own (see resolving)
            out: Future[Finished] = asyncio.get_running_loop().create_future()
            self._finish(outcome, error, out)
            return await out
        assert self._settlement is not None  # ended already (abandoned): its settlement
        return await asyncio.shield(self._settlement)

    async def settled(self) -> Finished | None:
        """The run's settled end (waits for its settlement); None if it has not ended."""
        if self._settlement is None:
            return None
        return await asyncio.shield(self._settlement)

    async def abandon(self) -> None:
        """The consumer stops without the run having finished (client gone, head not
        sent, job canceled): stop the engine, give back the slot, settle. Idempotent."""
        if self._state.phase is not DONE:
            await self._abandon()

    async def _abandon(self) -> None:
        if self._state.phase is DONE:
            return
        await self._halt()
        self._finish("disconnected" if self.client_left else "canceled", None, None)

    async def _halt(self) -> None:
        """Stop the engine; take a waiting order out of the book."""
        it, self._engine_iter = self._engine_iter, None
        if it is not None:
            await close_quietly(it)
        if (
            self._state.phase is QUEUED
            and self.admission is None
            and self.order is not None
            and self._fut is not None
        ):
            self.terms.ask.market.withdraw(self.order, self._fut)

    async def _interrupted(self) -> Finished:
        """The end of a run a drain stopped: with the drain's error, settled by the
        policy; a detached job's run gives back its slot and raises :class:`HandedBack`."""
        assert self._stop is not None
        await self._halt()
        if not self._detached:
            streaming = self._state.phase is STREAMING
            return await self._settled("error", after_output(self._stop, streaming))
        self._state.go(DONE)
        self._unlink()
        if self.admission is not None:
            self.terms.ask.market.release(self.admission)
            self.admission = None
        self.host.live.discard(self)
        self._end_attempt("handed back")
        self.span.end("handed_back")
        raise HandedBack(self.terms.request_id)

    def _finish(self, outcome: Outcome, error: GatewayError | None, out: Future[Finished] | None) -> None:
        """The run ends: give back the slot, start the settlement (its own task; ``out`` gets its end)."""
        if self._state.phase is DONE:
            return
        closing = closing_of(self.terms, self.meter, self._state.phase, self.order, self.cleared, outcome)
        self._state.go(DONE)
        self._unlink()
        host = self.host
        host.live.discard(self)
        if self._attempt_span is not NULL_SPAN:
            self._end_attempt(None if error is None else error.message)
        if self.admission is not None:
            self.terms.ask.market.release(self.admission)
            self.admission = None
        settling = host.settle(closing, error, self.terms.grant, self.meter.generated, self)
        self._settlement = host.spawn(settling if out is None else resolving(settling, out))

    def _unlink(self) -> None:
        """At the run's end, drop the order's way back to the run (its presence probe, a
        bound method of the run): nothing asks it any more, and without it the run, its
        order and its settlement are freed by reference counting, not left in a cycle for
        the garbage collector (a collection every ~200 requests under load)."""
        if self.order is not None:
            self.order.present = None

    def _end_attempt(self, error: str | None) -> None:
        """End the engine attempt's span (callers on the hot path look for one first)."""
        span, self._attempt_span = self._attempt_span, NULL_SPAN
        span.end(error)

    def report(self, fin: Finished, closing: Closing) -> None:
        """Tell the observer how the run ended (once, after its settlement): its report,
        if the observer hears runs, and the end of its span."""
        observer = self.host.observer
        if observer.hears_runs:
            observer.run_finished(
                report_of(self.terms, self.meter, self.order, self.cleared, self.client_left, fin, closing)
            )
        span = self.span
        if span is not NULL_SPAN:
            span.set("bourse.outcome", fin.outcome)
            span.set("bourse.product", self.terms.ask.market.product)
            span.set("bourse.cost_micros", fin.cost_micros)
            span.end(None if fin.error is None else fin.error.code)
