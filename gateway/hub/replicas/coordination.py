"""A replica's coordination (``gateway.hub.coordination.Coordination``): the board's decisions
and writes made in the shared store (``boardsync``), the sessions' jobs compare-and-set and
reaped there, the keys' limits admitted and each turn settled there (``limits``), a job's
channel found on the replica that holds it (``replica.Replication``, made by ``join``)."""

from __future__ import annotations

import logging
import math
import pathlib
from typing import Any

import trio

from gateway.hub.coordination import Funds, Guard, Route, SessionKey
from gateway.hub.job import Job
from gateway.hub.replicas.relay import PATHS
from gateway.hub.replicas.remote import ROUTE
from gateway.hub.replicas.replica import Replication, replica_id
from gateway.hub.replicas.settled import SettledTurn
from gateway.hub.replicas.store.base import ReplicaStore
from gateway.hub.replicas.store.shared import shared
from gateway.hub.settings import HubSettings
from gateway.hub.snapshot import camel
from gateway.hub.store import KeyLimits, Store, StoredSession, StoreError, UsageRecord
from gateway.hub.turn import Turn

log = logging.getLogger("gateway.hub.replicas")

SETTLE_WITHIN = 5.0  # s: a turn's row written before its last byte, or behind it past this


def replicated(
    store: Store, settings: HubSettings, data_dir: pathlib.Path | None
) -> Replicated | None:
    """The coordination of a hub on a store other hubs may share (None: SQLite's, alone)."""
    team_store = shared(store, replica_id(settings.replica_id, data_dir))
    return None if team_store is None else Replicated(team_store, settings)


# s: a key revoked here ends its sessions' jobs after this, so that the replicas holding its
# turns end them first, each client told its key was revoked (not that its channel was lost)
REVOKE_GRACE = 1.0


class Replicated:
    """The hub's parts on a replica (see the module's docstring); ``join`` gives it the parts
    the replica's own machinery (``Replication``) keeps in step with the store."""

    turn_type = SettledTurn

    def __init__(self, store: ReplicaStore, settings: HubSettings) -> None:
        self.store = store
        self.settings = settings
        self.learned: dict[SessionKey, str | None] = {}  # a session's job, as admitted
        self._settling: dict[int, tuple[UsageRecord, float, Any]] = {}  # ended, row not written
        self._next_idle_check = -math.inf  # trio clock: the store's idle sessions looked for next

    def join(
        self, *, hub_store: Store, board: Any, channels: Any, sessions: Any, catalog: Any
    ) -> Replication:
        """The replica's machinery over the hub's parts (each made with this coordination)."""
        self.team = Replication(
            self.store,
            self.settings,
            hub_store=hub_store,
            board=board,
            channels=channels,
            sessions=sessions,
            catalog=catalog,
            learned=self.learned,
        )
        self.sync, self.limits = self.team.sync, self.team.limits
        return self.team

    # -- the job board: each decision one conditional statement in the store --------------------

    async def save_job(self, job: Job) -> None:
        await self.sync.save(job)

    async def offered(self, job: Job) -> None:
        await self.sync.save(job)  # the other replicas' runners it now goes to are told

    async def claim_job(self, job: Job, runner_id: str, name: str, run_id: str) -> bool:
        return await self.sync.claim(job, runner_id, name, run_id) is not None

    async def complete_job(self, job: Job, conclusion: str, final: bool) -> bool:
        return await self.sync.complete(job, conclusion, final)

    async def withdraw_job(self, job: Job, reason: str) -> str | None:
        return await self.sync.withdraw(job.id, reason)

    async def decided(self, job: Job) -> None:
        return None  # the decision's statement wrote it

    async def reread_job(self, job_id: str, known: Job | None) -> Job | None:
        return await self.sync.refresh(job_id)

    def runner_seen(self, runner_id: str, changed: bool) -> None:
        self.sync.touched.add(runner_id)
        if changed:
            self.sync.changed = True  # the others told at once

    async def models_saved(self, runner_id: str) -> None:
        await self.store.models_changed(runner_id)  # the others read it again

    # -- the sessions: the store's, ``live`` what this replica knows of them ------------------------

    def session_cap(self, limit: int) -> int:
        return 0  # the admission applies it, in the store

    def revoke_grace(self) -> float:
        return REVOKE_GRACE

    def learned_job(self, key: SessionKey, known: str | None) -> str | None:
        return self.learned.pop(key, known)

    async def bind_session(
        self, session: Any, stored: StoredSession, before: str | None
    ) -> str | None:
        job_id = await self.store.bind_session(stored, before)
        session.job_id = job_id
        if job_id is not None:
            session.had_job = None
        return job_id

    async def reap_sessions(self, sessions: Any) -> float:
        """Idle sessions and revoked keys' ones taken out of the store by one statement each
        (whichever replica runs it first ends their jobs); what this replica knows of sessions
        kept as long as they are used here."""
        idle = sessions.idle_timeout()
        now = trio.current_time()
        for key, session in list(sessions.live.items()):
            if sessions.live.get(key) is not session or session.turns:
                continue
            if session.job_id is None and session.had_job is None:
                del sessions.live[key]
                continue
            if session.job_id is not None and sessions.job_over(session.job_id):
                session.had_job = session.job_id  # its next turn is a failover
                await sessions.bind(session, None)
            if idle > 0 and now - session.last_used > idle:
                del sessions.live[key]  # the store's reaper ends it (this replica's, or another's)
        if now >= sessions.next_key_check:
            sessions.next_key_check = now + sessions.key_check_interval()
            active = await sessions.store.active_key_ids()
            for observe in sessions.on_key_check:
                observe(active)
            for key, session in list(sessions.live.items()):
                if session.key_checked and key[0] not in active and not session.turns:
                    del sessions.live[key]
            for stored in await self.store.revoked_sessions(active):
                sessions.drop(stored.key_name, stored.session_id)
                log.info(
                    "session %s/%s: its API key was revoked: ending job %s",
                    stored.key_name,
                    stored.session_id,
                    stored.job_id,
                )
                if not sessions.job_over(stored.job_id):
                    await sessions.end(stored.job_id, "api key revoked")
        if idle > 0 and now >= self._next_idle_check:
            self._next_idle_check = now + min(idle / 4, 30.0)
            for stored in await self.store.idle_sessions(idle):
                sessions.drop(stored.key_name, stored.session_id)
                log.info(
                    "session %s/%s idle for %g s: ending job %s",
                    stored.key_name,
                    stored.session_id,
                    idle,
                    stored.job_id,
                )
                if not sessions.job_over(stored.job_id):
                    await sessions.end(stored.job_id, "idle")
        due: float = min(sessions.next_key_check, self._next_idle_check if idle > 0 else math.inf)
        return due

    # -- channels and the dispatcher ----------------------------------------------------------

    def remote_channel(self, job_id: str) -> Any:
        return self.team.remote_channel(job_id)

    def awaiting(self, job_id: str) -> bool:
        return self.team.awaiting(job_id)

    def narrows_offers(self) -> bool:
        return False  # the runners' push streams are spread over the replicas

    async def channel_accepted(self, ch: Any) -> None:
        await self.team.accepted(ch)  # the others told, their resumes named in its hello

    # -- the accounting: admitted in the store, each turn settled there before its end ---------------

    async def admit(
        self, accounting: Any, turn: Turn, limits: KeyLimits, budget: Any, funds: Funds | None
    ) -> None:
        await self.limits.admit(turn, limits, accounting.cut_row(turn), funds)
        assert isinstance(turn, SettledTurn)  # ``turn_type``
        turn.hold()  # its answer's last write waits for its row in the store (``settle``)

    def turn_ended(self, accounting: Any, turn: Turn, wall: float) -> None:
        self.limits.ending(turn)  # released and written by ``settle``, before its end
        self._settling[id(turn)] = (accounting.usage_row(turn), wall, accounting)

    async def settle(self, turn: Turn) -> None:
        """The ended turn released and its row written in the store, one statement, waited for
        (its client's last write waits for it). A store that fails or takes over
        ``SETTLE_WITHIN`` s: released and written behind the turn, as a hub alone does it
        (journalled, queued)."""
        assert isinstance(turn, SettledTurn)
        found = self._settling.pop(id(turn), None)
        if found is not None:
            await self._settle(turn, *found)
        turn.release_held()

    async def _settle(self, turn: Turn, record: UsageRecord, wall: float, accounting: Any) -> None:
        with trio.CancelScope(shield=True):  # the hub stopping: written all the same, bounded
            with trio.move_on_after(SETTLE_WITHIN):
                try:
                    await self.limits.settle(turn, record, wall)
                    return
                except StoreError as exc:
                    log.info("turn %s: its row is written behind it: %s", turn.id, exc)
        self.limits.release(turn)
        accounting.write_record(turn.id, record, wall)

    # -- the hub's life and its picture --------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.team.run(task_status=task_status)

    async def restore(self, local: Any) -> None:
        return None  # the replica reads the store as it starts (``Replication.run``)

    def advertise(self, base_url: str) -> None:
        self.team.advertise(base_url)

    def routes(self) -> tuple[list[Guard], list[Route]]:
        relay = self.team.relay
        return [(ROUTE, relay.check)], [
            ("POST", PATHS["request"], relay.request),
            ("POST", PATHS["attach"], relay.attach),
            ("POST", PATHS["frames"], relay.frames),
        ]

    def connected_runners(self) -> set[str] | None:
        return self.team.connected_runners()

    def identity(self) -> Any:
        return self.team.identity()

    def picture(self) -> tuple[bool, list[dict[str, Any]]]:
        return True, self.team.picture()

    async def sessions_listing(self, here: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{camel(k): v for k, v in found.items()} for found in await self._listing()]

    async def held_by_runner(self, runners: list[str]) -> dict[str, tuple[int, int]]:
        held = dict.fromkeys(runners, (0, 0))
        for session in await self._listing():
            rid = session["runner_id"]
            if rid is not None:
                sessions, turns = held.get(rid, (0, 0))
                held[rid] = (sessions + 1, turns + session["turns"])
        return held

    async def _listing(self) -> list[dict[str, Any]]:
        """Every replica's live sessions, as the store lists them."""
        found: list[dict[str, Any]] = await self.store.sessions_listing()
        return found
