"""An API key's limits exact across a team of replicas: each turn's admission one transaction in
the team's store (``alp_admit``: the key's row locked, its turns of the last minute and in
flight counted, the session cap applied), and its release at the turn's end, written behind
the turn (one statement for all the turns ended meanwhile) but before this replica admits
another turn of the same key, so a client that saw its answer end is not refused for it."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from gateway.hub.accounting import exceeded, over_budget, retry_after
from gateway.hub.replicas.store.base import Release, ReplicaStore
from gateway.hub.sessions import SessionKey, TooManySessions
from gateway.hub.settings import HubSettings
from gateway.hub.store import KeyLimits, StoreError, StoreUnavailable, UsageRecord
from gateway.hub.turn import Turn

log = logging.getLogger("gateway.hub.replicas")

RETRY = 1.0  # s between tries to write releases the store refused
Evicted = Callable[[str, str, str | None], Awaitable[None]]  # key name, session id, job id


class ReplicaLimits:
    """Admissions and releases in the team's store (``coordination.Replicated`` calls them).
    ``learned`` is told each admitted turn's session and the job the store has for it; ``evicted`` each session
    the session cap ended to make room (its job is to be ended)."""

    def __init__(
        self,
        store: ReplicaStore,
        settings: HubSettings,
        learned: dict[SessionKey, str | None],
        evicted: Evicted,
        expiry: float,
    ) -> None:
        self.store = store
        self.settings = settings
        self.learned = learned
        self.evicted = evicted
        self.expiry = expiry
        self._pending: list[Release] = []
        self._unwritten: dict[str, int] = {}  # key id -> its releases not written yet
        self._queued = trio.Event()
        self._written = trio.Event()

    async def admit(
        self,
        turn: Turn,
        limits: KeyLimits,
        record: str | None = None,
        funds: tuple[float, float | None, float | None] | None = None,
    ) -> None:
        """Admitted, or LimitExceeded / TooManySessions (the store's verdict); ``record``: the
        turn's usage row were it cut now (JSON), kept in the store with the turn until
        ``settle`` (or a survivor, should this replica die first); with ``funds`` (the cost the
        turn holds, the key's daily and monthly budget), the key's budgets are checked first in
        the same transaction."""
        with trio.move_on_after(RETRY):  # this key's ended turns counted first
            while self._unwritten.get(turn.key_id):
                await self._written.wait()
        found = await self.store.admit(
            turn.id,
            turn.key_id,
            turn.key_name,
            turn.session,
            turn.reserved,
            (limits.rpm, limits.tpm, limits.tokens_per_day, limits.max_streams),
            self.settings.max_sessions_per_key,
            self.expiry,
            record,
            funds,
        )
        verdict = found.verdict
        if verdict in ("budget_daily", "budget_monthly") and funds is not None:
            bound = funds[1] if verdict == "budget_daily" else funds[2]
            now = time.time()
            raise over_budget(
                verdict,
                bound or 0.0,
                found.spent,
                found.holding,
                now + found.wait,
                now,
                self.settings.currency,
            )
        if verdict == "ok":
            self.learned[(turn.key_id, turn.session)] = found.job_id
            if found.evicted_session is not None:
                log.info(
                    "API key %s at %d sessions: ending its least recently used session %s",
                    turn.key_name,
                    self.settings.max_sessions_per_key,
                    found.evicted_session,
                )
                await self.evicted(turn.key_name, found.evicted_session, found.evicted_job)
            return
        if verdict == "max_sessions":
            log.warning(
                "API key %s holds %d busy sessions: session %s refused",
                turn.key_name,
                found.used,
                turn.session,
            )
            raise TooManySessions(self.settings.max_sessions_per_key)
        bound = {
            "rpm": limits.rpm,
            "tpm": limits.tpm,
            "tokens_per_day": limits.tokens_per_day,
            "max_streams": limits.max_streams,
        }.get(verdict)
        if bound is None:
            raise StoreError(f"the store's admission answered {verdict!r}")
        raise exceeded(verdict, bound, found.used, found.held, retry_after(found.wait))

    async def settle(self, turn: Turn, record: UsageRecord, at: float) -> None:
        """The turn ended: released and its usage row written in the store, one statement,
        before its client has its last byte (a replica lost after it loses no row)."""
        release = Release(
            turn.id, turn.key_id, turn.key_name, turn.session, turn.tokens, turn.cost or 0.0
        )
        try:
            if not await self.store.settle(release, record, at):
                log.info(
                    "turn %s was settled by another replica (this one was taken for dead)",
                    turn.id,
                )
        finally:  # the key's next admission here waited for it (``ending``)
            self._written_one(turn.key_id)
            self._wake_admissions()

    def ending(self, turn: Turn) -> None:
        """The turn ended and ``settle`` is on its way: the key's next admission here waits
        for it (as for a release), so a client that saw its answer end is counted for it."""
        self._unwritten[turn.key_id] = self._unwritten.get(turn.key_id, 0) + 1

    def release(self, turn: Turn) -> None:
        """The turn ended: its release queued (no I/O here)."""
        self._pending.append(
            Release(
                turn.id, turn.key_id, turn.key_name, turn.session, turn.tokens, turn.cost or 0.0
            )
        )
        self._unwritten[turn.key_id] = self._unwritten.get(turn.key_id, 0) + 1
        self._queued.set()

    async def run(self) -> None:
        """The releases' writer, until cancelled (what is queued at the end is left to the
        store: a replica's turns in flight are released when it stops, or its heartbeat ends)."""
        while True:
            if not self._pending:
                self._queued = trio.Event()
                await self._queued.wait()
            batch, self._pending = self._pending, []
            try:
                await self.store.release(batch)
            except StoreUnavailable:
                self._pending[:0] = batch
                await trio.sleep(RETRY)
                continue
            except StoreError as exc:
                log.warning("could not release %d turn(s) in the store: %s", len(batch), exc)
            for ended in batch:
                self._written_one(ended.key_id)
            self._wake_admissions()

    def _written_one(self, key_id: str) -> None:
        left = self._unwritten[key_id] - 1
        if left:
            self._unwritten[key_id] = left
        else:
            del self._unwritten[key_id]

    def _wake_admissions(self) -> None:
        event, self._written = self._written, trio.Event()
        event.set()
