"""The products the Responses API tests run on (priced, so that every charge shows)."""

from __future__ import annotations

from tests.support.config import Dep, Product

FLOOR = 1.0
"""USD per 1M tokens: one micro-USD a token, so every charge is visible."""

PRODUCTS = [
    Product("fast", [Dep("fast-a", slots=4, floor=FLOOR, sim={"output_tokens": 6})]),
    Product("one", [Dep("one-a", slots=1, floor=FLOOR)]),
    Product("slow", [Dep("slow-a", slots=4, floor=FLOOR, sim={"tokens_per_s": 20, "output_tokens": 60})]),
    Product("fail", [Dep("fail-a", floor=FLOOR, sim={"fail_after_tokens": 3, "output_tokens": 10})]),
    Product("think", [Dep("think-a", floor=FLOOR, sim={"reasoning": True, "output_tokens": 5})]),
]
SERVER = {"quiet_interval_s": 0.2}
