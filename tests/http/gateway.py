"""The products of the HTTP tests' in-process gateway: one per preset of SPEC section
12 (named after it), ``knobs`` (the default policy with knobs set one by one),
``default-slow``, ``hips-slow`` and ``openfill-slow`` (a short quiet interval), ``flaky`` (failures
before output; its breaker never opens) and ``single`` (one slot).
Every floor is 1 USD per 1M tokens (one micro-USD per token), so a receipt's cost is
its token count.
"""

from __future__ import annotations

from bourse.domain import policy
from tests.support.config import Dep, Product, config_toml

FLOOR = 1.0
"""USD per 1M tokens: one micro-USD per token."""
MAX_BODY = 4096
PRESETS = tuple(policy.PRESETS)

PRODUCTS = [
    *(Product(name, [Dep(f"{name}-a", floor=FLOOR)], {"policy": name}) for name in PRESETS),
    Product(
        "knobs",
        [Dep("knobs-a", floor=FLOOR)],
        {
            "policy": "default",
            "usage_chunk": "always",
            "done_after_error": False,
            "error_frame": "envelope",
            "error_finish_reason": True,
            "reasoning_field": "reasoning",
        },
    ),
    # the engine silent before its first token for longer than a (short) quiet interval
    *(
        Product(
            f"{name}-slow", [Dep(f"{name}-slow-a", floor=FLOOR)], {"policy": name, "quiet_interval_s": 0.05}
        )
        for name in ("default", "hips", "openfill")
    ),
    # failures before output: the breaker never opens, so each test sees a healthy deployment
    Product("flaky", [Dep("flaky-a", floor=FLOOR, extra={"breaker_threshold": 1000})]),
    # one slot, for jobs that wait in the book
    Product("single", [Dep("single-a", slots=1, floor=FLOOR)]),
]


def config() -> str:
    """The gateway's config file text."""
    return config_toml(PRODUCTS, server={"max_body_bytes": MAX_BODY})
