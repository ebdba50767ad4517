"""The one seam between the hub's parts and replication: what the job board, the sessions, the
accounting, the channels and the dispatcher do differently when other hubs share the store
(``Coordination``), and what a hub alone does there (``Alone``: the local write, or nothing).

A part never asks whether it runs alone: it calls its coordination, which a hub alone makes
``Alone`` and a replica makes ``gateway.hub.replicas.coordination.Replicated`` (the wiring's
choice, ``gateway.hub.hub``). Each decision two replicas could race for is one method here (a
claim, a job's end, a withdrawal, a session's job), so a hub alone writes what it decided and a
replica has the shared store decide it. Nothing here runs per chunk; per turn, a method call.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from gateway.hub.job import Job
from gateway.hub.store import KeyLimits, Store, StoredSession
from gateway.hub.turn import Turn

SessionKey = tuple[str, str]  # (API key id, session id): ``gateway.hub.sessions``'
Funds = tuple[float, float | None, float | None]  # the cost a turn holds, daily, monthly budget
Route = tuple[str, str, Callable[..., Awaitable[None]]]  # method, path pattern, handler
Guard = tuple[str, Callable[..., None]]  # path prefix, check run before its routes


class Coordination(Protocol):
    """What the hub's parts call where replicas would share a decision or a write (see the
    module's docstring). ``Any`` stands for a part's own type (a session, the sessions, the
    accounting, a channel): the parts import this module, not the other way."""

    @property
    def turn_type(self) -> type[Turn]:
        """A front-door turn's class (a replica's holds its last write: ``settle``)."""
        ...

    # -- the job board ---------------------------------------------------------------------
    async def save_job(self, job: Job) -> None:
        """The job's state written (after every change the board makes alone)."""

    async def offered(self, job: Job) -> None:
        """An unclaimed job is offered to other runners now (``job.runners``)."""

    async def claim_job(self, job: Job, runner_id: str, name: str, run_id: str) -> bool:
        """Whether this claim is the job's (False: another claim or a withdrawal came first)."""
        ...

    async def complete_job(self, job: Job, conclusion: str, final: bool) -> bool:
        """Whether this end is the job's (False: it was ended first elsewhere)."""
        ...

    async def withdraw_job(self, job: Job, reason: str) -> str | None:
        """The job withdrawn: ``deleted`` (never claimed), ``cancelled``, or None (ended
        meanwhile elsewhere)."""
        ...

    async def decided(self, job: Job) -> None:
        """The board applied a claim, an end or a withdrawal to the job: written, unless the
        decision wrote it already."""

    async def reread_job(self, job_id: str, known: Job | None) -> Job | None:
        """The job as the shared store has it now, into the board (alone: ``known``)."""
        ...

    def runner_seen(self, runner_id: str, changed: bool) -> None:
        """A runner gave a sign of life (``changed``: new here, or its capabilities changed)."""

    async def models_saved(self, runner_id: str) -> None:
        """A runner's model list was written to the store (replicas: the others read it again)."""

    # -- the sessions --------------------------------------------------------------------
    def session_cap(self, limit: int) -> int:
        """The key's session cap the sessions table applies (0: the admission applies it)."""
        ...

    def revoke_grace(self) -> float:
        """Seconds before a key revoked here ends its sessions' jobs (-inf: at once)."""
        ...

    def learned_job(self, key: SessionKey, known: str | None) -> str | None:
        """The session's job as its turn's admission found it (alone: ``known``)."""
        ...

    async def bind_session(
        self, session: Any, stored: StoredSession, before: str | None
    ) -> str | None:
        """The session pointed at ``stored.job_id`` ("" none), in memory and the store; the
        job it points at then (another, when another hub set it first)."""
        ...

    async def reap_sessions(self, sessions: Any) -> float:
        """``Sessions._reap``: idle, finished and revoked keys' sessions ended; when next due."""
        ...

    # -- channels and the dispatcher ---------------------------------------------------------
    def remote_channel(self, job_id: str) -> Any:
        """The job's channel another hub holds, when it is up (None: none)."""

    def awaiting(self, job_id: str) -> bool:
        """Whether the job's channel went with a hub that is down (its runner redials)."""
        ...

    def narrows_offers(self) -> bool:
        """Whether a new job may be offered to one chosen runner (every push stream is here)."""
        ...

    async def channel_accepted(self, ch: Any) -> None:
        """A channel accepted here, before its hello goes (the hello may name more resumes)."""

    # -- the accounting and a turn --------------------------------------------------------------
    async def admit(
        self, accounting: Any, turn: Turn, limits: KeyLimits, budget: Any, funds: Funds | None
    ) -> None:
        """The turn checked against its key's limits (LimitExceeded, TooManySessions) and, when
        they are shared, counted where they are."""

    def turn_ended(self, accounting: Any, turn: Turn, wall: float) -> None:
        """An admitted turn ended: its usage row on its way (``wall``: the row's time)."""

    async def settle(self, turn: Turn) -> None:
        """The turn's last write may go (a replica's waits for its row in the store)."""

    # -- the hub's life and its picture ------------------------------------------------------------
    def join(
        self, *, hub_store: Store, board: Any, channels: Any, sessions: Any, catalog: Any
    ) -> Any:
        """The parts made with this coordination, given to it (a replica's own machinery keeps
        them in step with the store: it is returned; None alone)."""

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The coordination's own work while the hub serves (``started`` when it may serve)."""

    async def restore(self, local: Callable[[], Awaitable[None]]) -> None:
        """The hub's memory read back before it serves: ``local`` reads it from the store."""

    def advertise(self, base_url: str) -> None:
        """The hub serves at ``base_url``."""

    def routes(self) -> tuple[list[Guard], list[Route]]:
        """The routes other hubs reach this one by, with their guards."""
        ...

    def connected_runners(self) -> set[str] | None:
        """Runners with a channel open on any hub (None: this hub's are all)."""
        ...

    def identity(self) -> Any:
        """This hub as a replica (``snapshot.ReplicaStatus``; None: alone)."""
        ...

    def picture(self) -> tuple[bool, list[dict[str, Any]]]:
        """Whether this hub is a replica, and every replica as last read."""
        ...

    async def sessions_listing(self, here: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The live sessions the admin API lists (``here``: this hub's own, as JSON)."""
        ...

    async def held_by_runner(self, runners: list[str]) -> dict[str, tuple[int, int]]:
        """Runner id -> (sessions, turns in flight) counted on every hub (none: this hub's)."""
        ...


class Alone:
    """A hub alone on its store: the board's and the sessions' writes are the store's plain
    ones, the accounting counts in memory, and no other hub holds a channel."""

    turn_type = Turn

    def __init__(self, store: Store | None = None) -> None:
        self._kept = store  # None: an accounting alone in memory (tests): nothing written

    @property
    def store(self) -> Store:
        assert self._kept is not None, "a hub alone's board and sessions have a store"
        return self._kept

    async def save_job(self, job: Job) -> None:
        await self.store.save_job(job.record())

    async def offered(self, job: Job) -> None:
        return None  # whom it is offered to is this hub's memory alone

    async def claim_job(self, job: Job, runner_id: str, name: str, run_id: str) -> bool:
        return True  # the board's check, with no await before it applies it, is the decision

    async def complete_job(self, job: Job, conclusion: str, final: bool) -> bool:
        return True

    async def withdraw_job(self, job: Job, reason: str) -> str | None:
        # no await: the board applies it before anything else runs (then ``decided``)
        return "deleted" if job.claimed_by is None else "cancelled"

    async def decided(self, job: Job) -> None:
        if job.cancelled and job.claimed_by is None:  # withdrawn before a claim: forgotten
            await self.store.delete_job(job.id)
        else:
            await self.save_job(job)

    async def reread_job(self, job_id: str, known: Job | None) -> Job | None:
        return known

    def runner_seen(self, runner_id: str, changed: bool) -> None:
        return None

    async def models_saved(self, runner_id: str) -> None:
        return None

    def session_cap(self, limit: int) -> int:
        return limit

    def revoke_grace(self) -> float:
        return -math.inf

    def learned_job(self, key: SessionKey, known: str | None) -> str | None:
        return known

    async def bind_session(
        self, session: Any, stored: StoredSession, before: str | None
    ) -> str | None:
        job_id = stored.job_id or None
        session.job_id = job_id
        if job_id is None:
            await self.store.delete_session(stored.key_name, stored.session_id, before)
        else:
            session.had_job = None
            await self.store.save_session(stored)
        return job_id

    async def reap_sessions(self, sessions: Any) -> float:
        result: float = await sessions.reap_here()
        return result

    def remote_channel(self, job_id: str) -> Any:
        return None

    def awaiting(self, job_id: str) -> bool:
        return False

    def narrows_offers(self) -> bool:
        return True

    async def channel_accepted(self, ch: Any) -> None:
        return None

    async def admit(
        self, accounting: Any, turn: Turn, limits: KeyLimits, budget: Any, funds: Funds | None
    ) -> None:
        await accounting.admit_here(turn, limits, budget, funds is not None)

    def turn_ended(self, accounting: Any, turn: Turn, wall: float) -> None:
        accounting.write_row(turn, wall)

    async def settle(self, turn: Turn) -> None:
        return None

    def join(
        self, *, hub_store: Store, board: Any, channels: Any, sessions: Any, catalog: Any
    ) -> Any:
        return None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def restore(self, local: Callable[[], Awaitable[None]]) -> None:
        await local()

    def advertise(self, base_url: str) -> None:
        return None

    def routes(self) -> tuple[list[Guard], list[Route]]:
        return [], []

    def connected_runners(self) -> set[str] | None:
        return None

    def identity(self) -> Any:
        return None

    def picture(self) -> tuple[bool, list[dict[str, Any]]]:
        return False, []

    async def sessions_listing(self, here: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return here

    async def held_by_runner(self, runners: list[str]) -> dict[str, tuple[int, int]]:
        return {}  # the snapshot's own counts are every count
