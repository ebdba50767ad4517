"""The runner's one retry delay: exponential backoff with jitter. Pure: no I/O, no trio."""

from __future__ import annotations

import random


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: ``base·2^(n-1)`` scaled by U(0.5, 1], never above ``cap``."""
    raw = min(cap, base * (2 ** max(0, failures - 1)))
    return raw * random.uniform(0.5, 1.0)
