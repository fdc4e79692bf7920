"""Per-token rate limiting: one token bucket per key (the caller's user id), refilled continuously.

A bucket holds at most ``burst`` tokens and gains ``rate`` tokens per second; a request takes one. When the
bucket is empty the request is refused with the seconds until the next token (the ``Retry-After`` the
server sends with its 429). ``rate <= 0`` disables the limit. The clock is injectable for tests.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable


class TokenBuckets:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if rate > 0 and burst < 1:
            raise ValueError(f"burst must be at least 1 when rate limiting is on (got {burst})")
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, time of last refill)
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> float:
        """Take one token for ``key``: 0.0 if allowed, else the seconds to wait before retrying."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate

    @staticmethod
    def retry_after_header(wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))
