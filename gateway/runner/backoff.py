"""The runner's waits: a retry's backoff with jitter, a poll's timer spread. Pure: no I/O, no trio."""

from __future__ import annotations

import random


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: ``base·2^(n-1)`` scaled by U(0.5, 1], never above ``cap``."""
    raw = min(cap, base * (2 ** max(0, failures - 1)))
    return raw * random.uniform(0.5, 1.0)


POLL_SPREAD = 0.2  # a poll's timer shortened by up to this share of the interval, at random


def poll_delay(interval: float) -> float:
    """The wait until the next poll: ``interval`` shortened by U[0, POLL_SPREAD) of it. A push
    wakes a fleet's runners at one instant; equal timers after it would keep their polls in
    bursts for ever, spread ones drift apart (never later than ``interval``)."""
    return interval * (1.0 - POLL_SPREAD * random.random())
