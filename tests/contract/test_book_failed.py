"""Failed attempts in the book's view, over both adapters (the fixtures of
``test_book``): an admission whose run failed before any output is marked ``failed``
in ``view().recent`` (by its order and attempt), and :func:`~bourse.ports.book.cleared`
leaves it out; the admission that follows a requeue is a clear of its own."""

from __future__ import annotations

import pytest

from bourse.ports.book import BookView, cleared
from tests.contract.cluster import eventually
from tests.contract.test_book import Books, admitted, book_backend, make_book, now_admitted, submit

__all__ = ["book_backend", "make_book"]  # the fixtures, used by name

pytestmark = pytest.mark.anyio


def _entries(view: BookView) -> list[tuple[str, str, int, bool]]:
    return [(c.deployment, c.order_id, c.attempt, c.failed) for c in view.recent]


async def test_a_failed_attempt_is_marked_and_is_no_clear(make_book: Books) -> None:
    book = await make_book([("dead", 0.1, 1), ("ok", 0.2, 1)])
    order, fut = await submit(book, "o1", 0.5)
    first = now_admitted(fut)
    assert first.deployment == "dead"  # the cheapest
    book.attempt_failed(first)  # before the requeue: the attempt is the one that failed
    again = await admitted(book, order, await book.requeue(order, first))
    assert (again.deployment, again.price) == ("ok", 0.2)
    _, fut2 = await submit(book, "o2", 0.3)  # a clear of its own on the cheap one (it runs)
    other = now_admitted(fut2)
    assert other.deployment == "dead"
    want = [("dead", "o2", 0, False), ("ok", "o1", 1, False), ("dead", "o1", 0, True)]
    view = await book.view()

    async def marked() -> bool:
        nonlocal view
        view = await book.view()
        return _entries(view) == want

    await eventually(marked, what=f"the failed attempt marked (recent: {_entries(view)})")
    assert [(c.deployment, c.price, c.bid) for c in cleared(view.recent)] == [
        ("dead", 0.1, 0.3), ("ok", 0.2, 0.5)
    ]  # fmt: skip
    assert view.admitted_total == 3  # admissions, the failed attempt among them

    book.attempt_failed(other)
    want[0] = ("dead", "o2", 0, True)
    await eventually(marked, what="the second failed attempt marked")
    assert [c.deployment for c in cleared(view.recent)] == ["ok"]
    for adm in (again, other):
        book.release(adm)
