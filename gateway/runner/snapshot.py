"""A typed, read-only picture of a running runner: what /metrics, /healthz, `status` and doctor read.

``Runner.status()`` builds a ``RunnerSnapshot``; ``BackendStatus.of`` reads one backend. Nothing else
looks at the runner's or a backend's attributes, so either can change inside without breaking the
readers. To show something new, add a field here (with a default) and fill it in
``Runner.status()``; a new counter needs nothing: every ``Counters`` entry is in ``counters``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from gateway import __version__

if TYPE_CHECKING:
    from gateway.observe import Histogram
    from gateway.runner.backend import Backend

HEALTHY_WITHIN_POLLS = 3  # healthy wants a successful poll within this many poll intervals


def safe_url(url: str) -> str:
    """The URL without any ``user:password@`` part (a URL may carry a credential)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


@dataclass(frozen=True)
class HistogramStatus:
    """A histogram at one moment: ``cumulative[i]`` counts the values ≤ ``bounds[i]``."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float
    count: int

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q`` (inf: above every bound)."""
        if self.count == 0:
            return None
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= q * self.count:
                return bound
        return float("inf")

    @classmethod
    def of(cls, hist: Histogram) -> HistogramStatus:
        running, cumulative = 0, []
        for count in hist.counts[: len(hist.buckets)]:
            running += count
            cumulative.append(running)
        return cls(tuple(hist.buckets), tuple(cumulative), hist.sum, hist.count)


@dataclass(frozen=True)
class BackendStatus:
    """One backend at one moment (its URL without credentials)."""

    name: str
    url: str
    up: bool = True
    down_reason: str | None = None
    in_flight: int = 0
    waiting: int = 0
    models: tuple[str, ...] = ()
    turns: int = 0  # turns given a slot, ever
    waits: int = 0  # turns that queued for a slot
    waited_seconds: float = 0.0  # their time in the queue, summed
    busy: int = 0  # turns refused: every slot taken and the queue full

    @classmethod
    def of(cls, backend: Backend) -> BackendStatus:
        return cls(
            name=backend.name,
            url=safe_url(backend.url),
            up=backend.up,
            down_reason=backend.down_reason,
            in_flight=backend.in_flight,
            waiting=backend.waiting,
            models=backend.models,
            turns=backend.turns_total,
            waits=backend.waits_total,
            waited_seconds=backend.waited_seconds_total,
            busy=backend.busy_total,
        )

    @property
    def label(self) -> str:
        return self.name or self.url


@dataclass(frozen=True)
class RunnerSnapshot:
    """The runner at one moment. ``last_poll_age`` is seconds since the last good poll (None: none yet)."""

    max_sessions: int
    poll_interval: float
    ping_interval: float = 0.0  # the channel keepalive's interval (0: off)
    sessions_open: int = 0
    shutting_down: bool = False
    last_poll_age: float | None = None
    last_poll_error: str | None = None
    backends: tuple[BackendStatus, ...] = ()
    counters: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    histograms: Mapping[str, HistogramStatus] = field(default_factory=lambda: MappingProxyType({}))
    version: str = __version__

    def __post_init__(self) -> None:  # read-only all the way down
        object.__setattr__(self, "counters", MappingProxyType(dict(self.counters)))
        object.__setattr__(self, "histograms", MappingProxyType(dict(self.histograms)))
        object.__setattr__(self, "backends", tuple(self.backends))

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): a poll succeeded within 3 poll intervals and a backend is up."""
        if self.shutting_down:
            return False, "shutting down"
        error = f": {self.last_poll_error}" if self.last_poll_error else ""
        if self.last_poll_age is None:
            return False, f"no successful poll yet{error}"
        limit = HEALTHY_WITHIN_POLLS * self.poll_interval
        if self.last_poll_age > limit:
            return (
                False,
                f"last successful poll {self.last_poll_age:.1f} s ago (limit {limit:g} s){error}",
            )
        if not self.backends:
            return False, "no backend configured"
        if not any(b.up for b in self.backends):
            return False, "no backend is up: " + ", ".join(b.label for b in self.backends)
        return True, "ok"
