"""The hub's book of turns: which are in flight now, what each key used, each key's limits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.hub.turns import TurnRecord


@dataclass(frozen=True)
class KeyLimits:
    """An API key's limits (None: none): requests and tokens a minute, tokens a day (UTC),
    turns in flight at once."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_streams: int | None = None


@dataclass(frozen=True)
class HourlyUsage:
    """One key's use in one hour (UTC, the hour's start as a Unix time)."""

    hour: int
    key_name: str
    model: str | None
    turns: int
    prompt_tokens: int
    completion_tokens: int


class UsageBook:
    """Every front-door turn passes here: ``admit`` before it is served (a limit refuses it with
    an HTTPError 429), ``started`` once it is, ``ended`` when it is over, whatever the outcome;
    ``observers`` are told of each ended turn (the metrics)."""

    def __init__(self) -> None:
        self.in_flight: dict[int, TurnRecord] = {}
        self.observers: list[Callable[[TurnRecord], None]] = []

    def admit(self, record: TurnRecord) -> None:
        """Raise HTTPError (429) when the turn would pass one of its key's limits."""

    def started(self, record: TurnRecord) -> None:
        self.in_flight[id(record)] = record

    def ended(self, record: TurnRecord) -> None:
        self.in_flight.pop(id(record), None)
        for observe in self.observers:
            observe(record)

    def hourly(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        """The hourly totals from ``since`` (a Unix time) on, of one key or of all."""
        return []
