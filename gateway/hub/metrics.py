"""The hub's Prometheus metrics (``GET /metrics``, behind the admin credential) and the per-key
totals the status page shows.

``HubMetrics.observe`` is one of the accounting's observers: it is told of every ended turn,
once, and keeps its counters and histograms in plain dicts here (nothing is done per chunk).
What is true at scrape time (runners, channels, sessions, turns in flight, the counters, the
queues) comes from the hub's ``HubSnapshot``. Rendered by ``prometheus_client`` through a
private registry with one custom collector (imported only when ``/metrics`` is scraped).

A replica of a team shows its own turns and channels, as every hub does, and says which replica
it is in one info metric (``alp_hub_replica_info{replica, url, version} 1``); a hub serving
alone has none. Its series carry no ``replica`` label of their own: the scrape's target labels
(``instance``) tell replicas apart, and a query joins the id on where it wants it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.hub.snapshot import HubSnapshot
from gateway.hub.turn import Turn
from gateway.hub.turnstate import State
from gateway.observe import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "alp_hub_"
# seconds: from a few ms (a local model's first token) to minutes (a long agent turn)
TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LIMIT_STATUS = 429  # a turn refused with it passed one of its key's limits
_NOT_A_NAME = re.compile(r"[^a-zA-Z0-9_]")


@dataclass
class KeyTotals:
    """One API key's ended turns since the hub started (for the status page)."""

    turns: int = 0  # the turns refused with 429 not among them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    refused: int = 0  # turns refused with 429 (a limit of the key passed)
    last_used: float | None = None  # trio clock of the last turn's end

    def as_json(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "promptTokens": self.prompt_tokens,
            "completionTokens": self.completion_tokens,
            "refused": self.refused,
        }


def _buckets(hist: Histogram) -> list[tuple[str, int]]:
    """``(le, cumulative count)`` for each bound and ``+Inf``, as Prometheus wants them."""
    out: list[tuple[str, int]] = []
    total = 0
    for bound, n in zip(hist.buckets, hist.counts, strict=False):
        total += n
        out.append((repr(float(bound)), total))
    out.append(("+Inf", hist.count))
    return out


class HubMetrics:
    """Counters and histograms of the hub's ended turns, kept in memory since it started."""

    def __init__(self) -> None:
        self.turns: dict[tuple[str, str, str], int] = {}  # (key, model, outcome) -> turns
        self.tokens: dict[tuple[str, str, str], int] = {}  # (key, model, kind) -> tokens
        self.refusals: dict[str, int] = {}  # key name -> turns refused with 429
        self.ttft: dict[str, Histogram] = {}  # model -> time to first token
        self.duration: dict[str, Histogram] = {}  # model -> whole turn
        self.keys: dict[str, KeyTotals] = {}  # key name -> its totals (the page)

    def observe(self, turn: Turn) -> None:
        """One ended turn (an accounting observer: once per turn, never per chunk). Its model
        label is the one the ledger records (a model no runner listed is ``unlisted``)."""
        model = turn.model_label
        outcome = turn.outcome or State.LOST.outcome
        key = turn.key_name
        label = (key, model, outcome)
        self.turns[label] = self.turns.get(label, 0) + 1
        totals = self.keys.get(key)
        if totals is None:
            totals = self.keys[key] = KeyTotals()
        totals.last_used = turn.ended
        if turn.prompt_tokens:
            tk = (key, model, "prompt")
            self.tokens[tk] = self.tokens.get(tk, 0) + turn.prompt_tokens
            totals.prompt_tokens += turn.prompt_tokens
        if turn.completion_tokens:
            tk = (key, model, "completion")
            self.tokens[tk] = self.tokens.get(tk, 0) + turn.completion_tokens
            totals.completion_tokens += turn.completion_tokens
        if turn.state is State.REFUSED and turn.status == LIMIT_STATUS:
            self.refusals[key] = self.refusals.get(key, 0) + 1
            totals.refused += 1
        else:
            totals.turns += 1
        ttft = turn.ttft
        if ttft is not None and ttft >= 0:
            self._histogram(self.ttft, model, TTFT_BOUNDS).observe(ttft)
        duration = turn.duration
        if duration is not None and duration >= 0 and turn.runner_id is not None:
            self._histogram(self.duration, model, DURATION_BOUNDS).observe(duration)

    @staticmethod
    def _histogram(table: dict[str, Histogram], model: str, bounds: tuple[float, ...]) -> Histogram:
        found = table.get(model)
        if found is None:
            found = table[model] = Histogram(bounds)
        return found

    # -- rendering ------------------------------------------------------------------

    def families(self, snap: HubSnapshot) -> Iterator[Any]:
        """Everything as ``prometheus_client`` metric families (what the collector yields)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        if snap.replica is not None:
            yield InfoMetricFamily(
                PREFIX + "replica",
                "This hub as a replica of a team: its id, the address the others reach it at.",
                value={
                    "replica": snap.replica.id,
                    "url": snap.replica.url or "",
                    "version": snap.replica.version,
                },
            )

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
            "Tokens of ended turns (the backends' usage, else estimated), by key, model and kind.",
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
                family.add_metric([model], _buckets(hist), sum_value=hist.sum)
            yield family
        runners = snap.runners
        yield GaugeMetricFamily(
            PREFIX + "runners_up",
            "Runners that gave a sign of life within offline_after and did not say they stop.",
            sum(1 for r in runners if r.up),
        )
        yield GaugeMetricFamily(
            PREFIX + "runners_connected",
            "Runners with an open Chat Channel.",
            sum(1 for r in runners if r.connected),
        )
        yield GaugeMetricFamily(
            PREFIX + "channels_open", "Chat Channels open now.", snap.channels_open
        )
        yield GaugeMetricFamily(
            PREFIX + "sessions", "Front-door chat sessions live now.", len(snap.sessions)
        )
        yield GaugeMetricFamily(
            PREFIX + "turns_in_flight", "Front-door turns being served now.", len(snap.turns)
        )
        queue = snap.queue
        depth = GaugeMetricFamily(
            PREFIX + "queue_depth",
            "The front door's queues: turns waiting now.",
            labels=["project"],
        )
        for project, n in sorted(queue.depth.items()):
            depth.add_metric([project], n)
        yield depth
        yield CounterMetricFamily(
            PREFIX + "queue_waits", "The front door's queues: turns done waiting.", queue.waits
        )
        yield CounterMetricFamily(
            PREFIX + "queue_wait_seconds",
            "The front door's queues: their waits, summed.",
            queue.wait_seconds,
        )
        yield GaugeMetricFamily(
            PREFIX + "queue_longest_wait",
            "The front door's queues: the longest wait so far (seconds).",
            queue.longest_wait,
        )
        yield CounterMetricFamily(
            PREFIX + "late_reports",
            "Runner reports dropped because they came after the job's final report.",
            snap.late_reports,
        )
        for name, value in snap.counters.items():
            yield CounterMetricFamily(
                PREFIX + _NOT_A_NAME.sub("_", name),
                f"Counted since the hub started: {name.replace('_', ' ')} (HubCounters).",
                value,
            )

    def render(self, snap: HubSnapshot) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        from prometheus_client.exposition import generate_latest
        from prometheus_client.registry import Collector, CollectorRegistry

        metrics = self

        class _Hub(Collector):
            def collect(self) -> Iterator[Any]:
                return metrics.families(snap)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Hub())
        return generate_latest(registry).decode()
