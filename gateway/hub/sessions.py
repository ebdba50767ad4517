"""The chat sessions table: (API key, X-Chat-Session) -> one Chat Job, stored, ended when idle,
when its key is revoked, or to make room for the key's next one.

Sessions only keep the table and its persistence; which job a session's turn runs on is the
dispatcher's to decide (``gateway.hub.dispatcher``), and ending a job on the channel is the
``end_job`` it is given.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from gateway.hub.coordination import Alone, Coordination
from gateway.hub.store import ApiKey, Store, StoredSession, StoreError

log = logging.getLogger("gateway.hub.sessions")

REAP_RETRY = 1.0  # s: the reaper looks again this soon after the store failed it
# s: a key revoked on a team: its sessions' jobs end here after the other replicas ended its
# turns in flight (they look every REVOCATION_CHECK, 0.5 s, while turns are in flight)

SessionKey = tuple[str, str]  # (API key id, session id)
LEGACY_KEY = "name:"  # the key part of a restored session whose key is known by name only
EndJob = Callable[[str, str], Awaitable[None]]  # (job id, reason): chat.end, then withdrawn


class TooManySessions(Exception):
    """The key holds ``limit`` sessions, each busy with a turn: none can be ended for a new one."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the key holds {limit} busy sessions")
        self.limit = limit


@dataclass(eq=False)
class Session:
    """One chat session: (API key, X-Chat-Session) -> its Chat Job."""

    key: SessionKey  # (the key's id, the session id): a new key with an old name starts afresh
    owner: str
    project: str
    key_name: str = ""  # for listings and log lines
    job_id: str | None = None
    turns: int = 0  # turns in flight (waiting for a channel or relaying)
    last_used: float = field(default_factory=trio.current_time)
    used: int = 0  # the order of last use among the hub's sessions (a tie on the clock breaks)
    had_job: str | None = None  # the job it lost (its runner ended it): its next is a failover

    @property
    def name(self) -> str:
        """``key name/session id``, for log lines (never the key itself)."""
        return f"{self.key_name}/{self.key[1]}"

    @property
    def key_checked(self) -> bool:
        """Whether the key's revocation is watched (not for a session restored by name only)."""
        return not self.key[0].startswith(LEGACY_KEY)


class SessionTable(dict[SessionKey, Session]):
    """The live sessions by key, and by API key (``of_key``): a new session's per-key cap is
    checked on its key's sessions only, whatever the number of sessions (issue 39). Written only
    by item (``table[k] = s``, ``del table[k]``, ``pop``), which keep the index."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        super().__init__()
        self._by_key: dict[str, dict[SessionKey, Session]] = {}

    def __setitem__(self, key: SessionKey, session: Session) -> None:
        super().__setitem__(key, session)
        self._by_key.setdefault(key[0], {})[key] = session

    def __delitem__(self, key: SessionKey) -> None:
        super().__delitem__(key)
        self._forget(key)

    def pop(self, key: SessionKey, *default: Any) -> Any:  # type: ignore[override]
        if key in self:
            self._forget(key)
        return super().pop(key, *default)

    def _forget(self, key: SessionKey) -> None:
        held = self._by_key.get(key[0])
        if held is not None:
            held.pop(key, None)
            if not held:
                del self._by_key[key[0]]

    def of_key(self, key_id: str) -> list[Session]:
        """The live sessions of one API key (by its id)."""
        held = self._by_key.get(key_id)
        return list(held.values()) if held else []

    def count_of_key(self, key_id: str) -> int:
        """How many live sessions one API key (by its id) holds, without listing them."""
        held = self._by_key.get(key_id)
        return len(held) if held else 0

    def key_ids(self) -> list[str]:
        """The API key ids (or legacy names) that hold live sessions."""
        return list(self._by_key)


class Sessions:
    """Every live session of one hub, and their background work (``run``): idle ones ended,
    those of revoked keys ended, finished ones forgotten."""

    def __init__(
        self,
        store: Store,
        *,
        idle_timeout: Callable[[], float],
        max_per_key: Callable[[], int],
        key_check_interval: Callable[[], float],
        job_over: Callable[[str], bool],
        end_job: EndJob,
        coordination: Coordination | None = None,
    ) -> None:
        self.store = store
        self.coordination: Coordination = coordination or Alone(store)
        self.live = SessionTable()
        self.idle_timeout = idle_timeout
        self._max_per_key = max_per_key
        self.key_check_interval = key_check_interval
        self.job_over = job_over
        self._end_job = end_job
        self._changed = trio.Event()
        self._restored = False
        self._uses = 0  # sessions left so far (their ``used`` order)
        self.next_key_check = -math.inf  # trio clock: when the sessions' keys are checked next
        self._next_due = -math.inf  # trio clock: when ``run`` looks next (-inf: it is looking)
        # the walk over every session (idle ones ended, finished ones forgotten) is due: at the
        # first idle due among them, or once a job ended (not at every key check)
        self._idle_due = math.inf
        self._walk_wanted = True
        # told the active key ids at each check (the front door drops what it kept of others)
        self.on_key_check: list[Callable[[set[str]], None]] = []

    def listing(self) -> dict[tuple[str, str], str | None]:
        """The live sessions: (API key name, session id) -> job id."""
        return {(s.key_name, key[1]): s.job_id for key, s in self.live.items()}

    def poke(self) -> None:
        """Wake ``run``: a session changed."""
        self._changed.set()

    def job_ended(self, job_id: str) -> None:
        """A job left the board: its session, if one is bound to it, is looked at soon (by
        the next walk, at most a key check away)."""
        self._walk_wanted = True

    def check_keys(self) -> None:
        """Check the live sessions' API keys now (one was revoked in this process), or after the
        coordination's ``revoke_grace`` (replicas: the others end the key's turns in flight first,
        each client told its key was revoked, not that its channel was lost as its job ended)."""
        self.next_key_check = trio.current_time() + self.coordination.revoke_grace()
        self.poke()

    # -- one session's turns ----------------------------------------------------------

    async def enter(self, key: ApiKey, session_id: str) -> tuple[Session, Session | None]:
        """The session ``session_id`` of ``key`` (created if new), counted busy until ``leave``,
        and the session ended to make room for it, if one was (its job is the caller's to end).
        A key holds at most ``max_sessions_per_key``: a new one past it ends the key's least
        recently used idle session; when none is idle, TooManySessions."""
        skey = (key.id or LEGACY_KEY + key.name, session_id)
        session = self.live.get(skey)
        evicted: Session | None = None
        if session is None:
            limit = self.coordination.session_cap(self._max_per_key())
            if limit > 0 and self.live.count_of_key(skey[0]) >= limit:
                held = self.live.of_key(skey[0])  # listed only at the cap: O(1) below it
                idle = [s for s in held if not s.turns]
                if not idle:
                    log.warning(
                        "API key %s holds %d busy sessions: session %s refused",
                        key.name,
                        len(held),
                        session_id,
                    )
                    raise TooManySessions(limit)
                evicted = min(idle, key=lambda s: (s.last_used, s.used))
                del self.live[evicted.key]  # out of the table at once (no await before)
                log.info(
                    "API key %s at %d sessions: ending its least recently used session %s",
                    key.name,
                    limit,
                    evicted.name,
                )
            session = self.live[skey] = Session(skey, key.owner, key.project, key.name)
            self.poke()  # ``run`` checks its key from now on
        # a replica's: the store's word as the turn was admitted, unless it has turns of it now
        found = self.coordination.learned_job(skey, session.job_id)
        if not session.turns and session.job_id != found:
            session.job_id = found
        session.turns += 1
        if evicted is not None:  # then out of the store
            await self.store.delete_session(evicted.key_name, evicted.key[1], evicted.job_id)
        return session, evicted

    def leave(self, session: Session) -> None:
        session.turns -= 1
        session.last_used = now = trio.current_time()
        self._uses += 1
        session.used = self._uses
        if session.turns:
            return
        if session.job_id is None and self.live.get(session.key) is session:
            del self.live[session.key]
        # ``run`` is woken only when this session falls idle before it would look anyway (a
        # wake per turn was a task step and a walk over every session, per turn)
        idle = self.idle_timeout()
        if idle and idle > 0:
            self._idle_due = min(self._idle_due, now + idle)
            if now + idle < self._next_due:
                self.poke()

    async def bind(self, session: Session, job_id: str | None) -> str | None:
        """Point the session at ``job_id`` (None: at no job), in memory and in the store; the
        job it points at then. On replicas that is ``job_id`` unless another replica set the
        session's job first (compare-and-set on what this replica knew): then that one."""
        before = session.job_id
        if before == job_id:
            return job_id
        key_id = "" if not session.key_checked else session.key[0]
        wanted = StoredSession(
            session.key_name, session.key[1], session.owner, session.project, job_id or "", key_id
        )
        return await self.coordination.bind_session(session, wanted, before)

    def drop(self, key_name: str | None = None, session_id: str | None = None) -> None:
        """Forget what this replica knew of a session (all of them: None) without a turn in
        flight here: another replica changed it in the store, which the next turn reads."""
        for key, session in list(self.live.items()):
            if session.turns:
                continue
            if key_name is None or (session.key_name == key_name and key[1] == session_id):
                del self.live[key]

    async def forget(self, session: Session) -> None:
        """The session leaves the table (at once) and the store."""
        if self.live.get(session.key) is session:
            del self.live[session.key]
        await self.store.delete_session(session.key_name, session.key[1], session.job_id)

    # -- across restarts ---------------------------------------------------------------

    async def restore(self) -> set[str]:
        """Reload the stored sessions whose job can still serve and whose key is active (once,
        before serving); the jobs they point at."""
        if self._restored:
            return set()
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
        if self.live:
            log.info("restored %d chat session(s)", len(self.live))
        self._walk_wanted = True
        return kept

    # -- background work ----------------------------------------------------------------

    async def end(self, job_id: str, reason: str) -> None:
        """``chat.end`` with ``reason`` on the job's channel, then the job withdrawn."""
        try:
            with trio.CancelScope(shield=True):
                await self._end_job(job_id, reason)
        except Exception as exc:
            log.warning("could not end job %s: %r", job_id, exc)

    async def end_evicted(self, session: Session) -> None:
        """End the job of a session ended to make room (``enter``)."""
        if session.job_id is not None:
            await self.end(session.job_id, "session ended: its API key opened too many")

    async def _end_revoked(self) -> None:
        """End every live session whose API key is no longer active (revoked here, or by another
        process on the same store): chat.end "api key revoked", the job withdrawn."""
        active = await self.store.active_key_ids()
        for observe in self.on_key_check:
            observe(active)
        gone = [k for k in self.live.key_ids() if k not in active and not k.startswith(LEGACY_KEY)]
        for session in [s for key_id in gone for s in self.live.of_key(key_id)]:
            key = session.key
            if self.live.get(key) is not session:
                continue
            await self.forget(session)
            log.info(
                "session %s: its API key was revoked: ending job %s", session.name, session.job_id
            )
            if session.job_id is not None and not self.job_over(session.job_id):
                await self.end(session.job_id, "api key revoked")

    async def _reap(self) -> float:
        """Forget finished sessions, end idle ones and those of revoked keys; returns when the
        next one falls due (the coordination's: a replica's are the store's)."""
        return await self.coordination.reap_sessions(self)

    async def reap_here(self) -> float:
        """``_reap`` of a hub alone: the table in memory, each change written to the store."""
        idle = self.idle_timeout()
        now = trio.current_time()
        next_due = math.inf
        if self.live and now >= self.next_key_check:
            self.next_key_check = now + self.key_check_interval()
            await self._end_revoked()
        if self.live:
            next_due = self.next_key_check
        if not (self._walk_wanted or now >= self._idle_due):
            return min(next_due, self._idle_due)  # a key check only: no walk over the sessions
        self._walk_wanted = False
        self._idle_due = math.inf
        try:
            next_due = await self._walk(idle, now, next_due)
        except BaseException:  # the store failed it (or a cancel): walked again at the next look
            self._walk_wanted = True
            raise
        return next_due

    async def _walk(self, idle: float, now: float, next_due: float) -> float:
        """The walk over every session: finished ones forgotten, idle ones ended."""
        for key, session in list(self.live.items()):
            if self.live.get(key) is not session or session.turns:
                continue  # replaced while we awaited, or busy
            if session.job_id is None and session.had_job is None:
                await self.forget(session)
                continue
            if session.job_id is not None and self.job_over(session.job_id):
                session.had_job = session.job_id  # its next turn is a failover
                await self.bind(session, None)
            due = session.last_used + idle if idle and idle > 0 else math.inf
            if due > now:
                next_due = min(next_due, due)
                self._idle_due = min(self._idle_due, due)
                continue
            await self.forget(session)
            if session.job_id is None:
                continue
            log.info("session %s idle for %g s: ending job %s", session.name, idle, session.job_id)
            await self.end(session.job_id, "idle")
        return next_due

    async def run(self) -> None:
        """End idle sessions with ``chat.end`` ("idle"), forget finished ones, end revoked
        keys' sessions, until cancelled."""
        while True:
            self._changed = trio.Event()
            self._next_due = -math.inf
            try:
                next_due = await self._reap()
            except StoreError as exc:  # the store away (restarting): looked at again soon
                log.debug("sessions not reaped: %s", exc)
                next_due = trio.current_time() + REAP_RETRY
            if self._changed.is_set():
                continue
            self._next_due = next_due
            with trio.move_on_at(next_due):
                await self._changed.wait()
