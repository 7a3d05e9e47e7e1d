"""The in-process rate limiter (the single-node adapter of the limits port).

Everything happens synchronously on the event loop, so each acquire is atomic.
"""

from __future__ import annotations

import time

from bourse.domain.ratelimit import KeyState, bucket
from bourse.ports.limits import Decision, KeyLimits


class MemoryRateLimiter:
    def __init__(self, max_keys: int = 1_000_000) -> None:
        self._state: dict[str, KeyState] = {}
        self._max_keys = max_keys

    def _key(self, key_id: str) -> KeyState:
        st = self._state.get(key_id)
        if st is None:
            if len(self._state) >= self._max_keys:
                self._state.clear()  # bounded memory; limits restart from full buckets
            st = self._state[key_id] = KeyState()
        return st

    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int) -> Decision:
        return self.acquire_now(key_id, limits, tokens, time.monotonic())

    def acquire_now(self, key_id: str, limits: KeyLimits, tokens: int, now: float) -> Decision:
        st = self._key(key_id)
        headers: dict[str, str] = {}
        if limits.max_streams is not None and st.streams >= limits.max_streams:
            return Decision(
                False,
                f"this key already has {st.streams} requests in flight (limit {limits.max_streams})",
                1.0,
                {"x-ratelimit-limit-streams": str(limits.max_streams)},
            )
        req = tok = None
        if limits.rpm is not None:
            req = st.requests = bucket(st.requests, limits.rpm, now)
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
            wait = req.wait_for(1.0)
            if wait > 0:
                headers["x-ratelimit-remaining-requests"] = "0"
                headers["x-ratelimit-reset-requests"] = f"{wait:.3f}s"
                return Decision(False, f"over {limits.rpm} requests per minute", wait, headers)
        if limits.tpm is not None:
            tok = st.tokens = bucket(st.tokens, limits.tpm, now)
            need = min(float(tokens), tok.capacity)
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
            wait = tok.wait_for(need)
            if wait > 0:
                headers["x-ratelimit-remaining-tokens"] = str(int(tok.level))
                headers["x-ratelimit-reset-tokens"] = f"{wait:.3f}s"
                return Decision(False, f"over {limits.tpm} tokens per minute", wait, headers)
        if req is not None:
            req.level -= 1.0
            headers["x-ratelimit-remaining-requests"] = str(int(req.level))
            headers["x-ratelimit-reset-requests"] = f"{req.reset_s():.3f}s"
        if tok is not None:
            tok.level -= min(float(tokens), tok.capacity)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, int(tok.level)))
            headers["x-ratelimit-reset-tokens"] = f"{tok.reset_s():.3f}s"
        st.streams += 1
        return Decision(True, headers=headers)

    async def finish(self, key_id: str, limits: KeyLimits, reserved_tokens: int, used_tokens: int) -> None:
        st = self._state.get(key_id)
        if st is None:
            return
        st.streams = max(0, st.streams - 1)
        if st.tokens is not None and limits.tpm is not None:
            back = min(float(reserved_tokens), st.tokens.capacity) - used_tokens
            if back > 0:
                st.tokens.level = min(st.tokens.capacity, st.tokens.level + back)
