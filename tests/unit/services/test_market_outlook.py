"""The shared book's view as the wait forecast reads it (:mod:`bourse.services.market_outlook`):
an order that rests is predicted from a view just read (one read serving the orders
resting together), the frames and the quotes from one up to half a second old, and an
older read that ends later does not replace a newer view."""

from __future__ import annotations

import asyncio

import pytest

from bourse.domain.book import Deployment, Order
from bourse.ports.book import BookView, DeploymentView
from bourse.services.market_outlook import VIEW_FRESH_S, WAIT_VIEW_FRESH_S, Outlook

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


DEP = Deployment("d", 0.1, 2)


class SharedBook:
    """A shared book's view only (what :class:`Outlook` asks of it): each read answers
    the busy slots it was told, after ``delay`` seconds."""

    product = "p"
    min_floor = 0.1

    def __init__(self) -> None:
        self.reads = 0
        self.busy = 0
        self.delays: list[float] = []

    def occupancy(self) -> None:
        return None

    def held_on(self, deployment: str) -> int:
        return 0

    async def view(self) -> BookView:
        self.reads += 1
        busy = self.busy
        await asyncio.sleep(self.delays.pop(0) if self.delays else 0.0)
        return BookView(1.0, 0, None, 0, [DeploymentView("d", 0.1, 2, busy, True, "closed")])


def _outlook(book: SharedBook, clock: list[float]) -> Outlook:
    outlook = Outlook(book, lambda: [DEP], 256)  # type: ignore[arg-type]
    outlook.now = lambda: clock[0]  # type: ignore[method-assign]
    return outlook


async def test_an_order_resting_in_a_shared_book_is_predicted_from_a_view_just_read() -> None:
    """Half a second is long in a book whose slots turn over every second: the view the
    frames use may name a run that has ended since and its slot taken again; the
    prediction an order rests with (and is scored by) is from a view just read."""
    book, clock = SharedBook(), [100.0]
    outlook = _outlook(book, clock)
    await outlook.fresh_state()
    assert book.reads == 1
    book.busy = 2  # the slots turned over since
    clock[0] += 0.3
    assert (await outlook.fresh_state()).deployments[0].busy == 0  # a quote: the view of 0.3 s ago
    assert book.reads == 1
    assert (await outlook.wait_state()).deployments[0].busy == 2  # an order resting: read again
    assert book.reads == 2
    clock[0] += WAIT_VIEW_FRESH_S / 2
    await outlook.wait_state()  # read a moment ago: it stands
    assert book.reads == 2
    clock[0] += VIEW_FRESH_S
    await outlook.fresh_state()
    assert book.reads == 3


async def test_orders_resting_together_share_one_read_of_the_view() -> None:
    book, clock = SharedBook(), [100.0]
    outlook = _outlook(book, clock)
    book.delays = [0.01]
    outlook.state()  # stale: a read begins in the background
    await asyncio.gather(*(outlook.wait_state() for _ in range(5)))  # they wait for it
    assert book.reads == 1
    clock[0] += 2 * VIEW_FRESH_S
    book.delays = [0.01]
    outlook.state()  # stale again: a read begins
    await asyncio.sleep(0)
    clock[0] += 2 * WAIT_VIEW_FRESH_S  # a read begun too long ago: not waited for
    await outlook.wait_state()
    assert book.reads == 3


async def test_an_older_read_that_ends_later_does_not_replace_a_newer_view() -> None:
    book, clock = SharedBook(), [100.0]
    outlook = _outlook(book, clock)
    book.delays = [0.05]  # the background read is slow
    outlook.state()
    await asyncio.sleep(0)
    book.busy = 2
    clock[0] += 1.0
    assert (await outlook.wait_state()).deployments[0].busy == 2
    await asyncio.sleep(0.06)  # the older read ends now
    assert outlook.state().deployments[0].busy == 2


async def test_a_waiting_orders_frame_is_predicted_from_a_view_just_read_unless_the_book_is_unreachable() -> (
    None
):
    book, clock = SharedBook(), [100.0]
    outlook = _outlook(book, clock)
    await outlook.fresh_state()
    clock[0] += 0.3
    order = Order("o", 1.0, 1, 100.0)
    await outlook.wait(order, 0, read=False)  # the book did not answer its standing: the last view
    assert book.reads == 1
    await outlook.wait(order, 0)
    assert book.reads == 2
