"""The Redis adapter of the book port: one book per product shared by every replica.

Admission runs in Lua (``lua/book_*.lua``; the key layout in ``lua/book.lua``), so
across replicas no slot is given twice and no better order is passed over. This
replica keeps only what its own clients wait on: the future of each of its waiting
orders and the admissions it holds.

An admission reaches its replica as an *offer* on the hub's channel; the replica
takes it up (``TAKE``, after checking that the client is still there) before the
take-up deadline (``[cluster] take_up_s``), or the admission goes back: the slot to
the next order, the order to its place, parked until its replica speaks again (a
stopped or stalled replica holds nobody's slot). A replica's heartbeat renews its
leases, takes up an offer whose message was lost, and rests again (with their
arrival) the orders and slots Redis forgot (a Redis restart). If Redis stays
unreachable for a lease, the orders waiting here fail with ``BookUnavailable``
(the client gets a 503 with ``retry-after``) rather than wait on a book that may
have forgotten them.

Circuit breakers stay per replica; when one opens it publishes "cooling until" for
its deployment, which every replica's clears respect. Availability (the probes) is per
replica too and shared the same way: while this replica finds a deployment
unavailable it publishes "cooling until" ``availability.hold_s`` ahead at each probe
(so a replica that stops probing holds it out no longer than that), and clears it
when a probe passes again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from redis.exceptions import RedisError

from bourse.coordination.book_entries import clear, held_terms, running, slot_terms, waiting_terms
from bourse.coordination.redis_hub import RedisHub
from bourse.domain.book import Admission, BookFull, Deployment, Order, check_raise, counts_against
from bourse.ports.book import BookUnavailable, BookView, ClientGone, DeploymentView, Pace

log = logging.getLogger("bourse.coordination")

BOOK_KEYS = (
    "book", "orders", "held", "lease", "busy", "cool", "stats", "recent", "seq", "offer", "park", "parkn",
    "stall",
)  # fmt: skip
"""The keys of one product's book, in the scripts' ``KEYS`` order (see ``lua/book.lua``;
``tests/unit/test_one_source.py`` checks the scripts' unpack of ``KEYS`` against it)."""
SHARED_KEYS = ("replicas",)
"""The keys every product's scripts share, after the book's own in ``KEYS``."""


def script_keys(prefix: str, product: str) -> list[str]:
    """The ``KEYS`` of a book script of ``product``: its book's (one hash tag, so one
    cluster slot), then the shared ones."""
    tag = f"{{{prefix}:{product}}}"
    return [f"{tag}:{k}" for k in BOOK_KEYS] + [f"{prefix}:{k}" for k in SHARED_KEYS]


RELEASE_BATCH = 256
"""At most this many slots given back in one RELEASE call (one script's run stays short)."""
VIEW_BIDS = 10_000
"""The market view lists at most this many waiting bids (the best ones)."""


class RedisBook:
    """One product's share of the cluster book, as seen from this replica."""

    def __init__(
        self, hub: RedisHub, product: str, deployments: list[Deployment], *, max_waiting: int
    ) -> None:
        if not deployments:
            raise ValueError(f"product {product!r} has no deployment")
        self.hub = hub
        self.product = product
        self.deployments = deployments
        self.min_floor = min(d.floor for d in deployments)
        self.max_waiting = max_waiting
        self._keys = [k.encode() for k in script_keys(hub.prefix, product)]  # encoded once, not per call
        self._head = self._make_head()
        self._by_name = {d.name: d for d in deployments}
        self._held_out: set[str] = set()
        """Deployments this replica has published as unavailable."""
        self._breakers = {d.name: d.breaker for d in deployments}
        self._waiting: dict[str, tuple[Order, asyncio.Future[Admission]]] = {}
        self._held: dict[str, Admission] = {}
        self._pos: dict[str, int] = {}
        self._resting: set[str] = set()
        """Waiting orders whose submit Redis has answered (only these are renewed)."""
        self._taking: set[str] = set()
        """Offers being taken up (a TAKE in flight)."""
        self._orphans: set[str] = set()
        """Orders this replica gave up on while Redis was unreachable: taken out once it answers."""
        self._giving_back: list[str] = []
        """Slots to give back in the next RELEASE call (:meth:`_give_back`)."""
        self._give_back_running = False
        self._level = self.min_floor
        self._pace = Pace(0, 0.0)
        self._answered_at: float | None = None
        """Loop time Redis last answered this book (None before the first call)."""
        self._sweep: asyncio.TimerHandle | None = None

    def _make_head(self) -> list[bytes]:
        """The scripts' first arguments, encoded: the deployments (with their slots now),
        the hub's terms."""
        hub = self.hub
        head = [
            orjson.dumps([[d.name, repr(float(d.floor)), d.slots] for d in self.deployments]).decode(),
            hub.lease_ms,
            hub.channel_prefix,
            self.product,
            hub.replica,
            int(hub.take_up_s * 1000),
            int(hub.park_s * 1000),
        ]
        return [str(v).encode() for v in head]

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def _call(self, script: str, *args: Any) -> Any:
        try:
            offers, reply = await self.hub.call(script, self._keys, args, self._head)
        except (RedisError, OSError) as exc:
            raise BookUnavailable(f"the shared book of '{self.product}' is unreachable ({exc})") from exc
        self._answered_at = self.now()
        if offers and self._sweep is None:
            # someone must look again once the offers' take-up deadline has passed
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(self.hub.take_up_s + 0.02, self._on_sweep)
        return reply

    def _on_sweep(self) -> None:
        self._sweep = None
        self.hub.spawn(self._call("STANDING", ""))

    # -- orders ---------------------------------------------------------------------

    def new_order(self, order_id: str, bid: float) -> Order:
        # seq is the cluster's arrival number, given by the submit script
        return Order(id=order_id, bid=bid, seq=0, arrived_at=self.now())

    async def submit(self, order: Order) -> asyncio.Future[Admission]:
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        await self._submit(order, fut)
        return fut

    async def _submit(self, order: Order, fut: asyncio.Future[Admission], cool_for_ms: int = 0) -> None:
        oid = order.id
        entering = order.seq == 0  # not a requeue: its position at entry is taken here, once
        self._waiting[oid] = (order, fut)  # before the call: the admission may be published first
        try:
            res = await self._call(
                "SUBMIT",
                oid,
                repr(float(order.bid)),
                order.seq,
                order.avoid or "",
                self.hub.replica,
                self.max_waiting,
                cool_for_ms,
                order.requeues,
                "" if order.cap is None else order.cap,
            )
        except BaseException:
            self._waiting.pop(oid, None)
            raise
        if res[0] == "full":
            self._waiting.pop(oid, None)
            raise BookFull(self.product)
        if oid in self._waiting and not res[3]:
            self._resting.add(oid)
        order.seq = int(res[1])
        if entering:
            order.position_at_entry = int(res[2])
        self._level = float(res[5])
        if res[3]:
            self._admitted(oid, res[3])
        else:
            self._pos[oid] = int(res[4])

    def on_admitted(self, order_id: str, deployment: str, price: str, level: str, attempt: int) -> None:
        """The channel offers ``order_id`` a slot: take it up (or decline it if the client left)."""
        entry = self._waiting.get(order_id)
        if entry is None:
            if order_id not in self._held:  # nobody waits for it any more: the slot goes on at once
                self.hub.spawn(self._take(order_id, attempt, accept=False))
            return
        order = entry[0]
        if order.requeues != attempt or order_id in self._taking:
            return  # a late word about an earlier attempt, or already being taken up
        self._taking.add(order_id)
        self.hub.spawn(self._take(order_id, attempt, accept=order.still_wanted()))

    async def _take(self, oid: str, attempt: int, *, accept: bool) -> None:
        try:
            res = await self._call("TAKE", oid, attempt, "1" if accept else "0")
        except BookUnavailable:
            return  # not taken: the offer goes back, or the next heartbeat takes it up
        finally:
            self._taking.discard(oid)
        if res[0] == "taken":
            self._admitted(oid, res[1])
        elif res[0] == "declined":
            self._drop_waiter(oid, ClientGone(oid))
        # 'back': it waits in its place again (its offer expired first); 'gone': withdrawn

    def _drop_waiter(self, oid: str, exc: BaseException) -> None:
        entry = self._waiting.pop(oid, None)
        self._pos.pop(oid, None)
        self._resting.discard(oid)
        if entry is not None and not entry[1].done():
            entry[1].set_exception(exc)

    def _admitted(self, oid: str, held: str) -> None:
        dep, price, level, attempt, bid = held_terms(held)
        self._grant(oid, dep, price, level, attempt, bid)

    def _grant(
        self, oid: str, dep: str, price: float, level: float, attempt: int, bid: float | None = None
    ) -> None:
        """Redis gave ``oid`` the slot (taken up): hand it to the waiter, or give it back."""
        entry = self._waiting.get(oid)
        if entry is not None and entry[0].requeues != attempt:
            return  # a late word about an earlier attempt of a requeued order
        self._pos.pop(oid, None)
        self._resting.discard(oid)
        self._waiting.pop(oid, None)
        if entry is None:
            if oid not in self._held:
                # nobody waits for it any more (client left at this instant)
                self._give_back(oid)
            return
        order, fut = entry
        if fut.done() or not order.still_wanted():
            self._give_back(oid)
            if not fut.done():
                fut.set_exception(ClientGone(oid))
            return
        if bid is not None:  # the bid it cleared at (a raise's answer may come after the offer)
            order.bid = bid
        adm = Admission(order, dep, price, level)
        self._held[oid] = adm
        self._level = level
        br = self._breakers.get(dep)
        if br is not None:
            br.on_admit(self.now())
        fut.set_result(adm)

    async def wait(self, order: Order, fut: asyncio.Future[Admission], deadline: float) -> Admission:
        if fut.done():
            return fut.result()
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.shield(fut)
        except TimeoutError:
            return await self._at_deadline(order, fut)
        except asyncio.CancelledError:
            self.withdraw(order, fut)
            raise

    async def _at_deadline(self, order: Order, fut: asyncio.Future[Admission]) -> Admission:
        """The deadline passed: take the order out, unless it was admitted meanwhile."""
        oid = order.id
        if fut.done() and not fut.cancelled():
            return fut.result()
        self._resting.discard(oid)
        # the order stays registered until Redis answers: an admission arriving
        # meanwhile resolves ``fut`` instead of being given back
        try:
            res = await self._call("REMOVE", oid)
        except BookUnavailable:
            self._orphans.add(oid)
            raise TimeoutError from None
        finally:
            self._waiting.pop(oid, None)
            self._pos.pop(oid, None)
        if fut.done() and not fut.cancelled():
            return fut.result()
        if res[0] == "held":  # admitted at the deadline (an offer is taken up by the REMOVE)
            dep, price, level, _attempt, bid = held_terms(res[1])
            if bid is not None:
                order.bid = bid
            adm = Admission(order, dep, price, level)
            self._held[oid] = adm
            return adm
        raise TimeoutError

    async def rebid(self, order: Order, bid: float) -> bool:
        check_raise(order, bid)
        oid = order.id
        if oid not in self._waiting:
            return False
        res = await self._call("REBID", oid, repr(float(bid)))
        if res[0] != "raised":
            return False  # admitted (at the bid the book had then) or gone
        if oid in self._waiting:  # else granted meanwhile: the grant read the bid it cleared at
            order.bid = max(order.bid, bid)
            if int(res[1]) >= 0:
                self._pos[oid] = int(res[1])
        return True

    def withdraw(self, order: Order, fut: asyncio.Future[Admission]) -> None:
        oid = order.id
        self._pos.pop(oid, None)
        self._resting.discard(oid)
        if self._waiting.pop(oid, None) is not None:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            else:
                self.hub.spawn(self._withdraw(oid))
        elif oid in self._held:
            self.release(self._held[oid])

    async def _withdraw(self, oid: str) -> None:
        try:
            res = await self._call("REMOVE", oid)
        except BookUnavailable:
            self._orphans.add(oid)
            return
        if res[0] == "held":
            await self._release(oid)

    def release(self, admission: Admission) -> None:
        oid = admission.order.id
        self._held.pop(oid, None)
        br = self._breakers.get(admission.deployment)
        if br is not None:
            br.trial_running = False
        self._give_back(oid)

    def _give_back(self, oid: str) -> None:
        """Give ``oid``'s slot back, off the caller's path. The slots given back in one
        turn of the loop, or while the last RELEASE is in flight, go in one call."""
        self._giving_back.append(oid)
        if not self._give_back_running:
            self._give_back_running = True
            self.hub.spawn(self._give_back_pending())

    async def _give_back_pending(self) -> None:
        try:
            while self._giving_back:
                oids, self._giving_back = self._giving_back[:RELEASE_BATCH], self._giving_back[RELEASE_BATCH:]
                await self._release(*oids)
        finally:
            self._give_back_running = False

    async def _release(self, *oids: str) -> None:
        try:
            await self._call("RELEASE", *oids)
        except BookUnavailable:
            self._orphans.update(oids)  # given back once Redis answers again

    async def requeue(self, order: Order, admission: Admission) -> asyncio.Future[Admission]:
        dep = admission.deployment
        self._held.pop(order.id, None)
        cool_for = self._record_failure(dep, order)
        order.avoid = dep
        order.requeues += 1
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        await self._submit(order, fut, cool_for)  # gives the slot back in the same step
        return fut

    # -- breakers -------------------------------------------------------------------

    def _record_failure(self, dep: str, order: Order | None = None) -> int:
        """Record a failure on the local breaker (of ``order``: as :func:`counts_against`
        says); how long the deployment cools (ms from now, at least 1) to share, or 0.
        A duration, not a time: Redis adds it to its own clock, so a replica whose clock
        is off neither cools a deployment for minutes nor not at all."""
        if not self._by_name[dep].availability.ok:
            return 0  # unavailable: held out by the probes, its failures explained already
        br = self._breakers[dep]
        now = self.now()
        if order is not None and not counts_against(order, dep, br):
            return 0
        br.record_failure(now)
        if br.available(now):
            return 0
        return max(1, int((br.open_until - now) * 1000))

    def report_failure(self, deployment: str, order: Order | None = None) -> None:
        cool_for = self._record_failure(deployment, order)
        if cool_for:
            self.hub.spawn(self._call("COOL", deployment, cool_for))

    def attempt_failed(self, admission: Admission) -> None:
        self.hub.spawn(self._call("FAILED", admission.order.id, admission.order.requeues))

    def report_success(self, deployment: str) -> None:
        br = self._breakers.get(deployment)
        if br is None:
            return
        was_open = br.failures >= br.threshold
        br.record_success()
        if was_open:
            self.hub.spawn(self._call("COOL", deployment, 0))

    def add_deployment(self, deployment: Deployment) -> None:
        if deployment.name in {d.name for d in self.deployments}:
            raise ValueError(f"product {self.product!r} has a deployment {deployment.name!r} already")
        self.deployments.append(deployment)
        self._by_name[deployment.name] = deployment
        self._breakers[deployment.name] = deployment.breaker
        self.deployment_changed(deployment.name)

    def retire_deployment(self, deployment: str, *, replacing: bool = False) -> None:
        """Out of the scripts' deployments: no order goes there; the slots held there
        (in the shared ``busy`` hash, by name) come back as their orders finish."""
        d = self._by_name[deployment]
        if len(self.deployments) == 1 and not replacing:
            raise ValueError(f"product {self.product!r} keeps at least one deployment")
        self.deployments.remove(d)
        if replacing:
            return  # added again at once
        self._head = self._make_head()
        self.min_floor = min(x.floor for x in self.deployments)
        self.hub.spawn(self._call("STANDING", ""))

    def waiting_here(self) -> int:
        return len(self._waiting)

    def held_on(self, deployment: str) -> int:
        return sum(1 for a in self._held.values() if a.deployment == deployment)

    def deployment_changed(self, deployment: str) -> None:
        self._head = self._make_head()  # its slots or floor may have changed
        self.min_floor = min(d.floor for d in self.deployments)
        d = self._by_name.get(deployment)
        if d is None or d not in self.deployments:  # probed before it is added, or retired
            self.hub.spawn(self._call("STANDING", ""))
            return
        if not d.availability.ok:
            self._held_out.add(deployment)
            cool_for = max(1, int(d.availability.hold_s * 1000))  # on Redis's clock
            self.hub.spawn(self._call("COOL", deployment, cool_for))
        elif deployment in self._held_out:
            self._held_out.discard(deployment)
            self.hub.spawn(self._call("COOL", deployment, 0))
        else:
            self.hub.spawn(self._call("STANDING", ""))  # a clear with the new slots

    # -- views ----------------------------------------------------------------------

    def level(self) -> float:
        return self._level

    def position(self, order: Order) -> int:
        return self._pos.get(order.id, -1)

    def pace(self) -> Pace:
        return self._pace

    def occupancy(self) -> None:
        return None  # other replicas' slots: in Redis (see :meth:`view`)

    async def standing(self, order: Order | None) -> tuple[float, int]:
        member = "" if order is None or order.id not in self._waiting else f"{order.seq:016d}:{order.id}"
        res = await self._call("STANDING", member)
        self._level = level = float(res[0])
        self._pace = Pace(int(res[2]), float(res[3]) / 1000.0)
        pos = int(res[1])
        if order is not None and pos >= 0:
            self._pos[order.id] = pos
        return level, pos

    def healthy(self) -> bool:
        now = self.now()
        return any(d.can_take(now) for d in self.deployments)

    async def view(self) -> BookView:
        res = await self._call("VIEW", VIEW_BIDS)
        level, waiting, admitted, busy, cool, bids, recent, now_ms, parked, held = res
        self._level = float(level)
        deps = []
        for d, b, c in zip(self.deployments, busy, cool, strict=True):
            cooling = float(c) > 0
            ok, reason = d.availability.ok, d.availability.reason
            deps.append(
                DeploymentView(
                    d.name, d.floor, d.slots, int(b), not cooling, "open" if cooling else "closed", ok, reason
                )
            )
        skew = time.time() - float(now_ms) / 1000.0
        clears = [clear(r, skew) for r in recent]
        if clears:
            self._pace = Pace(len(clears), max(0.0, time.time() - clears[-1].at))
        return BookView(
            level=float(level),
            waiting=int(waiting),
            best_bid=float(bids[0]) if bids else None,
            admitted_total=int(admitted),
            deployments=deps,
            bids=[float(b) for b in bids],
            recent=clears,
            parked=int(parked),
            running=[running(str(held[i]), str(held[i + 1])) for i in range(0, len(held), 2)],
        )

    # -- lifecycle ------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Renew this replica's leases; take up lost offers; rest again what Redis forgot.

        Never raises for an unreachable Redis: after a lease without an answer, the
        orders waiting here fail with :class:`BookUnavailable` (their clients get a 503)."""
        waiting = [oid for oid in self._resting if oid in self._waiting]
        held = list(self._held)
        args = [waiting_terms(self._waiting[oid][0]) for oid in waiting]
        args += [slot_terms(self._held[oid]) for oid in held]
        try:
            res = await self._call("HEARTBEAT", *args)
        except BookUnavailable as exc:
            self._unreachable(exc)
            return
        self._level = float(res[0])
        for oid, st in zip(waiting, res[2 : 2 + len(waiting)], strict=True):
            if oid not in self._resting or oid not in self._waiting:
                continue  # admitted or withdrawn meanwhile
            if st[0] == "w":
                self._pos[oid] = int(st[1:])
            elif st[0] == "h":
                self._admitted(oid, st[1:])
        if self._orphans:
            orphans = list(self._orphans)
            self._orphans.clear()
            await self._release(*orphans)

    def _unreachable(self, exc: BookUnavailable) -> None:
        since = self._answered_at
        if since is None or self.now() - since < self.hub.lease_s or not self._waiting:
            return
        log.warning(
            "cluster: the book of %s has not answered for %.1f s; failing %d waiting orders",
            self.product,
            self.now() - since,
            len(self._waiting),
        )
        for oid in list(self._waiting):
            self._orphans.add(oid)
            self._drop_waiter(oid, BookUnavailable(str(exc)))

    async def start(self) -> None:
        self.hub.register(self)

    async def aclose(self) -> None:
        """Give back what this replica holds (a graceful stop; a crash relies on the leases)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for oid in list(self._waiting):
            await self._call("REMOVE", oid)
        for oid in list(self._held):
            await self._call("RELEASE", oid)
        self._waiting.clear()
        self._resting.clear()
        self._held.clear()
