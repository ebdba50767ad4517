"""The hub's book of turns: which are in flight now, what each key used, each key's limits.

Every ended turn is one row in the store (kept ``usage_retention`` s) and is added to its key's
hourly totals (kept for good). ``admit`` enforces the key's limits: requests a minute (a sliding
60 s window of admitted turns), tokens a minute (a sliding 60 s window of ended turns' tokens),
tokens a UTC day (ended turns') and turns in flight at once (from ``admit`` to ``ended``). The
book is touched once per turn, never per chunk; ``admit`` does not await, so it is exact under
any number of concurrent turns."""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from gateway.hub import turns
from gateway.hub.http import HTTPError
from gateway.hub.settings import HubSettings
from gateway.hub.turns import TurnRecord

if TYPE_CHECKING:
    from gateway.hub.store import Store

log = logging.getLogger("gateway.hub.usage")

WINDOW = 60.0  # s: the window of rpm and tpm (sliding)
DAY = 86400
HOUR = 3600
PRUNE_BATCH = 500  # per-turn rows deleted at most per prune (bounded work at write time)
PRUNE_EVERY = 60.0  # s (wall clock) between prunes once nothing old is left
ERROR_OUTCOMES = (turns.ERROR, turns.LOST, turns.REFUSED)  # counted as errors in the totals
LIMIT_NAMES = ("rpm", "tpm", "tokens_per_day", "max_streams")


@dataclass(frozen=True)
class KeyLimits:
    """An API key's limits (None: none): requests and tokens a minute, tokens a day (UTC),
    turns in flight at once."""

    rpm: int | None = None
    tpm: int | None = None
    tokens_per_day: int | None = None
    max_streams: int | None = None

    def describe(self) -> str:
        """``rpm=3 tpm=1000 tokens/day=50000 streams=2`` (only the limits set), or ``-``."""
        parts = [
            f"{label}={value}"
            for label, value in (
                ("rpm", self.rpm),
                ("tpm", self.tpm),
                ("tokens/day", self.tokens_per_day),
                ("streams", self.max_streams),
            )
            if value is not None
        ]
        return " ".join(parts) or "-"

    def as_json(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in LIMIT_NAMES}


def limits_of(
    rpm: int | None = None,
    tpm: int | None = None,
    tokens_per_day: int | None = None,
    max_streams: int | None = None,
) -> KeyLimits:
    """KeyLimits from given values, 0 (or None) meaning no limit; ValueError on a negative or
    non-integer value."""
    values: dict[str, int | None] = {}
    for name, value in zip(LIMIT_NAMES, (rpm, tpm, tokens_per_day, max_streams), strict=True):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ValueError(f"the limit {name} must be a whole number, 0 for none, not {value!r}")
        values[name] = value or None
    return KeyLimits(**values)


@dataclass(frozen=True)
class HourlyUsage:
    """One key's use in one hour (UTC, the hour's start as a Unix time)."""

    hour: int
    key_name: str
    model: str | None
    turns: int
    prompt_tokens: int
    completion_tokens: int
    errors: int = 0  # turns that ended in error, lost or refused (by the hub, not its limits)


@dataclass(eq=False)
class _KeyState:
    """One key's counters (by key id: a new key with a revoked key's name starts afresh)."""

    requests: deque[float] = field(default_factory=deque)  # admitted turns' times, last 60 s
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # ended turns', last 60 s
    window_tokens: int = 0  # the sum of ``tokens``
    in_flight: int = 0  # admitted, not ended
    day: int = -1  # the UTC day (its start, Unix time) ``day_tokens`` counts; -1: not read yet
    day_tokens: int = 0

    def expire(self, now: float) -> None:
        since = now - WINDOW
        requests, tokens = self.requests, self.tokens
        while requests and requests[0] <= since:
            requests.popleft()
        while tokens and tokens[0][0] <= since:
            self.window_tokens -= tokens.popleft()[1]


def _retry_after(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def _refused(message: str, seconds: int) -> HTTPError:
    return HTTPError(
        429,
        message,
        "rate_limit_exceeded",
        type_="rate_limit_error",
        headers=[(b"retry-after", str(seconds).encode())],
    )


class UsageBook:
    """Every front-door turn passes here: ``admit`` before it is served (a limit refuses it with
    an HTTPError 429), ``started`` once it is, ``ended`` when it is over, whatever the outcome;
    ``observers`` are told of each ended turn (the metrics).

    With a store, each ended turn is written to it (a row, and its key's hourly totals) and the
    keys' limits are read from it (each key's again after ``key_check_interval`` s). ``clock``:
    the wall clock (Unix time) of the rows and of the UTC day; the windows use trio's clock."""

    def __init__(
        self,
        store: Store | None = None,
        settings: HubSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.settings = settings or HubSettings()
        self.clock = clock
        self.in_flight: dict[int, TurnRecord] = {}
        self.observers: list[Callable[[TurnRecord], None]] = []
        self._keys: dict[str, _KeyState] = {}  # key id -> its counters
        self._holding: dict[int, _KeyState] = {}  # id(record) of an admitted turn -> its key's
        self._limits: dict[str, tuple[KeyLimits, float]] = {}  # key id -> (limits, until)
        self._next_prune = -math.inf  # wall clock

    # -- limits ----------------------------------------------------------------------

    def limits(self, key_id: str, key_name: str) -> KeyLimits:
        """The key's limits: read from the store, kept ``key_check_interval`` s (a change by
        another process applies within that; one made through the hub at once)."""
        now = trio.current_time()
        kept = self._limits.get(key_id)
        if kept is not None and kept[1] > now:
            return kept[0]
        limits = KeyLimits()
        if self.store is not None:
            found = self.store.key_limits(key_name)
            if found is not None and found[0] == key_id:
                limits = found[1]
        self._limits[key_id] = (limits, now + self.settings.key_check_interval)
        return limits

    def forget_limits(self) -> None:
        """Drop the kept limits (a key was created or its limits changed in this process)."""
        self._limits.clear()

    def _state(self, key_id: str) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState()
        return state

    def _day_tokens(self, state: _KeyState, key_id: str) -> int:
        """The key's tokens of ended turns this UTC day (read from the store once a day)."""
        day = int(self.clock()) // DAY * DAY
        if state.day != day:
            state.day = day
            state.day_tokens = self.store.tokens_since(key_id, day) if self.store else 0
        return state.day_tokens

    def admit(self, record: TurnRecord) -> None:
        """Raise HTTPError (429) when the turn would pass one of its key's limits; else count
        it (a request of the minute, a turn in flight until ``ended``)."""
        limits = self.limits(record.key_id, record.key_name)
        state = self._state(record.key_id)
        now = trio.current_time()
        state.expire(now)
        if limits.tokens_per_day is not None:
            used = self._day_tokens(state, record.key_id)
            if used >= limits.tokens_per_day:
                wait = _retry_after(state.day + DAY - self.clock())
                raise _refused(
                    f"this API key is limited to {limits.tokens_per_day} tokens per day "
                    f"(tokens_per_day, UTC) and has used {used} today: retry in {wait} s",
                    wait,
                )
        if limits.tpm is not None and state.window_tokens >= limits.tpm:
            left = state.window_tokens
            wait_until = now
            for at, tokens in state.tokens:  # until enough of the minute's tokens age out
                left -= tokens
                wait_until = at + WINDOW
                if left < limits.tpm:
                    break
            wait = _retry_after(wait_until - now)
            raise _refused(
                f"this API key is limited to {limits.tpm} tokens per minute (tpm) and has used "
                f"{state.window_tokens} in the last minute: retry in {wait} s",
                wait,
            )
        if limits.rpm is not None and len(state.requests) >= limits.rpm:
            oldest = state.requests[len(state.requests) - limits.rpm]
            wait = _retry_after(oldest + WINDOW - now)
            raise _refused(
                f"this API key is limited to {limits.rpm} requests per minute (rpm): "
                f"retry in {wait} s",
                wait,
            )
        if limits.max_streams is not None and state.in_flight >= limits.max_streams:
            raise _refused(
                f"this API key is limited to {limits.max_streams} turns in flight at once "
                f"(max_streams) and has {state.in_flight}: retry when one ends",
                1,
            )
        state.requests.append(now)
        state.in_flight += 1
        self._holding[id(record)] = state

    def started(self, record: TurnRecord) -> None:
        self.in_flight[id(record)] = record

    def ended(self, record: TurnRecord) -> None:
        """The turn is over: its slot freed, its tokens counted, its row written, observers told."""
        self.in_flight.pop(id(record), None)
        held = self._holding.pop(id(record), None)
        if held is not None:
            held.in_flight -= 1
        try:
            tokens = record.tokens
            state = held or self._state(record.key_id)
            if tokens:
                state.tokens.append((trio.current_time(), tokens))
                state.window_tokens += tokens
            wall = self.clock()
            if self.store is not None:
                self._write(record, wall)
            day = int(wall) // DAY * DAY
            if state.day != day and self.store is None:  # nowhere to read the day from
                state.day, state.day_tokens = day, 0
            if state.day == day:  # else read from the store (this turn included) when needed
                state.day_tokens += tokens
        finally:
            for observe in self.observers:
                observe(record)

    def _write(self, record: TurnRecord, wall: float) -> None:
        """The turn's row and hourly totals; old rows pruned (bounded: ``PRUNE_BATCH``)."""
        assert self.store is not None
        try:
            self.store.add_usage(record, wall)
            if wall >= self._next_prune:
                before = wall - self.settings.usage_retention
                deleted = self.store.prune_usage(before, PRUNE_BATCH)
                self._next_prune = wall if deleted >= PRUNE_BATCH else wall + PRUNE_EVERY
        except sqlite3.Error as exc:  # a busy or broken store must not break serving
            log.warning("could not record the usage of a turn of key %s: %s", record.key_name, exc)

    def hourly(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        """The hourly totals from ``since`` (a Unix time; the hour it falls in included) on,
        of one key or of all, oldest first."""
        if self.store is None:
            return []
        return self.store.hourly_usage(since, key_name)
