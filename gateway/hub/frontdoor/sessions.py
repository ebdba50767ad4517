"""Chat sessions: (API key, X-Chat-Session) -> one Chat Job, stored, ended when idle."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import msgspec
import trio

from gateway import protocol
from gateway.hub.board import JobBoard
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.frontdoor.relay import reply_decoder
from gateway.hub.frontdoor.shapes import no_runner
from gateway.hub.http import HTTPError
from gateway.hub.settings import HubSettings
from gateway.hub.store import Store, StoredSession

log = logging.getLogger("gateway.hub.frontdoor")

SessionKey = tuple[str, str]  # (API key name, session id)
CHAT_DEFINITION = {"jobType": "chat_llm", "needs": [protocol.CAPABILITY]}


@dataclass(eq=False)
class Session:
    """One chat session: (API key name, X-Chat-Session) -> its Chat Job."""

    key: SessionKey
    owner: str
    project: str
    lock: trio.Lock = field(default_factory=trio.Lock)
    job_id: str | None = None
    turns: int = 0  # requests in flight (waiting for the channel or relaying)
    last_used: float = field(default_factory=trio.current_time)
    # the last failed attempt to get a channel (when, why): requests that queued on the
    # lock behind it share its answer instead of each waiting out another timeout
    failure: tuple[float, HTTPError] | None = None


class Sessions:
    """Every live session of one hub, the channels it drains, and their background work (``run``)."""

    def __init__(
        self,
        store: Store,
        settings: HubSettings,
        board: JobBoard,
        channels: Channels,
        counters: HubCounters,
    ) -> None:
        self.counters = counters
        self.store = store
        self.settings = settings
        self.board = board
        self.channels = channels
        self.live: dict[SessionKey, Session] = {}
        self._changed = trio.Event()
        self._drained: set[ServerChannel] = set()  # channels whose recv() a drain task reads
        self._to_drain: list[ServerChannel] = []  # adopted, their drain task not started yet
        self._restored = False
        # sessions forgotten because their job ended under them (its runner stopped): their next
        # turn is a failover, counted as one: key -> (job id, when)
        self._ended: dict[SessionKey, tuple[str, float]] = {}

    def listing(self) -> dict[SessionKey, str | None]:
        """The live sessions: (API key name, session id) -> job id."""
        return {key: s.job_id for key, s in self.live.items()}

    def poke(self) -> None:
        """Wake ``run``: a session or a channel changed."""
        self._changed.set()

    # -- one session's turns ----------------------------------------------------------

    def enter(self, key: SessionKey, owner: str, project: str) -> Session:
        """The session of ``key`` (created if new), counted busy until ``leave``."""
        session = self.live.get(key)
        if session is None:
            session = self.live[key] = Session(key, owner, project)
        session.turns += 1
        return session

    def leave(self, session: Session) -> None:
        session.turns -= 1
        session.last_used = trio.current_time()
        if session.job_id is None and not session.turns and self.live.get(session.key) is session:
            del self.live[session.key]
        self.poke()

    def job_over(self, job_id: str) -> bool:
        """True when no further turn can be served by this job (completed, cancelled, ended)."""
        job = self.board.jobs.get(job_id)
        if job is None or job.over:
            return True
        return job_id in self.channels.runner_ended

    async def channel_of(
        self, session: Session, traceparent: str | None = None
    ) -> tuple[str, ServerChannel]:
        """The session's (job id, open channel). Lock held. A job opened here carries
        ``traceparent`` in its definition, when given.

        A channel that is gone is waited for while its runner may redial (``reconnect_timeout``),
        but not at all once the job cannot come back (its runner ended it with chat.end, reported
        it final, or went offline). Then, or when the session has no job yet, a new Chat Job is
        opened at once for any capable runner, and the session maps to it (a failover when the
        session had a job).
        """
        old = session.job_id
        ended = self._ended.pop(session.key, None)
        if old is None and ended is not None:
            old = ended[0]  # forgotten when its job ended: this turn moves it all the same
        if old is not None and not self.job_over(old):
            ch = self.channels.get(old)
            if ch is None:  # momentarily reconnecting: wait, bounded (None at once if it ends)
                within = min(self.settings.reconnect_timeout, self.settings.runner_wait_timeout)
                ch = await self.channels.wait(old, within)
                if ch is None and not self.job_over(old):
                    log.warning("job %s: channel did not reconnect within %g s", old, within)
                    with trio.CancelScope(shield=True):
                        await self.channels.cancel_job(old, "channel lost")
            if ch is not None:
                self._adopt(ch)
                return old, ch
        if session.job_id is not None:
            self._bind(session, None)
        job_id, ch = await self.open_job(
            session.owner,
            session.project,
            self.settings.runner_wait_timeout,
            traceparent=traceparent,
        )
        self._bind(session, job_id)
        self._adopt(ch)
        if old is not None:
            self.counters.failovers += 1
            log.warning(
                "session %s/%s: job %s is gone, failed over to job %s (runner %s); failovers: %d",
                session.key[0],
                session.key[1],
                old,
                job_id,
                ch.runner_id,
                self.counters.failovers,
            )
        else:
            log.info("session %s/%s opened chat job %s", session.key[0], session.key[1], job_id)
        return job_id, ch

    async def open_job(
        self,
        owner: str,
        project: str,
        within: float,
        purpose: str = "",
        traceparent: str | None = None,
    ) -> tuple[str, ServerChannel]:
        """A new front-door Chat Job and its channel, once a runner claimed it and dialled in;
        the job is withdrawn and ``no_runner`` raised when none does within ``within`` s."""
        definition = dict(CHAT_DEFINITION)
        if traceparent is not None:
            definition["traceparent"] = traceparent
        job = self.board.enqueue(
            owner,
            project,
            needs=[protocol.CAPABILITY],
            agent_definition=definition,
            origin="frontdoor",
        )
        ch = None
        try:
            ch = await self.channels.wait(job.id, within)
        finally:
            if ch is None:
                with trio.CancelScope(shield=True):
                    await self.channels.cancel_job(job.id, "no runner")
        if ch is None:
            log.warning(
                "no runner with %s connected within %g s (job %s%s)",
                protocol.CAPABILITY,
                within,
                job.id,
                purpose,
            )
            raise no_runner(within, purpose)
        return job.id, ch

    def _bind(self, session: Session, job_id: str | None) -> None:
        """Point the session at ``job_id`` (None: at no job), in memory and in the store."""
        session.job_id = job_id
        if job_id is None:
            self.store.delete_session(*session.key)
        else:
            key_name, session_id = session.key
            stored = StoredSession(key_name, session_id, session.owner, session.project, job_id)
            self.store.save_session(stored)

    def _forget(self, key: SessionKey) -> None:
        self.live.pop(key, None)
        self.store.delete_session(*key)

    # -- across restarts ---------------------------------------------------------------

    def restore(self) -> None:
        """Reload the stored sessions whose job can still serve (once, before serving).

        A front-door job that no stored session points at lost its client in the restart: it is
        withdrawn, so its runner's redial is refused and the runner reports the job's outcome.
        """
        if self._restored:
            return
        self._restored = True
        now = trio.current_time()
        kept: set[str] = set()
        for stored in self.store.load_sessions():
            key = (stored.key_name, stored.session_id)
            if key in self.live or self.job_over(stored.job_id):
                if key not in self.live:
                    self.store.delete_session(*key)
                continue
            self.live[key] = Session(
                key, stored.owner, stored.project, job_id=stored.job_id, last_used=now
            )
            kept.add(stored.job_id)
        for job in list(self.board.jobs.values()):
            if job.origin == "frontdoor" and job.id not in kept and not self.job_over(job.id):
                self.board.withdraw(job.id, "its chat session was lost in a hub restart")
        if self.live:
            log.info("restored %d chat session(s)", len(self.live))

    # -- background work ----------------------------------------------------------------

    def _adopt(self, ch: ServerChannel) -> None:
        """Have ``run`` read the channel's unrouted frames (late replies, the runner's chat.end)."""
        if ch not in self._drained and not ch.closed.is_set():
            self._drained.add(ch)
            self._to_drain.append(ch)
            self.poke()

    async def _drain(self, ch: ServerChannel) -> None:
        """Read a channel's unrouted frames until it closes: note a runner's chat.end, log the rest."""
        try:
            while True:
                try:
                    text, _t_recv = await ch.recv()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                try:
                    reply = reply_decoder.decode(text)
                except msgspec.DecodeError:
                    log.debug("job %s: ignoring an undecodable frame", ch.job_id)
                    continue
                if reply.type == protocol.END:
                    log.info("job %s: the runner ended the session (%s)", ch.job_id, reply.reason)
                    self.poke()
                else:
                    log.debug("job %s: late or unrouted %s frame", ch.job_id, reply.type)
        finally:
            self._drained.discard(ch)

    async def _reap(self) -> float:
        """Forget finished sessions, end idle ones; returns when the next one falls due."""
        idle = self.settings.session_idle_timeout
        now = trio.current_time()
        next_due = math.inf
        for key, session in list(self.live.items()):
            if self.live.get(key) is not session or session.turns or session.lock.locked():
                continue  # replaced while we awaited, or busy
            if session.job_id is None or self.job_over(session.job_id):
                if session.job_id is not None:
                    self._ended[key] = (session.job_id, now)
                self._forget(key)
                continue
            due = session.last_used + idle if idle and idle > 0 else math.inf
            if due > now:
                next_due = min(next_due, due)
                continue
            self._forget(key)
            log.info(
                "session %s/%s idle for %g s: ending job %s", key[0], key[1], idle, session.job_id
            )
            try:
                await self.channels.end_job(session.job_id, "idle")
            except Exception as exc:
                log.warning("could not end idle job %s: %r", session.job_id, exc)
        self.channels.runner_ended.intersection_update(s.job_id for s in self.live.values())
        for key, (_job_id, at) in list(self._ended.items()):
            if not idle or now - at > idle:
                del self._ended[key]
        return next_due

    async def run(self) -> None:
        """End idle sessions with ``chat.end`` ("idle"), forget finished ones, drain channels."""
        async with trio.open_nursery() as nursery:
            while True:
                self._changed = trio.Event()
                while self._to_drain:
                    nursery.start_soon(self._drain, self._to_drain.pop())
                next_due = await self._reap()
                if self._changed.is_set():
                    continue
                with trio.move_on_at(next_due):
                    await self._changed.wait()
