"""The hub's book of turns: which are in flight now, what each key used, each key's limits.

Every ended turn is one row in the store (kept ``usage_retention`` s) and is added to its key's
hourly totals (kept for good). ``admit`` enforces the key's limits: requests a minute (a sliding
60 s window of admitted turns), tokens a minute (a sliding 60 s window of ended turns' tokens),
tokens a UTC day (ended turns') and turns in flight at once (from ``admit`` to ``ended``). The
book is touched once per turn, never per chunk; ``admit`` reads what it needs from the store
first and then checks and counts without awaiting, so it is exact under any number of
concurrent turns. An ended turn's row is queued for the store's writer (``Store.queue_usage``):
no store write on the turn's path."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from gateway.hub.http import HTTPError
from gateway.hub.settings import HubSettings
from gateway.hub.store import HourlyUsage, KeyLimits, Store, UsageRecord
from gateway.hub.turns import TurnRecord

WINDOW = 60.0  # s: the window of rpm and tpm (sliding)
DAY = 86400


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

    With a store, each ended turn is queued for it (a row, and its key's hourly totals) and the
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

    # -- limits ----------------------------------------------------------------------

    async def limits(self, key_id: str, key_name: str) -> KeyLimits:
        """The key's limits: read from the store, kept ``key_check_interval`` s (a change by
        another process applies within that; one made through the hub at once)."""
        now = trio.current_time()
        kept = self._limits.get(key_id)
        if kept is not None and kept[1] > now:
            return kept[0]
        limits = KeyLimits()
        if self.store is not None:
            found = await self.store.key_limits(key_name)
            if found is not None and found[0] == key_id:
                limits = found[1]
        self._limits[key_id] = (limits, trio.current_time() + self.settings.key_check_interval)
        return limits

    def forget_limits(self) -> None:
        """Drop the kept limits (a key was created or its limits changed in this process)."""
        self._limits.clear()

    def _state(self, key_id: str) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState()
        return state

    async def _read_day(self, state: _KeyState, key_id: str) -> None:
        """Bring the key's tokens of ended turns this UTC day up to date (read from the store
        once a day; the book adds each ended turn's since)."""
        day = int(self.clock()) // DAY * DAY
        if state.day != day:
            used = await self.store.tokens_since(key_id, day) if self.store else 0
            if state.day != day:  # not read meanwhile by another admit
                state.day, state.day_tokens = day, used

    async def admit(self, record: TurnRecord) -> None:
        """Raise HTTPError (429) when the turn would pass one of its key's limits; else count
        it (a request of the minute, a turn in flight until ``ended``). What is read from the
        store is read first: the checks and the count happen with no await between them."""
        limits = await self.limits(record.key_id, record.key_name)
        state = self._state(record.key_id)
        if limits.tokens_per_day is not None:
            await self._read_day(state, record.key_id)
        self._admit(record, limits, state)

    def _admit(self, record: TurnRecord, limits: KeyLimits, state: _KeyState) -> None:
        now = trio.current_time()
        state.expire(now)
        if limits.tokens_per_day is not None:
            used = state.day_tokens
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
        """The turn is over: its slot freed, its tokens counted, its row queued, observers told."""
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
                self.store.queue_usage(_row(record), wall)  # written by the store's writer, batched
            day = int(wall) // DAY * DAY
            if state.day != day and self.store is None:  # nowhere to read the day from
                state.day, state.day_tokens = day, 0
            if state.day == day:  # else read from the store (this turn included) when needed
                state.day_tokens += tokens
        finally:
            for observe in self.observers:
                observe(record)

    async def hourly(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        """The hourly totals from ``since`` (a Unix time; the hour it falls in included) on,
        of one key or of all, oldest first (every turn that ended counted)."""
        if self.store is None:
            return []
        return await self.store.hourly_usage(since, key_name)


def _row(record: TurnRecord) -> UsageRecord:
    """The ledger's row of an ended turn."""
    return UsageRecord(
        record.key_id,
        record.key_name,
        record.session,
        record.api,
        record.model or "",
        record.stream,
        record.outcome or "",
        record.runner_id,
        record.job_id,
        record.prompt_tokens,
        record.completion_tokens,
        record.ttft,
        record.duration,
    )
