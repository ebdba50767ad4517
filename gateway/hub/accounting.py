"""The hub's accounting: each API key's limits, the turns in flight, and every ended turn's
tokens in the usage ledger; a limit passed is a ``LimitExceeded`` (the edge answers 429).

``admit`` enforces a key's limits before a turn is served: requests a minute (a sliding 60 s
window of admitted turns), tokens a minute and tokens a UTC day (ended turns' tokens plus what
the turns in flight reserved: each its prompt's estimate and its ``max_tokens``, or
``token_reservation``), and turns in flight at once. ``admit`` does not await, so it is exact
under any number of concurrent turns, and concurrent turns overshoot a token limit by at most
one turn's reservation. ``ended`` frees the turn's slot and reservation and charges what it
used: the backend's usage, or, for a turn that ended without one (client gone, cancelled,
channel lost), the tokens it delivered (a chunk a token) and its prompt estimated, marked
estimated in the ledger. Nothing here runs per chunk.

Money (``gateway.hub.money``): each ended turn's cost at its model's price then in force
(None: the model has no price), and its cost at the reference price; a key's daily and monthly
budgets checked as the token limits are (what the key spent this UTC day or month plus what its
turns in flight hold: each its prompt's estimate and its answer's reservation at the model's
price) and settled to the turn's cost at its end; a budget passed is ``LimitExceeded``
(``budget_daily`` / ``budget_monthly``, answered 429 ``budget_exceeded``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import trio

from gateway.hub.coordination import Alone, Coordination
from gateway.hub.money import (
    DAY,
    NO_BUDGET,
    KeyBudget,
    Price,
    day_start,
    derive,
    month_start,
    next_month,
    utc,
)
from gateway.hub.settings import HubSettings
from gateway.hub.store import HourlyUsage, KeyLimits, Store, UsageRecord
from gateway.hub.store.journal import CUT
from gateway.hub.turn import Turn

log = logging.getLogger("gateway.hub.accounting")

WINDOW = 60.0  # s: the window of rpm and tpm (sliding)
_encode_record = msgspec.json.Encoder().encode


class LimitExceeded(Exception):
    """A turn would pass one of its key's limits (``limit``: rpm, tpm, tokens_per_day,
    max_streams); ``retry_after``: seconds until it would not."""

    def __init__(self, limit: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.message = message
        self.retry_after = retry_after


def exceeded(limit: str, bound: int, used: int, held: int, wait: int) -> LimitExceeded:
    """The refusal of a turn that would pass its key's ``limit`` (whose value is ``bound``):
    ``used``, what counts against it; ``held``, the tokens turns in flight hold; ``wait``, the
    seconds until it would not."""
    more = f", {held} more held by turns in flight" if held else ""
    if limit == "tokens_per_day":
        message = (
            f"this API key is limited to {bound} tokens per day (tokens_per_day, UTC) and has "
            f"used {used} today{more}: retry in {wait} s"
        )
    elif limit == "tpm":
        message = (
            f"this API key is limited to {bound} tokens per minute (tpm) and has used {used} in "
            f"the last minute{more}: retry in {wait} s"
        )
    elif limit == "rpm":
        message = f"this API key is limited to {bound} requests per minute (rpm): retry in {wait} s"
    else:
        message = (
            f"this API key is limited to {bound} turns in flight at once (max_streams) and has "
            f"{used}: retry when one ends"
        )
    return LimitExceeded(limit, message, wait)


def over_budget(
    limit: str, bound: float, spent: float, held: float, resets: float, now: float, currency: str
) -> LimitExceeded:
    """The refusal of a turn whose key passed its daily or monthly budget (``limit``:
    ``budget_daily`` or ``budget_monthly``, of ``bound``), spent ``spent`` with ``held`` more
    held by turns in flight; ``resets``: the Unix time its day or month ends."""
    span = "daily" if limit == "budget_daily" else "monthly"
    more = f", {held:.6g} {currency} more held by turns in flight" if held else ""
    wait = retry_after(resets - now)
    message = (
        f"this API key's {span} budget of {bound:g} {currency} is spent ({spent:.6g} {currency} "
        f"used{more}): it resets at {utc(resets)}, retry in {wait} s"
    )
    return LimitExceeded(limit, message, wait)


def retry_after(seconds: float) -> int:
    """Seconds a client is told to wait: whole, at least 1."""
    return max(1, math.ceil(seconds))


@dataclass(eq=False)
class _KeyState:
    """One key's counters (by key id: a new key with a revoked key's name starts afresh)."""

    requests: deque[float] = field(default_factory=deque)  # admitted turns' times, last 60 s
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # ended turns', last 60 s
    window_tokens: int = 0  # the sum of ``tokens``
    in_flight: int = 0  # admitted, not ended
    reserved: int = 0  # tokens the turns in flight reserved
    day: int = -1  # the UTC day (its start, Unix time) ``day_tokens`` counts; -1: not read yet
    day_tokens: int = 0
    reserved_cost: float = 0.0  # what the turns in flight hold against the budgets
    cost_day: int = -1  # the UTC day ``day_cost`` counts (-1: not read yet)
    day_cost: float = 0.0
    cost_month: int = -1  # the UTC month ``month_cost`` counts (-1: not read yet)
    month_cost: float = 0.0

    def expire(self, now: float) -> None:
        since = now - WINDOW
        requests, tokens = self.requests, self.tokens
        while requests and requests[0] <= since:
            requests.popleft()
        while tokens and tokens[0][0] <= since:
            self.window_tokens -= tokens.popleft()[1]


class Accounting:
    """Every front-door turn passes here: ``admit`` before it is served, ``started`` once it
    is, ``ended`` when it is over, whatever the outcome; ``observers`` are told of each ended
    turn (the metrics), a turn refused by a limit included (it is never in the ledger).

    With a store, each ended turn is written to it (a row, and its key's hourly totals) and the
    keys' limits are read from it (each key's again after ``key_check_interval`` s). ``clock``:
    the wall clock (Unix time) of the rows and of the UTC day; the windows use trio's clock."""

    def __init__(
        self,
        store: Store | None = None,
        settings: HubSettings | None = None,
        *,
        clock: Callable[[], float] = time.time,
        label: Callable[[str | None], str] = lambda model: model or "",
        coordination: Coordination | None = None,
    ) -> None:
        self.store = store
        # where the keys' limits are checked and counted (a replica's: in the shared store)
        self.coordination: Coordination = coordination or Alone(store)
        self.settings = settings or HubSettings()
        self.clock = clock
        self.label = label  # the model as the ledger and the metrics name it
        self.in_flight: dict[int, Turn] = {}
        self.observers: list[Callable[[Turn], None]] = []
        self._keys: dict[str, _KeyState] = {}  # key id -> its counters
        self._limits: dict[str, tuple[KeyLimits, float]] = {}  # key id -> (limits, until)
        self._budgets: tuple[dict[str, KeyBudget], float] = ({}, -math.inf)  # by key name
        self._prices: tuple[dict[str, Price], float] = ({}, -math.inf)  # by model label
        self._prices_lock = trio.Lock()
        self._held: dict[int, float] = {}  # id(turn) -> the cost a turn in flight holds

    # -- money ---------------------------------------------------------------------------

    async def budget(self, key_name: str) -> KeyBudget:
        """The key's budgets and priority class: every key's read from the store at once,
        kept ``key_check_interval`` s (as its limits)."""
        kept, until = self._budgets
        now = trio.current_time()
        if until <= now and self.store is not None:
            kept = await self.store.key_budgets()
            self._budgets = (kept, now + self.settings.key_check_interval)
        return kept.get(key_name) or NO_BUDGET

    async def prices(self) -> dict[str, Price]:
        """Every model's price by the ledger's name of it, kept ``key_check_interval`` s; a
        price derived from a GPU's power at the model's throughput of the last day's turns."""
        if self._prices[1] <= trio.current_time() and self.store is not None:
            async with self._prices_lock:  # one reader; the others wait for what it read
                if self._prices[1] <= trio.current_time():
                    now = trio.current_time()
                    found = {}
                    for price in await self.store.list_prices():
                        if price.watts is not None and price.kwh_price is not None:
                            measured = await self.store.throughput(price.model, self.clock() - DAY)
                            price = derive(price, *measured)
                        found[price.model] = price
                    self._prices = (found, now + self.settings.key_check_interval)
        return self._prices[0]

    def price(self, model_label: str) -> Price | None:
        """The model's price as last read (None: it has none, it costs 0)."""
        return self._prices[0].get(model_label)

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
        self._limits[key_id] = (limits, now + self.settings.key_check_interval)
        return limits

    def forget_limits(self) -> None:
        """Drop the kept limits, budgets and prices (a key was created, its limits or budgets
        changed, or a price set, in this process)."""
        self._limits.clear()
        self._budgets = ({}, -math.inf)
        self._prices = ({}, -math.inf)

    def _state(self, key_id: str) -> _KeyState:
        state = self._keys.get(key_id)
        if state is None:
            state = self._keys[key_id] = _KeyState()
        return state

    async def _read_spent(self, state: _KeyState, key_id: str, budget: KeyBudget) -> None:
        """The key's cost of ended turns this UTC day and month, read from the store once a
        day and once a month."""
        now = self.clock()
        day, month = day_start(now), month_start(now)
        if budget.daily is not None and state.cost_day != day:
            spent = await self.store.cost_since(key_id, day) if self.store else 0.0
            if state.cost_day != day:
                state.cost_day, state.day_cost = day, spent
        if budget.monthly is not None and state.cost_month != month:
            spent = await self.store.cost_since(key_id, month) if self.store else 0.0
            if state.cost_month != month:
                state.cost_month, state.month_cost = month, spent

    async def _read_day(self, state: _KeyState, key_id: str) -> None:
        """The key's tokens of ended turns this UTC day, read from the store once a day."""
        day = day_start(self.clock())
        if state.day != day:
            used = await self.store.tokens_since(key_id, day) if self.store else 0
            if state.day != day:  # nobody read it meanwhile
                state.day, state.day_tokens = day, used

    def reservation(self, max_tokens: int | None) -> int:
        """The tokens a turn's answer holds against its key's token limits while in flight
        (``admit`` adds its prompt's estimate)."""
        return max_tokens if max_tokens is not None else self.settings.token_reservation

    async def admit(self, turn: Turn) -> None:
        """LimitExceeded when the turn would pass one of its key's limits; else count it (a
        request of the minute, a turn in flight and its reservation until ``ended``). What the
        store has is read first; the check and the count then run with no await between, so
        they are exact under any number of concurrent turns. On replicas the check and the
        count are the store's, in one transaction (the ``coordination``'s)."""
        # what is kept is taken here without a call to ``limits``, ``budget`` or ``prices``
        # (three coroutines a turn); they read the store when it is not
        now = trio.current_time()
        kept = self._limits.get(turn.key_id)
        if kept is not None and kept[1] > now:
            limits = kept[0]
        else:
            limits = await self.limits(turn.key_id, turn.key_name)
            now = trio.current_time()
        budgets, until = self._budgets
        if until > now:
            budget = budgets.get(turn.key_name) or NO_BUDGET
        else:
            budget = await self.budget(turn.key_name)
            now = trio.current_time()
        state = self._state(turn.key_id)
        # read here, so the turn's end finds them kept
        prices = self._prices[0] if self._prices[1] > now else await self.prices()
        funded = budget.daily is not None or budget.monthly is not None
        price: Price | None = None
        if funded:  # the client's name too: its runner may not have been asked yet
            price = prices.get(self.label(turn.model)) or prices.get(turn.model or "")
        answer = turn.reserved
        prompt = 0
        if (limits.tpm or limits.tokens_per_day) or (funded and price is not None):
            prompt = turn.dialect.prompt_estimate(turn.body)
        # with no token limit nothing is held; with one its prompt is too (a long one with a
        # small max_tokens holds it)
        turn.admitted_as(budget.rank, answer + prompt if limits.tpm or limits.tokens_per_day else 0)
        held = 0.0  # its worst case at its model's price, held against the key's budgets
        if funded and price is not None:
            held = price.cost(prompt, answer)
        funds = (held, budget.daily, budget.monthly) if funded else None
        await self.coordination.admit(self, turn, limits, budget, funds)
        now = trio.current_time()  # the check's: no await since (``admit_here``)
        state.expire(now)
        state.requests.append(now)
        state.in_flight += 1
        state.reserved += turn.reserved
        state.reserved_cost += held
        if held:
            self._held[id(turn)] = held
        self.in_flight[id(turn)] = turn

    async def admit_here(
        self, turn: Turn, limits: KeyLimits, budget: KeyBudget, funded: bool
    ) -> None:
        """``admit``'s check when this hub counts its keys' turns itself: what the store has
        read first, then checked, with no await until ``admit`` counts it; journalled (a hub
        killed under it still records it, as cut)."""
        state = self._state(turn.key_id)
        if limits.tokens_per_day is not None:
            await self._read_day(state, turn.key_id)
        if funded:
            await self._read_spent(state, turn.key_id, budget)
        now = trio.current_time()
        state.expire(now)
        if funded:
            self._check_budget(state, budget)
        self._check(state, limits, now)
        journal = self.store.journal if self.store is not None else None
        if journal is not None:
            turn.recorded_as(self.label(turn.model))  # never a client's made-up name
            journal.started(turn.id, _record(turn, CUT), self.clock())

    def cut_row(self, turn: Turn) -> str:
        """The turn's usage row were it cut now (JSON), its model as the ledger names it."""
        turn.recorded_as(self.label(turn.model))
        return _encode_record(_record(turn, CUT)).decode()

    def usage_row(self, turn: Turn) -> UsageRecord:
        """The ended turn's usage row."""
        return _record(turn, turn.outcome or "")

    def _check_budget(self, state: _KeyState, budget: KeyBudget) -> None:
        """LimitExceeded when the key's spend and what its turns in flight hold reach one of
        its budgets (so concurrent turns pass it by at most one turn's reservation)."""
        now = self.clock()
        currency = self.settings.currency
        held = state.reserved_cost
        if budget.daily is not None and state.day_cost + held >= budget.daily:
            resets = state.cost_day + DAY
            raise over_budget(
                "budget_daily", budget.daily, state.day_cost, held, resets, now, currency
            )
        if budget.monthly is not None and state.month_cost + held >= budget.monthly:
            resets = next_month(now)
            raise over_budget(
                "budget_monthly", budget.monthly, state.month_cost, held, resets, now, currency
            )

    def _check(self, state: _KeyState, limits: KeyLimits, now: float) -> None:
        """LimitExceeded when one more turn would pass one of ``limits``."""
        if limits.tokens_per_day is not None:
            used = state.day_tokens
            if used + state.reserved >= limits.tokens_per_day:
                wait = retry_after(state.day + DAY - self.clock())
                raise exceeded("tokens_per_day", limits.tokens_per_day, used, state.reserved, wait)
        if limits.tpm is not None and state.window_tokens + state.reserved >= limits.tpm:
            left = state.window_tokens + state.reserved
            wait_until = now
            for at, tokens in state.tokens:  # until enough of the minute's tokens age out
                left -= tokens
                wait_until = at + WINDOW
                if left < limits.tpm:
                    break
            wait = retry_after(wait_until - now)
            raise exceeded("tpm", limits.tpm, state.window_tokens, state.reserved, wait)
        if limits.rpm is not None and len(state.requests) >= limits.rpm:
            oldest = state.requests[len(state.requests) - limits.rpm]
            raise exceeded(
                "rpm", limits.rpm, len(state.requests), 0, retry_after(oldest + WINDOW - now)
            )
        if limits.max_streams is not None and state.in_flight >= limits.max_streams:
            raise exceeded("max_streams", limits.max_streams, state.in_flight, 0, 1)

    def end_turns(self, revoked: Callable[[str], bool]) -> int:
        """End every turn in flight whose API key id is ``revoked`` (its key was revoked): each
        client told now, each runner told to stop by the turn's own task; how many ended."""
        ended = 0
        for turn in list(self.in_flight.values()):
            if turn.key_id and revoked(turn.key_id) and not turn.state.final:
                log.info("turn %s: its API key %s was revoked: ended", turn.id, turn.key_name)
                turn.revoke()
                ended += 1
        return ended

    def refused(self, turn: Turn) -> None:
        """A turn refused before it was admitted (a limit): only the observers are told (no
        store write per refused request)."""
        turn.recorded_as(self.label(turn.model))
        for observe in self.observers:
            observe(turn)

    def ended(self, turn: Turn) -> None:
        """The turn is over: its slot and reservation freed, its tokens charged (estimated
        where the backend said nothing), its row written, observers told."""
        if self.in_flight.pop(id(turn), None) is None:
            self.refused(turn)
            return
        state = self._state(turn.key_id)
        state.in_flight -= 1
        state.reserved -= turn.reserved
        state.reserved_cost -= self._held.pop(id(turn), 0.0)
        label = self.label(turn.model)
        price = self.price(label)
        if price is None:
            turn.recorded_as(label)
        else:  # at the price in force now, as the turn ends
            prompt, completion = turn.prompt_tokens or 0, turn.completion_tokens or 0
            turn.recorded_as(
                label, price.cost(prompt, completion), price.ref_cost(prompt, completion)
            )
        try:
            tokens = turn.tokens
            if tokens:
                state.tokens.append((trio.current_time(), tokens))
                state.window_tokens += tokens
            wall = self.clock()
            self.coordination.turn_ended(self, turn, wall)  # a replica's: settled before its end
            day = day_start(wall)
            if state.day != day and self.store is None:  # nowhere to read the day from
                state.day, state.day_tokens = day, 0
            if state.day == day:  # else read from the store (this turn included) when needed
                state.day_tokens += tokens
            if turn.cost:
                if state.cost_day == day:
                    state.day_cost += turn.cost
                if state.cost_month == month_start(wall):
                    state.month_cost += turn.cost
        finally:
            for observe in self.observers:
                observe(turn)

    def write_row(self, turn: Turn, wall: float) -> None:
        """The turn's row, journalled and queued for the store's writer (written in a batch,
        off the turn's path; old rows pruned there); nowhere without a store."""
        if self.store is not None:
            self.write_record(turn.id, _record(turn, turn.outcome or ""), wall)

    def write_record(self, turn_id: str, record: UsageRecord, wall: float) -> None:
        """A row journalled and queued for the store's writer."""
        assert self.store is not None
        journal = self.store.journal
        if journal is not None:
            journal.ended(turn_id, record, wall)
        self.store.queue_usage(record, wall)

    async def hourly(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        """The hourly totals from ``since`` (a Unix time; the hour it falls in included) on,
        of one key or of all, oldest first."""
        if self.store is None:
            return []
        return await self.store.hourly_usage(since, key_name)


def _record(turn: Turn, outcome: str) -> UsageRecord:
    """The turn's row in the ledger, with ``outcome``."""
    return UsageRecord(
        turn.key_id,
        turn.key_name,
        turn.session,
        turn.api,
        turn.model_label,
        turn.stream,
        outcome,
        turn.runner_id,
        turn.job_id,
        turn.prompt_tokens,
        turn.completion_tokens,
        turn.ttft,
        turn.duration,
        turn.estimated,
        turn.continued,
        turn.cost,
        turn.ref_cost,
    )
