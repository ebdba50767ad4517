"""The team's store on PostgreSQL (``ReplicaStore``): ``ops``' statements run on the store's
pool, and the one listening connection of each replica (``LISTEN``, outside the pool) that
hands every notification to the team as it comes, reconnecting on its own."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import trio
from psycopg import pq

from gateway.hub.replicas.store import ops, usage
from gateway.hub.replicas.store.base import (
    Admission,
    ChannelRow,
    Note,
    Presence,
    Release,
    ReplicaRow,
    ReplicaStore,
    Suspended,
    TeamJob,
)
from gateway.hub.store.postgres_io import PgFailure, TrioConnection
from gateway.hub.store.postgres_ops import Op, Query
from gateway.hub.store.records import StoredJob, StoredSession, UsageRecord


class _StorePool(Protocol):
    """What the team needs of ``PostgresStore``: its pool, and what its listener connects to."""

    where: str
    _params: dict[str, str]
    _url: str

    async def _run(self, op: Op[T]) -> T: ...

    def _unavailable(self, detail: str) -> Exception: ...


log = logging.getLogger("gateway.hub.store")

T = TypeVar("T")
RETRY_AFTER = 1.0  # s between tries to listen again on a database that went away
# the listening connection is idle for long: TCP keepalives find a path that died meanwhile
KEEPALIVES = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
}


class PostgresReplicaStore(ReplicaStore):
    """The team's statements on ``store``'s pool, as replica ``replica``."""

    def __init__(self, store: _StorePool, replica: str) -> None:
        self.store = store
        self.replica = replica

    async def _run(self, op: Op[T]) -> T:
        return await self.store._run(op)

    # -- replicas -----------------------------------------------------------------------------

    async def heartbeat(self, url: str, version: str) -> None:
        await self._run(ops.heartbeat(self.replica, url, version))

    async def announce(self) -> None:
        """Tell the other replicas this one (re)started."""
        await self._run(ops.started(self.replica))

    async def replicas(self) -> list[ReplicaRow]:
        return await self._run(ops.replicas())

    async def retire(self, replica: str, older_than: float | None) -> bool:
        return await self._run(ops.retire(self.replica, replica, older_than))

    # -- notifications ------------------------------------------------------------------------

    async def listen(
        self, notes: Callable[[Note], None], connected: Callable[[], Awaitable[None]]
    ) -> None:
        store = self.store
        params = {**KEEPALIVES, **store._params}
        while True:
            conn: TrioConnection | None = None
            try:
                conn = await TrioConnection.connect(params, store._url)
                await conn.run(_listen())
                await connected()
                await _receive(conn.pgconn, notes)
            except Exception as exc:  # the connection or the database is gone
                # said once, as the store says it (its calls fail too, or will)
                store._unavailable(f"its notifications stopped: {_first_line(exc)}")
                log.debug("replica %s: listening again in %g s", self.replica, RETRY_AFTER)
            finally:
                if conn is not None:
                    conn.close()
            await trio.sleep(RETRY_AFTER)

    # -- jobs ---------------------------------------------------------------------------------

    async def save_job(self, job: StoredJob, offered_to: frozenset[str] | None) -> None:
        await self._run(ops.save_job(self.replica, job, offered_to))

    async def claim_job(
        self, job_id: str, runner_id: str, name: str, run_id: str
    ) -> TeamJob | None:
        return await self._run(ops.claim_job(self.replica, job_id, runner_id, name, run_id))

    async def complete_job(self, job_id: str, conclusion: str, final_reported: bool) -> bool:
        return await self._run(ops.complete_job(self.replica, job_id, conclusion, final_reported))

    async def withdraw_job(self, job_id: str, reason: str) -> str | None:
        return await self._run(ops.withdraw_job(self.replica, job_id, reason))

    async def load_job(self, job_id: str) -> TeamJob | None:
        return await self._run(ops.load_job(job_id))

    async def load_jobs(self) -> list[TeamJob]:
        return await self._run(ops.load_jobs())

    async def orphan_jobs(self, replica: str) -> list[str]:
        return await self._run(ops.orphan_jobs(replica))

    # -- channels -----------------------------------------------------------------------------

    async def channel_opened(self, job_id: str, runner_id: str) -> None:
        await self._run(ops.channel_opened(self.replica, job_id, runner_id))

    async def channel_closed(self, job_id: str) -> None:
        await self._run(ops.channel_closed(self.replica, job_id))

    async def channels(self) -> list[ChannelRow]:
        return await self._run(ops.channels())

    async def channel(self, job_id: str) -> ChannelRow | None:
        return await self._run(ops.channel(job_id))

    # -- runners ------------------------------------------------------------------------------

    async def write_presence(self, seen: list[Presence], changed: bool) -> None:
        await self._run(ops.write_presence(self.replica, seen, changed))

    async def read_presence(self, within: float) -> list[Presence]:
        return await self._run(ops.read_presence(within))

    async def models_changed(self, runner_id: str) -> None:
        await self._run(ops.models_changed(self.replica, runner_id))

    # -- sessions -----------------------------------------------------------------------------

    async def bind_session(self, session: StoredSession, expected: str | None) -> str | None:
        return await self._run(ops.bind_session(self.replica, session, expected))

    async def load_session(self, key_name: str, session_id: str) -> StoredSession | None:
        return await self._run(ops.load_session(key_name, session_id))

    async def idle_sessions(self, idle: float) -> list[StoredSession]:
        return await self._run(ops.idle_sessions(self.replica, idle))

    async def revoked_sessions(self, active: set[str]) -> list[StoredSession]:
        return await self._run(ops.revoked_sessions(self.replica, active))

    async def sessions_listing(self) -> list[dict[str, Any]]:
        return await self._run(ops.sessions_listing())

    # -- admissions ---------------------------------------------------------------------------

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
        return await self._run(
            ops.admit(
                self.replica,
                turn_id,
                key_id,
                key_name,
                session,
                reserved,
                limits,
                max_sessions,
                expiry,
                record,
                budget,
            )
        )

    async def release(self, ended: list[Release]) -> None:
        await self._run(ops.release(ended))

    async def settle(self, ended: Release, record: UsageRecord, at: float) -> bool:
        return await self._run(
            usage.settle(
                ended.turn_id, ended.tokens, ended.key_name, ended.session, record, at, ended.cost
            )
        )

    # -- requests suspended for a resume ------------------------------------------------------

    async def suspend(self, job_id: str, request_id: str, frames: int) -> None:
        await self._run(ops.suspend(self.replica, job_id, request_id, frames))

    async def unsuspend(self, job_id: str, request_id: str) -> None:
        await self._run(ops.unsuspend(job_id, request_id))

    async def suspended(self, job_id: str, within: float) -> list[Suspended]:
        return await self._run(ops.suspended(job_id, within))


def _listen() -> Op[None]:
    yield Query(f"LISTEN {ops.NOTIFY_CHANNEL}")


async def _receive(pgconn: pq.abc.PGconn, notes: Callable[[Note], None]) -> None:
    """Every notification on ``pgconn`` to ``notes``, until the connection fails."""
    fd = pgconn.socket
    while True:
        while (found := pgconn.notifies()) is not None:
            note = ops.note_of(found.extra.decode("utf-8", "replace"))
            if note is not None:
                notes(note)
        await trio.lowlevel.wait_readable(fd)
        pgconn.consume_input()
        if pgconn.status != pq.ConnStatus.OK:
            raise PgFailure("the listening connection ended", "down")


def _first_line(exc: Exception) -> str:
    text = getattr(exc, "detail", None) or str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
