"""Money: integer micro-USD, prices, quotes and charges (pure).

Prices on the API are USD per million tokens (floats such as ``0.10``). Inside,
a price is an integer number of *price units*: micro-USD per million tokens
(``0.10`` -> ``100_000``), so that a cost is exact integer arithmetic::

    cost_micros = ceil(tokens * price_units / 1_000_000)

A cost is rounded up to the next micro-USD once per request. Prompt and
completion tokens are priced alike.
"""

from __future__ import annotations

MICROS_PER_USD = 1_000_000
PER_MILLION = 1_000_000
MESSAGE_OVERHEAD_TOKENS = 8
"""Quote allowance per chat message (role markers, separators of chat templates)."""
REQUEST_OVERHEAD_TOKENS = 8
MAX_PRICE_USD = 1_000_000.0
"""The highest bid accepted, USD per 1M tokens (a dollar a token): every quote, hold and
charge then fits the ledger's 64-bit integers."""


def price_units(usd_per_million: float) -> int:
    """USD per 1M tokens -> micro-USD per 1M tokens (rounded to the nearest unit)."""
    if usd_per_million < 0:
        raise ValueError("a price cannot be negative")
    return round(usd_per_million * MICROS_PER_USD)


def usd_to_micros(usd: float) -> int:
    return round(usd * MICROS_PER_USD)


def micros_to_usd(micros: int) -> float:
    return micros / MICROS_PER_USD


def usd_text(micros: int) -> str:
    """``micros`` as USD with six decimals (``3`` -> ``"0.000003"``): exact, never in
    scientific notation, whatever its size."""
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    return f"{'-' if micros < 0 else ''}{whole}.{frac:06d}"


def cost_micros(tokens: int, units: int) -> int:
    """``tokens`` at ``units`` (micro-USD per 1M tokens), rounded up once."""
    if tokens < 0 or units < 0:
        raise ValueError("tokens and prices are not negative")
    return -(-(tokens * units) // PER_MILLION)


def affordable_tokens(balance_micros: int, units: int) -> int:
    """How many tokens ``balance_micros`` pays for at ``units``."""
    if units <= 0:
        return 10**18
    return max(balance_micros, 0) * PER_MILLION // units


def quote_tokens(prompt_bytes: int, messages: int, max_output_tokens: int) -> int:
    """A conservative upper bound on a request's tokens: one token per prompt UTF-8
    byte (no tokenizer makes more tokens than bytes), an allowance per message, and
    the whole output budget."""
    return prompt_bytes + messages * MESSAGE_OVERHEAD_TOKENS + REQUEST_OVERHEAD_TOKENS + max_output_tokens


def charge(prompt_tokens: int, completion_tokens: int, units: int, hold_micros: int) -> tuple[int, int]:
    """What a request pays, and what its tokens cost beyond that: its tokens at the
    cleared price up to its hold, the rest unpaid. This is the one cap of a charge (the
    ledger refuses a charge above its hold rather than clamp it); the caller records
    the unpaid rest (a hold is an upper bound, so any is an engine's count past it)."""
    cost = cost_micros(prompt_tokens + completion_tokens, units)
    paid = min(cost, hold_micros)
    return paid, cost - paid
