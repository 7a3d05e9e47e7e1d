"""Live market terms (:mod:`bourse.live_terms`, issue 37): what an edited config file
changes in place (floors, slots, default bids) and what only a restart applies; the
book under a change (fewer slots admit nothing new until the slots in use fall under
them, nothing running is cut; a new floor prices the orders admitted after it)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bourse.coordination.book_local import LocalBook
from bourse.domain.book import Admission, Deployment, ProductBook
from bourse.live_terms import Change, sections_changed
from bourse.market_desk import Plan, parse_products, plan, products_doc
from bourse.settings import parse_config


def _config(floor: float = 1.0, slots: int | None = 2, **product: Any) -> Any:
    dep: dict[str, Any] = {"engine": "sim", "name": "a", "floor": floor}
    if slots is not None:
        dep["slots"] = slots
    return parse_config({"products": {"p": {**product, "deployments": [dep]}}}, "test", env={})


def _plan(old: Any, new: Any) -> Plan:
    return plan(dict(old.products), dict(new.products))


def test_floors_slots_and_default_bids_are_live_terms() -> None:
    found = _plan(_config(), _config(floor=2.5, slots=1, default_bid=3.0))
    assert set(found.changed["p"].terms) == {
        Change("p", "a", "floor", 1.0, 2.5),
        Change("p", "a", "slots", 2, 1),
        Change("p", None, "default_bid", None, 3.0),
    }
    assert not found.added and not found.removed and not found.changed["p"].rebuilt
    assert Change("p", "a", "slots", 2, None).line() == "p/a slots: 2 -> unset"
    assert Change("p", "a", "floor", 1.0, 2.5).line() == "p/a floor: 1 -> 2.5"


def test_products_deployments_and_engines_are_planned_each_as_what_changes_them() -> None:
    live = _config()
    edited = parse_config(
        {
            "server": {"book_timeout_s": 12},
            "products": {
                "p": {"policy": "hips", "deployments": [{"engine": "sim", "name": "a", "tokens_per_s": 9},
                                                        {"engine": "sim", "name": "b"}]},
                "q": {"deployments": [{"engine": "sim"}]},
            },
        },
        "test",
        env={},
    )  # fmt: skip
    found = _plan(live, edited)
    assert set(found.lines(dict(edited.products))) == {
        "product q added",
        "product p: policy changed",
        "deployment p/b added",
        "deployment p/a: tokens_per_s changed",
    }, found.lines(dict(edited.products))
    assert sections_changed(live, edited) == ["[server] changed"]
    back = _plan(edited, live)
    assert back.removed == ["q"] and back.changed["p"].removed == ["b"]


def test_a_product_table_round_trips_through_the_database_form() -> None:
    cfg = parse_config(
        {"products": {"p": {"policy": "hips", "quiet_interval_s": 3.0, "default_bid": 2.0,
                            "deployments": [{"engine": "sim", "name": "a", "floor": 1.5, "n_ctx": 512}]}}},
        "test",
        env={},
    )  # fmt: skip
    doc = products_doc(cfg.products)
    assert doc == {"p": {"policy": "hips", "quiet_interval_s": 3.0, "default_bid": 2.0,
                         "deployments": [{"engine": "sim", "name": "a", "floor": 1.5, "n_ctx": 512}]}}  # fmt: skip
    again = parse_products(doc, "test")
    assert again == dict(cfg.products) and not _plan(cfg, cfg).changed
    assert again["p"].deployments[0].model_fields_set == cfg.products["p"].deployments[0].model_fields_set


def _book(slots: int, floor: float = 1.0) -> tuple[LocalBook, Deployment]:
    d = Deployment("a", floor, slots)
    return LocalBook(ProductBook("p", [d])), d


async def _orders(book: LocalBook, bids: list[float]) -> list[asyncio.Future[Admission]]:
    return [await book.submit(book.new_order(f"o{i}", bid)) for i, bid in enumerate(bids)]


@pytest.mark.anyio
async def test_fewer_slots_admit_nothing_new_until_the_slots_in_use_fall_under_them() -> None:
    book, d = _book(3)
    futs = await _orders(book, [5.0, 5.0, 5.0, 4.0, 3.0])
    running = [f.result() for f in futs[:3]]
    assert d.busy == 3 and book.book.waiting == 2
    d.resize(1)
    book.deployment_changed("a")
    book.book.check()  # busy 3 over slots 1: allowed while they run (excess 2)
    assert (d.busy, d.excess) == (3, 2)
    for adm in running[:2]:
        book.release(adm)
        book.book.check()
        assert not futs[3].done(), "admitted while the slots in use were at or above the new count"
    assert (d.busy, d.excess) == (1, 0)
    book.release(running[2])
    assert futs[3].done() and not futs[4].done()  # one slot: the best waiting order
    assert d.busy == 1
    book.book.check()


@pytest.mark.anyio
async def test_more_slots_admit_waiting_orders_at_once() -> None:
    book, d = _book(1)
    futs = await _orders(book, [5.0, 4.0, 3.0])
    assert [f.done() for f in futs] == [True, False, False]
    d.resize(3)
    book.deployment_changed("a")
    assert all(f.done() for f in futs) and d.busy == 3
    book.book.check()


@pytest.mark.anyio
async def test_a_new_floor_prices_the_orders_admitted_after_it_and_not_those_before() -> None:
    book, d = _book(1, floor=1.0)
    first = (await _orders(book, [5.0]))[0].result()
    assert first.price == 1.0
    d.floor = 2.0
    book.deployment_changed("a")
    assert book.min_floor == 2.0 and book.book.min_floor == 2.0
    later = await book.submit(book.new_order("later", 5.0))
    book.release(first)
    assert later.result().price == 2.0 and first.price == 1.0
    cheap = await book.submit(book.new_order("cheap", 1.5))  # under the new floor: it waits
    book.release(later.result())
    assert not cheap.done()


def test_slots_cannot_go_under_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Deployment("a", 0.0, 2).resize(0)


@pytest.mark.anyio
async def test_a_retired_deployment_takes_no_order_and_its_running_ones_finish() -> None:
    book, _ = _book(2)
    b = Deployment("b", 3.0, 1)
    book.add_deployment(b)
    futs = await _orders(book, [5.0, 5.0, 5.0, 5.0])
    running = [f.result() for f in futs[:3]]
    assert sorted(r.deployment for r in running) == ["a", "a", "b"] and not futs[3].done()
    book.retire_deployment("a")
    book.book.check()
    assert book.book.busy_slots() == 3 and book.held_on("a") == 2
    for adm in running:
        if adm.deployment == "a":
            book.release(adm)
            book.book.check()
            assert not futs[3].done(), "an order went to a retired deployment"
    assert book.held_on("a") == 0 and [d.name for d in book.book.deployments] == ["b"]
    book.release(next(r for r in running if r.deployment == "b"))
    assert futs[3].done() and futs[3].result().deployment == "b"
    with pytest.raises(ValueError, match="at least one"):
        book.retire_deployment("b")


@pytest.mark.anyio
async def test_a_deployment_built_again_takes_over_the_slots_of_the_one_it_replaces() -> None:
    book, _ = _book(2)
    futs = await _orders(book, [5.0, 5.0, 5.0])
    running = [f.result() for f in futs[:2]]
    book.retire_deployment("a", replacing=True)
    again = Deployment("a", 1.0, 1)
    book.add_deployment(again)
    book.book.check()
    assert (again.busy, again.excess) == (2, 1)  # over its one slot while they run
    book.release(running[0])
    assert not futs[2].done()
    book.release(running[1])
    assert futs[2].done() and again.busy == 1
    book.book.check()
