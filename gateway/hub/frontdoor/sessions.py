"""Chat sessions: (API key, X-Chat-Session) -> one Chat Job, stored, ended when idle."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import trio

from gateway.hub.board import Job, JobBoard
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.frontdoor.queue import Entry, FairQueue, QueueStats, WaitStats
from gateway.hub.frontdoor.relay import reply_decoder
from gateway.hub.frontdoor.shapes import (
    no_capable_runner,
    no_runner,
    no_runner_connected,
    queue_full,
    queue_timeout,
    too_many_sessions,
)
from gateway.hub.http import HTTPError
from gateway.hub.settings import HubSettings
from gateway.hub.store import ApiKey, Store, StoredSession
from gateway.wire import protocol

log = logging.getLogger("gateway.hub.frontdoor")

SessionKey = tuple[str, str]  # (API key id, session id)
CHAT_DEFINITION = {"jobType": "chat_llm", "needs": [protocol.CAPABILITY]}
LEGACY_KEY = "name:"  # the key part of a restored session whose key is known by name only
Keepalive = Callable[[], Awaitable[None]]  # keeps a waiting client patient (a streamed turn)


@dataclass(eq=False)
class Session:
    """One chat session: (API key, X-Chat-Session) -> its Chat Job."""

    key: SessionKey  # (the key's id, the session id): a new key with an old name starts afresh
    owner: str
    project: str
    key_name: str = ""  # for listings and log lines
    lock: trio.Lock = field(default_factory=trio.Lock)
    job_id: str | None = None
    turns: int = 0  # requests in flight (waiting for the channel or relaying)
    last_used: float = field(default_factory=trio.current_time)
    used: int = 0  # the order of last use among the hub's sessions (a tie on the clock breaks)
    # the last failed attempt to get a channel (when, why): requests that queued on the
    # lock behind it share its answer instead of each waiting out another timeout
    failure: tuple[float, HTTPError] | None = None

    @property
    def name(self) -> str:
        """``key name/session id``, for log lines (never the key itself)."""
        return f"{self.key_name}/{self.key[1]}"

    @property
    def key_checked(self) -> bool:
        """Whether the key's revocation is watched (not for a session restored by name only)."""
        return not self.key[0].startswith(LEGACY_KEY)


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
        self._next_key_check = -math.inf  # trio clock: when the sessions' keys are checked next
        # told the active key ids at each check (the front door drops what it kept of others)
        self.on_key_check: Callable[[set[str]], None] | None = None
        self._uses = 0  # sessions left so far (their ``used`` order)
        # requests waiting for a runner to take their new job, per project (owner, project)
        self._queues: dict[tuple[str, str], FairQueue] = {}
        self._waits = WaitStats()  # how long the queued ones waited

    def listing(self) -> dict[tuple[str, str], str | None]:
        """The live sessions: (API key name, session id) -> job id."""
        return {(s.key_name, key[1]): s.job_id for key, s in self.live.items()}

    def poke(self) -> None:
        """Wake ``run``: a session or a channel changed."""
        self._changed.set()

    def check_keys(self) -> None:
        """Check the live sessions' API keys now (one was revoked in this process)."""
        self._next_key_check = -math.inf
        self.poke()

    # -- one session's turns ----------------------------------------------------------

    async def enter(self, key: ApiKey, session_id: str) -> Session:
        """The session ``session_id`` of API key ``key`` (created if new), counted busy until
        ``leave``. A key holds at most ``max_sessions_per_key``: a new session past it ends the
        key's least recently used idle session; when none is idle, HTTPError 429."""
        skey = (key.id or LEGACY_KEY + key.name, session_id)
        session = self.live.get(skey)
        evicted: Session | None = None
        if session is None:
            limit = self.settings.max_sessions_per_key
            if limit > 0:
                held = [s for k, s in self.live.items() if k[0] == skey[0]]
                if len(held) >= limit:
                    idle = [s for s in held if not s.turns and not s.lock.locked()]
                    if not idle:
                        log.warning(
                            "API key %s holds %d busy sessions: session %s refused",
                            key.name,
                            len(held),
                            session_id,
                        )
                        raise too_many_sessions(limit)
                    evicted = min(idle, key=lambda s: (s.last_used, s.used))
                    await self._forget(evicted)
            session = self.live[skey] = Session(skey, key.owner, key.project, key.name)
        session.turns += 1
        if evicted is not None and evicted.job_id is not None:
            log.info(
                "API key %s at %d sessions: ending its least recently used session %s (job %s)",
                key.name,
                self.settings.max_sessions_per_key,
                evicted.name,
                evicted.job_id,
            )
            await self._end_job(evicted.job_id, "session ended: its API key opened too many")
        return session

    def leave(self, session: Session) -> None:
        session.turns -= 1
        session.last_used = trio.current_time()
        self._uses += 1
        session.used = self._uses
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
        self, session: Session, traceparent: str | None = None, keepalive: Keepalive | None = None
    ) -> tuple[str, ServerChannel]:
        """The session's (job id, open channel). Lock held. A job opened here carries
        ``traceparent`` in its definition, when given; ``keepalive`` is awaited now and then
        while the turn waits in the queue (``open_job``).

        A channel that is gone moves the session at once to a new Chat Job when another runner
        of the project is free (its last poll advertised chat-llm:v1): the old job is withdrawn,
        so its runner, if alive, is refused its redial. With no other runner free it is waited
        for while its runner may redial (``reconnect_timeout``), but not at all once the job
        cannot come back (its runner ended it with chat.end, reported it final, or went
        offline). Then, or when the session has no job yet, a new Chat Job is opened for any
        capable runner, and the session maps to it (a failover when the session had a job).
        """
        old = session.job_id
        ended = self._ended.pop(session.key, None)
        if old is None and ended is not None:
            old = ended[0]  # forgotten when its job ended: this turn moves it all the same
        if old is not None and not self.job_over(old):
            ch = self.channels.get(old)
            if ch is None:
                job = self.board.jobs.get(old)
                holder = job.claimed_by if job is not None else None
                others = self.board.availability(
                    session.owner, session.project, protocol.CAPABILITY, exclude=holder
                )
                if others.free:  # another runner can serve it now: no wait for the dead
                    self.counters.failovers_immediate += 1
                    log.warning(
                        "job %s: channel gone and %d other runner(s) free: moving session %s "
                        "at once (immediate failovers: %d)",
                        old,
                        others.free,
                        session.name,
                        self.counters.failovers_immediate,
                    )
                    with trio.CancelScope(shield=True):
                        await self.channels.cancel_job(old, "channel lost")
                else:  # momentarily reconnecting: wait, bounded (None at once if it ends)
                    self.counters.redial_waits += 1
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
            await self._bind(session, None)
        job_id, ch = await self.open_job(
            session.owner,
            session.project,
            self.settings.runner_wait_timeout,
            traceparent=traceparent,
            lane=session.key[0],
            keepalive=keepalive,
        )
        await self._bind(session, job_id)
        self._adopt(ch)
        if old is not None:
            self.counters.failovers += 1
            log.warning(
                "session %s: job %s is gone, failed over to job %s (runner %s); failovers: %d",
                session.name,
                old,
                job_id,
                ch.runner_id,
                self.counters.failovers,
            )
        else:
            log.info("session %s opened chat job %s", session.name, job_id)
        return job_id, ch

    def refuse_now(self, owner: str, project: str, purpose: str = "") -> None:
        """HTTPError at once when no job of ``owner/project`` could be served soon: no runner
        connected, or runners connected but none advertising chat-llm:v1 and none busy."""
        available = self.board.availability(owner, project, protocol.CAPABILITY)
        if not available.live:
            raise no_runner_connected(owner, project, purpose)
        if not (available.free or available.unknown or available.busy):
            raise no_capable_runner(available.live, purpose)

    async def open_job(
        self,
        owner: str,
        project: str,
        within: float,
        purpose: str = "",
        traceparent: str | None = None,
        lane: str = "",
        keepalive: Keepalive | None = None,
    ) -> tuple[str, ServerChannel]:
        """A new front-door Chat Job and its channel, once a runner claimed it and dialled in.

        Answered at once (HTTPError 503, before any job) when no runner of the project is
        connected or none advertises chat-llm:v1 (``refuse_now``). When a runner may take it
        now and nobody waits, the job is opened at once; otherwise the request waits in the
        project's fair queue (``lane``: its API key; ``FairQueue``) for a runner to free up, at
        most ``queue_wait`` s (then 503 ``queue_timeout``), and only when fewer than
        ``queue_length`` wait (else 503 ``queue_full`` at once), both with Retry-After and its
        position; ``keepalive`` is awaited every ``keepalive_interval`` s while it waits there.
        ``no_runner`` when no runner took it within ``within`` s although one could. The job
        is withdrawn whenever no channel came."""
        self.refuse_now(owner, project, purpose)
        queue = self._queues.setdefault((owner, project), FairQueue())
        entry = Entry(lane, trio.current_time())
        ch = None
        try:
            job = await self._queued(
                owner, project, queue, entry, within, purpose, traceparent, keepalive
            )
            # a request that waited in the queue gets ``within`` for the dial from its claim
            give_up = (trio.current_time() if entry.waited else entry.arrived) + within
            ch = await self._wait_channel(job, give_up, within, purpose)
        finally:
            if entry in queue:  # cancelled (the client left) or refused: out at once
                self._leave(owner, project, entry)
            elif not len(queue) and self._queues.get((owner, project)) is queue:
                del self._queues[(owner, project)]
            held = entry.job
            if ch is None and held is not None:
                with trio.CancelScope(shield=True):
                    await self.channels.cancel_job(held.id, "no runner")
        return job.id, ch

    def queue_stats(self) -> QueueStats:
        """The queues now (for the metrics): depth per project, and the waits so far."""
        waits = self._waits
        return QueueStats(
            depth={f"{o}/{p}": len(q) for (o, p), q in self._queues.items() if len(q)},
            waits=waits.count,
            wait_seconds=waits.total,
            longest_wait=waits.longest,
            recent_waits=tuple(waits.recent),
        )

    def _leave(self, owner: str, project: str, entry: Entry, served: bool = False) -> None:
        """``entry`` out of its queue (its wait recorded when it waited); the others re-check."""
        queue = self._queues.get((owner, project))
        if queue is None:
            return
        queue.leave(entry, served)
        if entry.waited:
            self._waits.add(trio.current_time() - entry.arrived)
        if not len(queue):
            del self._queues[(owner, project)]
        self.board.changes.notify()

    async def _open(self, entry: Entry, owner: str, project: str, traceparent: str | None) -> None:
        definition = dict(CHAT_DEFINITION)
        if traceparent is not None:
            definition["traceparent"] = traceparent
        entry.job = await self.board.enqueue(
            owner,
            project,
            needs=[protocol.CAPABILITY],
            agent_definition=definition,
            origin="frontdoor",
        )

    async def _queued(
        self,
        owner: str,
        project: str,
        queue: FairQueue,
        entry: Entry,
        within: float,
        purpose: str,
        traceparent: str | None,
        keepalive: Keepalive | None,
    ) -> Job:
        """The request's job once a runner claimed it, the request in ``queue`` until then.

        While a runner of the project is free (or has not polled yet), the first requests of
        the order (as many as such runners) hold a job on the board; while none is, only the
        first one does: the one job a runner freeing a slot is offered, so two waiters never
        race for one slot. A request opens its job only once every request before it holds
        one (the board offers jobs in the order they were opened). A request behind the first
        that holds a job when every runner turns busy withdraws it and waits on, its place
        unchanged (places are by arrival and lane, never by job): a job no runner claims costs
        no request its place. A request that leaves (timeout, client gone) is out at once."""
        available = self.board.availability(owner, project, protocol.CAPABILITY)
        now_free = available.free + available.unknown
        if now_free and all(e.job is not None for e in queue.order()):
            queue.join(entry)  # a runner may take it now and nobody waits: no wait
            await self._open(entry, owner, project, traceparent)
        else:
            length = self.settings.queue_length
            if len(queue) >= length:
                position, of = queue.position(entry)
                self.counters.queue_full += 1
                log.warning(
                    "%s/%s: every runner busy and %d request(s) queued: refused%s "
                    "(position %d of %d)",
                    owner,
                    project,
                    len(queue),
                    purpose,
                    position,
                    of,
                )
                raise queue_full(
                    available.busy, len(queue), position, of, self.settings.queue_wait, purpose
                )
            queue.join(entry)
            self.board.changes.notify()  # whoever watches the queue (its depth) sees it
        next_keepalive = entry.arrived + self.settings.keepalive_interval
        while True:
            job = entry.job
            if job is not None and job.claimed_by is not None:
                self._leave(owner, project, entry, served=True)
                return job
            if job is not None and job.over:
                raise no_runner(within, purpose)  # withdrawn under it (the hub's own reason)
            available = self.board.availability(owner, project, protocol.CAPABILITY)
            free = available.free + available.unknown
            if not free and not available.busy:
                self.refuse_now(owner, project, purpose)
            order = queue.order()
            index = order.index(entry)
            allowed = max(1, free)
            if job is None and index < allowed and all(e.job is not None for e in order[:index]):
                await self._open(entry, owner, project, traceparent)
                continue
            if job is not None and not free and index > 0:
                await self.board.withdraw(job.id, "queued behind another request")
                entry.job = None
                continue
            if not entry.waited and (job is None or not free):
                entry.waited = True  # queued: without a job, or with every runner busy
                self.counters.queued += 1
            now = trio.current_time()
            limit = self.settings.queue_wait if entry.waited else within
            if now >= entry.arrived + limit:
                position, of = index + 1, len(order)
                if not entry.waited:
                    log.warning(
                        "no runner with %s connected within %g s (job %s%s)",
                        protocol.CAPABILITY,
                        within,
                        job.id if job is not None else "-",
                        purpose,
                    )
                    raise no_runner(within, purpose)
                self.counters.queue_timeouts += 1
                log.warning(
                    "%s/%s: every runner busy for %g s: request%s gave up at position %d of %d",
                    owner,
                    project,
                    limit,
                    purpose,
                    position,
                    of,
                )
                raise queue_timeout(available.busy, limit, position, of, purpose)
            wake = entry.arrived + limit
            if keepalive is not None and entry.waited and self.settings.keepalive_interval > 0:
                if now >= next_keepalive:
                    await keepalive()
                    next_keepalive = trio.current_time() + self.settings.keepalive_interval
                    continue
                wake = min(wake, next_keepalive)
            with trio.move_on_at(wake):
                await self.board.changes.wait()

    async def _wait_channel(
        self, job: Job, give_up: float, within: float, purpose: str
    ) -> ServerChannel:
        """The channel of ``job`` (claimed) once its runner dialled in; HTTPError ``no_runner``
        when it did not by ``give_up`` (trio clock), or the job ended."""
        while True:
            ch = self.channels.get(job.id)
            if ch is not None:
                return ch
            if job.over or trio.current_time() >= give_up:
                log.warning(
                    "no runner with %s connected within %g s (job %s%s)",
                    protocol.CAPABILITY,
                    within,
                    job.id,
                    purpose,
                )
                raise no_runner(within, purpose)
            with trio.move_on_at(give_up):
                await self.board.changes.wait()

    async def _end_job(self, job_id: str, reason: str) -> None:
        """End a session's job for the hub's own reason: chat.end, then withdrawn (so its runner's
        redial is refused and the runner reports the job's outcome)."""
        try:
            with trio.CancelScope(shield=True):
                await self.channels.cancel_job(job_id, reason)
        except Exception as exc:
            log.warning("could not end job %s: %r", job_id, exc)

    async def _bind(self, session: Session, job_id: str | None) -> None:
        """Point the session at ``job_id`` (None: at no job), in memory and in the store."""
        before = session.job_id
        session.job_id = job_id
        if job_id is None:
            await self.store.delete_session(session.key_name, session.key[1], before)
        else:
            key_id = "" if not session.key_checked else session.key[0]
            stored = StoredSession(
                session.key_name, session.key[1], session.owner, session.project, job_id, key_id
            )
            await self.store.save_session(stored)

    async def _forget(self, session: Session) -> None:
        if self.live.get(session.key) is session:
            del self.live[session.key]
        await self.store.delete_session(session.key_name, session.key[1], session.job_id)

    # -- across restarts ---------------------------------------------------------------

    async def restore(self) -> None:
        """Reload the stored sessions whose job can still serve and whose key is active (once,
        before serving).

        A front-door job that no stored session points at lost its client in the restart (or
        its key was revoked): it is withdrawn, so its runner's redial is refused and the runner
        reports the job's outcome.
        """
        if self._restored:
            return
        self._restored = True
        now = trio.current_time()
        kept: set[str] = set()
        active = await self.store.active_key_ids()
        for stored in await self.store.load_sessions():
            key_id = stored.key_id or await self.store.active_key_id(stored.key_name)
            if key_id is None:  # stored before keys had ids, and no active key has its name
                key_id = LEGACY_KEY + stored.key_name
            key = (key_id, stored.session_id)
            revoked = not key_id.startswith(LEGACY_KEY) and key_id not in active
            if key in self.live or revoked or self.job_over(stored.job_id):
                if key not in self.live:
                    await self.store.delete_session(
                        stored.key_name, stored.session_id, stored.job_id
                    )
                continue
            self.live[key] = Session(
                key,
                stored.owner,
                stored.project,
                stored.key_name,
                job_id=stored.job_id,
                last_used=now,
            )
            kept.add(stored.job_id)
        for job in list(self.board.jobs.values()):
            if job.origin == "frontdoor" and job.id not in kept and not self.job_over(job.id):
                await self.board.withdraw(job.id, "its chat session was lost in a hub restart")
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

    async def _end_revoked(self) -> None:
        """End every live session whose API key is no longer active (revoked here, or by another
        process on the same store): chat.end "api key revoked", the job withdrawn."""
        active = await self.store.active_key_ids()
        if self.on_key_check is not None:
            self.on_key_check(active)
        for key, session in list(self.live.items()):
            if self.live.get(key) is not session or not session.key_checked or key[0] in active:
                continue
            await self._forget(session)
            log.info(
                "session %s: its API key was revoked: ending job %s", session.name, session.job_id
            )
            if session.job_id is not None and not self.job_over(session.job_id):
                await self._end_job(session.job_id, "api key revoked")

    async def _reap(self) -> float:
        """Forget finished sessions, end idle ones and those of revoked keys; returns when the
        next one falls due."""
        idle = self.settings.session_idle_timeout
        now = trio.current_time()
        next_due = math.inf
        if self.live and now >= self._next_key_check:
            self._next_key_check = now + self.settings.key_check_interval
            await self._end_revoked()
        if self.live:
            next_due = self._next_key_check
        for key, session in list(self.live.items()):
            if self.live.get(key) is not session or session.turns or session.lock.locked():
                continue  # replaced while we awaited, or busy
            if session.job_id is None or self.job_over(session.job_id):
                if session.job_id is not None:
                    self._ended[key] = (session.job_id, now)
                await self._forget(session)
                continue
            due = session.last_used + idle if idle and idle > 0 else math.inf
            if due > now:
                next_due = min(next_due, due)
                continue
            await self._forget(session)
            log.info("session %s idle for %g s: ending job %s", session.name, idle, session.job_id)
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
