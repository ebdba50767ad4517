"""The hub's Prometheus metrics (``GET /metrics``, behind the admin credential) and the per-key
totals the status page shows.

``HubMetrics.observe`` is one of the usage book's observers (``UsageBook.observers``): it is told
of every ended turn, once, and keeps its counters and histograms in plain dicts and lists here
(nothing is done per chunk). What is true at scrape time (runners connected, sessions, turns in
flight, the ``HubCounters``, the queue) is read from the hub then. Rendered by
``prometheus_client`` through a private registry with one custom collector, as the runner's
``gateway.ops.metrics`` does (imported only when ``/metrics`` is scraped).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from gateway.hub import turns
from gateway.hub.turns import TurnRecord

if TYPE_CHECKING:
    from gateway.hub.hub import Hub

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "alp_hub_"
# seconds: from a few ms (a local model's first token) to minutes (a long agent turn)
TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LIMIT_STATUS = 429  # a turn refused with it passed one of its key's limits
NO_MODEL = ""  # the label of a turn that named no model (the runner's default)
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


class Histogram:
    """Observations in fixed buckets (counts per bucket; cumulated when rendered)."""

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # the last bucket (+Inf) is ``count`` minus their sum
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        slot = bisect.bisect_left(self.bounds, value)
        if slot < len(self.bounds):
            self.counts[slot] += 1
        self.count += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` for each bound and ``+Inf``, as Prometheus wants them."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip(self.bounds, self.counts, strict=True):
            total += n
            out.append((repr(float(bound)), total))
        out.append(("+Inf", self.count))
        return out


@dataclass
class KeyTotals:
    """One API key's ended turns since the hub started (for the status page)."""

    turns: int = 0  # the turns refused with 429 not among them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refused: int = 0  # turns refused with 429 (a limit of the key passed)
    last_used: float | None = None  # trio clock of the last turn's end

    def as_json(self) -> dict[str, Any]:
        found = asdict(self)
        return {
            "turns": found["turns"],
            "promptTokens": found["prompt_tokens"],
            "completionTokens": found["completion_tokens"],
            "refused": found["refused"],
        }


class HubMetrics:
    """Counters and histograms of the hub's ended turns, kept in memory since it started."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        # (key name, model, outcome) -> turns
        self.turns: dict[tuple[str, str, str], int] = {}
        # (key name, model, "prompt" | "completion") -> tokens
        self.tokens: dict[tuple[str, str, str], int] = {}
        self.refusals: dict[str, int] = {}  # key name -> turns refused with 429
        self.ttft: dict[str, Histogram] = {}  # model -> time to first token
        self.duration: dict[str, Histogram] = {}  # model -> whole turn
        self.keys: dict[str, KeyTotals] = {}  # key name -> its totals (the page)

    def observe(self, record: TurnRecord) -> None:
        """One ended turn (a ``UsageBook`` observer: called once per turn, never per chunk)."""
        model = record.model or NO_MODEL
        outcome = record.outcome or turns.LOST
        key = record.key_name
        label = (key, model, outcome)
        self.turns[label] = self.turns.get(label, 0) + 1
        totals = self.keys.get(key)
        if totals is None:
            totals = self.keys[key] = KeyTotals()
        totals.last_used = record.ended
        if record.prompt_tokens:
            tk = (key, model, "prompt")
            self.tokens[tk] = self.tokens.get(tk, 0) + record.prompt_tokens
            totals.prompt_tokens += record.prompt_tokens
        if record.completion_tokens:
            tk = (key, model, "completion")
            self.tokens[tk] = self.tokens.get(tk, 0) + record.completion_tokens
            totals.completion_tokens += record.completion_tokens
        if outcome == turns.REFUSED and record.extra.get("status") == LIMIT_STATUS:
            self.refusals[key] = self.refusals.get(key, 0) + 1
            totals.refused += 1
        else:
            totals.turns += 1
        ttft = record.ttft
        if ttft is not None and ttft >= 0:
            self._histogram(self.ttft, model, TTFT_BOUNDS).observe(ttft)
        duration = record.duration
        if duration is not None and duration >= 0 and record.runner_id is not None:
            self._histogram(self.duration, model, DURATION_BOUNDS).observe(duration)

    @staticmethod
    def _histogram(table: dict[str, Histogram], model: str, bounds: tuple[float, ...]) -> Histogram:
        found = table.get(model)
        if found is None:
            found = table[model] = Histogram(bounds)
        return found

    # -- rendering ------------------------------------------------------------------

    def families(self) -> Iterator[Any]:
        """Everything as ``prometheus_client`` metric families (what the collector yields)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        hub = self.hub
        board = hub.board
        door = hub.frontdoor
        turns_family = CounterMetricFamily(
            PREFIX + "turns",
            "Front-door turns ended, by API key name, model and outcome.",
            labels=["key", "model", "outcome"],
        )
        for (key, model, outcome), n in sorted(self.turns.items()):
            turns_family.add_metric([key, model, outcome], n)
        yield turns_family
        tokens = CounterMetricFamily(
            PREFIX + "tokens",
            "Tokens of ended turns (from the backends' usage), by key name, model and kind.",
            labels=["key", "model", "kind"],
        )
        for (key, model, kind), n in sorted(self.tokens.items()):
            tokens.add_metric([key, model, kind], n)
        yield tokens
        refusals = CounterMetricFamily(
            PREFIX + "limit_refusals",
            "Turns refused with 429 (a limit of their API key passed), by key name.",
            labels=["key"],
        )
        for key, n in sorted(self.refusals.items()):
            refusals.add_metric([key], n)
        yield refusals
        for name, table, help_text in (
            ("ttft_seconds", self.ttft, "Time from a turn's arrival to its first chunk sent."),
            ("turn_duration_seconds", self.duration, "Time from a turn's arrival to its end."),
        ):
            family = HistogramMetricFamily(PREFIX + name, help_text, labels=["model"])
            for model, hist in sorted(table.items()):
                family.add_metric([model], hist.buckets(), sum_value=hist.sum)
            yield family
        alive = [rid for rid in board.runners if board.alive(rid)]
        yield GaugeMetricFamily(
            PREFIX + "runners_up",
            "Runners that gave a sign of life within offline_after.",
            len(alive),
        )
        yield GaugeMetricFamily(
            PREFIX + "runners_connected",
            "Runners with an open Chat Channel.",
            len(hub.runners_connected),
        )
        yield GaugeMetricFamily(
            PREFIX + "channels_open", "Chat Channels open now.", len(hub.open_channels())
        )
        yield GaugeMetricFamily(
            PREFIX + "sessions", "Front-door chat sessions live now.", len(door.sessions.live)
        )
        yield GaugeMetricFamily(
            PREFIX + "turns_in_flight",
            "Front-door turns being served now.",
            len(door.usage.in_flight),
        )
        queue_stats = getattr(door.sessions, "queue_stats", None)
        if callable(queue_stats):
            yield from _queue_families(queue_stats(), GaugeMetricFamily, CounterMetricFamily)
        for name, value in asdict(hub.counters).items():
            yield CounterMetricFamily(
                PREFIX + _NOT_A_NAME.sub("_", name),
                f"Counted since the hub started: {name.replace('_', ' ')} (HubCounters).",
                value,
            )

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        from prometheus_client.exposition import generate_latest
        from prometheus_client.registry import Collector, CollectorRegistry

        metrics = self

        class _Hub(Collector):
            def collect(self) -> Iterator[Any]:
                return metrics.families()

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Hub())
        return generate_latest(registry).decode()


# QueueStats fields that only grow (counters); the other numbers are gauges
_QUEUE_COUNTERS = {"waits", "wait_seconds"}


def _queue_families(stats: Any, gauge: Any, counter: Any) -> Iterator[Any]:
    """The sessions' queues (``Sessions.queue_stats()``, where it exists): each number as
    ``alp_hub_queue_<name>``, a mapping of numbers (``depth`` by project) with a label."""
    if hasattr(stats, "__dataclass_fields__"):
        stats = {name: getattr(stats, name) for name in stats.__dataclass_fields__}
    if not isinstance(stats, dict):
        return
    for name, value in sorted(stats.items()):
        metric = PREFIX + "queue_" + _NOT_A_NAME.sub("_", str(name))
        help_text = f"The front door's queues: {str(name).replace('_', ' ')}."
        if _is_number(value):
            kind = counter if name in _QUEUE_COUNTERS else gauge
            yield kind(metric, help_text, value)
        elif isinstance(value, dict) and all(_is_number(v) for v in value.values()):
            label = "project" if name == "depth" else "name"
            family = gauge(metric, help_text, labels=[label])
            for key, number in sorted(value.items()):
                family.add_metric([str(key)], number)
            yield family


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
