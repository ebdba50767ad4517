"""What a team of hubs keeps in its shared store (``ReplicaStore``, PostgreSQL's): the replicas and
their heartbeats, jobs claimed and ended by conditional statements, where each job's channel
is, the runners' presence, the sessions' jobs set by compare-and-set, each turn's admission and
release, and the notifications that keep every replica's memory in step.

Its records are values only; ``shared.shared()`` gives the store's implementation (a
SQLite store has none: its hub is alone). Times are the database's clock: a record says how long
ago something happened (``..._age``, seconds), never a timestamp of another machine."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.hub.store.records import StoredJob, StoredSession, UsageRecord

# the notifications' kinds (``Note.kind``)
JOB = "j"  # a job's row changed (inserted, updated, deleted): read it again
CHANNEL = "c"  # where a job's channel is changed
PRESENCE = "r"  # a runner's capabilities changed: read the presence again
MODELS = "m"  # a runner's model list changed
REPLICA = "p"  # a replica started or stopped
SESSION = "s"  # a session's job changed or the session ended
SUSPENDED = "u"  # a request waits for its job's channel on another replica (a resume)


@dataclass(frozen=True, slots=True)
class Note:
    """One notification: what changed (``kind``), which replica changed it, and about what."""

    kind: str
    replica: str
    subject: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """A replica as the store knows it."""

    id: str
    url: str
    version: str
    started_age: float  # s since it started
    heartbeat_age: float  # s since its last heartbeat
    stopped: bool  # it stopped cleanly, or another replica found it dead


@dataclass(frozen=True, slots=True)
class ChannelRow:
    """Where a job's channel is open: on which replica, for which runner."""

    job_id: str
    replica: str
    runner_id: str


@dataclass(frozen=True, slots=True)
class Presence:
    """A runner's last sign of life at any replica, and what its last poll advertised."""

    runner_id: str
    owner: str
    project: str
    name: str | None
    labels: tuple[str, ...]
    seen_age: float  # s since its last sign of life
    capabilities: frozenset[str] | None  # None: it has not polled
    polled_age: float | None
    stopped: bool = False  # its last poll said it stops (a clean stop: down at once everywhere)


@dataclass(frozen=True, slots=True)
class TeamJob:
    """A job's row as the team reads it: the stored job, the runners it is offered to (None:
    any), and the replica that made it."""

    job: StoredJob
    offered_to: frozenset[str] | None
    replica: str | None


@dataclass(frozen=True, slots=True)
class Admission:
    """A turn's admission: ``verdict`` "ok", or the limit it would pass ("rpm", "tpm",
    "tokens_per_day", "max_streams", "max_sessions") with ``wait`` s until it would not and the
    figures its refusal names (``used``, ``held``); the job the session has in the store, and
    the session evicted to make room (its id and job)."""

    verdict: str
    wait: float
    used: int
    held: int
    job_id: str | None
    evicted_session: str | None
    evicted_job: str | None
    spent: float = 0.0  # a budget's verdict: what the key spent in its day or month
    holding: float = 0.0  # ...and what its turns in flight hold


@dataclass(frozen=True, slots=True)
class Release:
    """A turn's end, for its key's counts: its tokens, and its session's last use."""

    turn_id: str
    key_id: str
    key_name: str
    session: str
    tokens: int
    cost: float = 0.0  # in the hub's currency (0: its model has no price)


@dataclass(frozen=True, slots=True)
class Suspended:
    """A request that waits for its job's channel to come back (docs/protocol.md §6's resume),
    held by ``replica``, with the chunk frames it received."""

    job_id: str
    request_id: str
    replica: str
    frames: int


class ReplicaStore(abc.ABC):
    """The team's statements on the shared store (each one round trip unless said)."""

    replica: str = ""  # this replica's id (the jobs it makes are marked with it)

    # -- replicas ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def heartbeat(self, url: str, version: str) -> None:
        """This replica lives (its row made or renewed; a replica marked stopped lives again)."""

    @abc.abstractmethod
    async def announce(self) -> None:
        """Tell the other replicas this one (re)started (they read the replicas again)."""

    @abc.abstractmethod
    async def replicas(self) -> list[ReplicaRow]:
        """Every replica the store knows, oldest first."""

    @abc.abstractmethod
    async def retire(self, replica: str, older_than: float | None) -> bool:
        """End what ``replica`` left behind (its channels, its turns in flight, its suspended
        requests) and mark it stopped: this replica's own at a clean stop (``older_than``
        None), else another's found silent ``older_than`` s. True when this call did it (one
        replica does, however many find it)."""

    # -- notifications ------------------------------------------------------------------------

    @abc.abstractmethod
    async def listen(
        self,
        notes: Callable[[Note], None],
        connected: Callable[[], Awaitable[None]],
    ) -> None:
        """Until cancelled: every notification (another replica's and this one's) handed to
        ``notes`` as it comes, on a connection of its own (not the pool's); ``connected`` after
        each (re)connect (notifications may have been missed while it was away)."""

    # -- jobs ---------------------------------------------------------------------------------

    @abc.abstractmethod
    async def save_job(self, job: StoredJob, offered_to: frozenset[str] | None) -> None:
        """Insert or update a job, merged with what another replica wrote: a claim, a status,
        a cancellation or an end is never undone by a replica that has not seen it yet."""

    @abc.abstractmethod
    async def claim_job(
        self, job_id: str, runner_id: str, name: str, run_id: str
    ) -> TeamJob | None:
        """Claim a queued, unclaimed, not cancelled job for ``runner_id``; None when it was not
        (another claim or a withdrawal came first)."""

    @abc.abstractmethod
    async def complete_job(self, job_id: str, conclusion: str, final_reported: bool) -> bool:
        """End a job not ended yet; False when another replica ended it first."""

    @abc.abstractmethod
    async def withdraw_job(self, job_id: str, reason: str) -> str | None:
        """Cancel a job not ended: a claimed one is kept (cancelled), an unclaimed one
        deleted. "claimed", "deleted", or None when it was ended or gone already."""

    @abc.abstractmethod
    async def load_job(self, job_id: str) -> TeamJob | None:
        """A job's row with its reports, or None."""

    @abc.abstractmethod
    async def load_jobs(self) -> list[TeamJob]:
        """Every job not completed, with its reports, oldest first."""

    @abc.abstractmethod
    async def orphan_jobs(self, replica: str) -> list[str]:
        """The live front-door jobs ``replica`` made that no session points at."""

    # -- channels -----------------------------------------------------------------------------

    @abc.abstractmethod
    async def channel_opened(self, job_id: str, runner_id: str) -> None:
        """The job's channel is on this replica now (replacing any other's)."""

    @abc.abstractmethod
    async def channel_closed(self, job_id: str) -> None:
        """This replica's channel of the job closed (another replica's is left as it is)."""

    @abc.abstractmethod
    async def channels(self) -> list[ChannelRow]:
        """Every open channel, on whatever replica."""

    @abc.abstractmethod
    async def channel(self, job_id: str) -> ChannelRow | None:
        """Where the job's channel is open, or None."""

    # -- runners ------------------------------------------------------------------------------

    @abc.abstractmethod
    async def write_presence(self, seen: list[Presence], changed: bool) -> None:
        """The runners this replica heard from (each kept at its latest sign of life and
        latest poll, whoever wrote it); ``changed``: a capability changed, the others read it
        now."""

    @abc.abstractmethod
    async def read_presence(self, within: float) -> list[Presence]:
        """Every runner seen within ``within`` s, by any replica."""

    @abc.abstractmethod
    async def models_changed(self, runner_id: str) -> None:
        """Tell the other replicas a runner's model list changed (the list is in the store)."""

    # -- sessions -----------------------------------------------------------------------------

    @abc.abstractmethod
    async def bind_session(self, session: StoredSession, expected: str | None) -> str | None:
        """Point the session at ``session.job_id`` when it points at ``expected`` (None: it has
        no job, or no row) and return it; else the job it points at (another replica bound it
        first). ``session.job_id`` empty: unbind (delete the row while it points at
        ``expected``)."""

    @abc.abstractmethod
    async def load_session(self, key_name: str, session_id: str) -> StoredSession | None:
        """One session's row, or None."""

    @abc.abstractmethod
    async def idle_sessions(self, idle: float) -> list[StoredSession]:
        """Delete the sessions unused for ``idle`` s with no turn in flight; their rows."""

    @abc.abstractmethod
    async def revoked_sessions(self, active: set[str]) -> list[StoredSession]:
        """Delete the sessions of keys not in ``active`` (by key id); their rows."""

    # -- admissions ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def admit(
        self,
        turn_id: str,
        key_id: str,
        key_name: str,
        session: str,
        reserved: int,
        limits: tuple[int | None, int | None, int | None, int | None],
        max_sessions: int,
        expiry: float,
        record: str | None = None,
        budget: tuple[float, float | None, float | None] | None = None,
    ) -> Admission:
        """A turn's admission (``limits``: rpm, tpm, tokens a day, streams; ``expiry``: s of
        silence after which a replica's turns in flight are not counted; ``record``: its usage
        row were it cut now, JSON, kept with it until it is settled; ``budget``: the turn's
        reserved cost, the key's daily and monthly budget, checked first)."""

    @abc.abstractmethod
    async def release(self, ended: list[Release]) -> None:
        """Turns ended (one statement for all)."""

    @abc.abstractmethod
    async def settle(self, ended: Release, record: UsageRecord, at: float) -> bool:
        """A turn ended: released and its usage row written, one statement; False when a
        survivor had settled it already (its row is there)."""

    # -- requests suspended for a resume ------------------------------------------------------

    @abc.abstractmethod
    async def suspend(self, job_id: str, request_id: str, frames: int) -> None:
        """A request of this replica waits for its job's channel to be accepted again."""

    @abc.abstractmethod
    async def unsuspend(self, job_id: str, request_id: str) -> None:
        """It waits no more."""

    @abc.abstractmethod
    async def suspended(self, job_id: str, within: float) -> list[Suspended]:
        """The job's requests waiting for its channel (on any replica) for ``within`` s at
        most; taken (deleted)."""

    # -- the team's picture -------------------------------------------------------------------

    @abc.abstractmethod
    async def sessions_listing(self) -> list[dict[str, Any]]:
        """Every session of the team with its job, runner and last use (s ago)."""
