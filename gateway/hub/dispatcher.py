"""The dispatcher: finds each turn its channel, at once when its session's channel is open and
serves its model, else by the step of ``gateway.hub.dispatchplan`` (a function of the turns, the
runners and the jobs), which it applies: jobs opened, retargeted and withdrawn on the board,
sessions moved, turns woken or refused.

A waiting turn sleeps in its own task (``Turn.sleep``: keepalives to a streamed client, the
client watched); the dispatcher's task (``run``) steps each project whose turns wait whenever
the board or the channels change, or a wait falls due, and wakes the turns it decided for.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from gateway.hub.board import Changes, JobBoard
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.dispatchplan import (
    RECENT_WAITS,
    Assign,
    DispatchLimits,
    FairQueue,
    Fleet,
    JobView,
    Move,
    Open,
    Refusal,
    Refuse,
    Retarget,
    RunnerView,
    Waiter,
    Withdraw,
    plan,
)
from gateway.hub.runnertable import RunnerState
from gateway.hub.sessions import Session, Sessions
from gateway.hub.settings import HubSettings
from gateway.hub.store import StoreUnavailable
from gateway.hub.turn import Turn
from gateway.wire import protocol
from gateway.wire.http import Connection

log = logging.getLogger("gateway.hub.dispatcher")

CHAT_DEFINITION = {"jobType": "chat_llm", "needs": [protocol.CAPABILITY]}
CANCEL_WITHIN = 2.0  # s: bound on telling a runner its session moved (chat.end)
RELIST_AFTER = (
    30.0  # s: a runner's list asked again for a session's model it lacks, at most this often
)
# s a new job offered to primary runners only waits for one to take it before the fallback tier
# may take it too (at most half of runner_wait_timeout)
FALLBACK_AFTER = 3.0
# s a runner chosen for a new job has to claim it before it is offered to the next one (a
# pushed runner polls and claims within milliseconds)
OFFER_WITHIN = 2.0
PASSED_FOR = 60.0  # s a runner that let an offer pass is chosen after the others
Project = tuple[str, str]


@dataclass
class _Offer:
    """Who a new job is offered to: one runner the dispatcher chose (None: every eligible one,
    when no runner it could choose hears a push), until when, and those passed over."""

    runner: str | None
    until: float
    passed: set[str] = field(default_factory=set)


class Unplaced(Exception):
    """No channel for the turn: ``refusal`` says why (the edge answers it in the caller's API)."""

    def __init__(self, refusal: Refuse) -> None:
        super().__init__(refusal.why.value)
        self.refusal = refusal


@dataclass
class WaitStats:
    """How long turns waited in the queues (those that did: ``Waiter.queued``), however their
    wait ended: served, timed out, or the client left."""

    count: int = 0
    total: float = 0.0  # s, summed
    longest: float = 0.0  # s
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_WAITS))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.longest = max(self.longest, seconds)
        self.recent.append(seconds)


@dataclass(eq=False)
class _Waiting:
    """One turn the dispatcher decides for: its view for the step, and what was decided."""

    view: Waiter
    session: Session
    turn: Turn
    traceparent: str | None
    job_id: str | None = None  # the job whose open channel it was given
    refusal: Refuse | None = None


@dataclass
class _Project:
    waiting: list[_Waiting] = field(default_factory=list)  # in arrival order
    queue: FairQueue = field(default_factory=FairQueue)


class Dispatcher:
    """Every waiting turn of one hub, per project (``channel_for``), and the task that decides
    for them (``run``)."""

    def __init__(
        self,
        settings: HubSettings,
        board: JobBoard,
        channels: Channels,
        sessions: Sessions,
        counters: HubCounters,
    ) -> None:
        self.settings = settings
        self.board = board
        self.channels = channels
        self.sessions = sessions
        self.counters = counters
        self.changes: Changes = board.changes
        self._projects: dict[Project, _Project] = {}
        self.waits = WaitStats()
        self._offers: dict[str, _Offer] = {}  # unclaimed new jobs by id: who they are offered to
        self._passed_at: dict[str, float] = {}  # runner id -> when it last let an offer pass
        # whether a job's channel went with a replica that is down, how jobs are offered
        self.coordination = board.coordination
        # a runner's models asked again on its channel (the catalog's; None: never)
        self.relist: Callable[[ServerChannel], Awaitable[object]] | None = None
        self._relisted: dict[str, float] = {}  # runner id -> when its list was last asked so
        # per project, its runners as the last step saw them while none changed (version), came
        # back (generation) or may have gone silent (until): (version, generation), until, fleet
        self._fleets: dict[Project, tuple[tuple[int, int], float, Fleet]] = {}
        # per project, its runners, the least recently chosen for an offer first (never: first)
        self._chosen: dict[Project, OrderedDict[str, None]] = {}

    # -- a turn's side -----------------------------------------------------------------

    def open_channel(self, session: Session, model: str | None) -> ServerChannel | None:
        """The session's open channel when it serves ``model`` and no turn of the session waits
        (the common case: no step, no task hop), else None."""
        job_id = session.job_id
        if job_id is None:
            return None
        ch = self.channels.get(job_id)
        if ch is None:
            return None
        if model is not None:
            state = self.board.runners.get(ch.runner_id)
            if state is not None and state.models is not None and model not in state.models:
                return None
        project = self._projects.get((session.owner, session.project))
        if project is not None and any(w.session is session for w in project.waiting):
            return None
        return ch

    async def channel_for(
        self,
        session: Session,
        turn: Turn,
        conn: Connection,
        traceparent: str | None = None,
    ) -> tuple[ServerChannel, bool] | None:
        """The channel for ``turn`` of ``session`` and whether its job was opened for this turn
        (then the job's definition carries ``traceparent``); None when the client left while it
        waited (the turn has ended). Unplaced when no channel can be had. The turn's client is
        kept patient meanwhile (keepalives)."""
        while True:
            ch = self.open_channel(session, turn.model)
            if ch is not None:
                return ch, False
            if await self._lists_it_now(session, turn.model):
                continue
            waiting = self._join(session, turn, traceparent)
            try:
                await self._wait(waiting, conn)
            finally:
                with trio.CancelScope(shield=True):
                    await self._leave(waiting)
            if waiting.refusal is not None:
                raise Unplaced(waiting.refusal)
            if waiting.job_id is None:  # the client left
                return None
            ch = self.channels.get(waiting.job_id)
            if ch is not None:
                return ch, waiting.view.opened

    async def _lists_it_now(self, session: Session, model: str | None) -> bool:
        """The session's open channel's runner did not list ``model``: its list may be stale (a
        model pulled or loaded since it was asked), so it is asked again, at most once in
        ``RELIST_AFTER`` s per runner, before the session moves to another runner (its job, its
        KV cache); True when it lists the model now."""
        if model is None or self.relist is None or session.job_id is None:
            return False
        ch = self.channels.get(session.job_id)
        state = self.board.runners.get(ch.runner_id) if ch is not None else None
        if ch is None or not ch.local or state is None or state.models is None:
            return False  # another replica's channel: that replica asks its runner
        if model in state.models:
            return False
        now = trio.current_time()
        if now < self._relisted.get(ch.runner_id, -math.inf) + RELIST_AFTER:
            return False
        if len(self._relisted) > 4096:  # one entry per runner: the old ones forgotten
            self._relisted = {r: t for r, t in self._relisted.items() if now < t + RELIST_AFTER}
        self._relisted[ch.runner_id] = now
        await self.relist(ch)
        return state.models is not None and model in state.models

    def _join(self, session: Session, turn: Turn, traceparent: str | None) -> _Waiting:
        view = Waiter(
            lane=session.key[0],
            session=session,
            model=turn.model,
            arrived=trio.current_time(),
            job_id=session.job_id,
            priority=turn.priority,
        )
        waiting = _Waiting(view, session, turn, traceparent)
        key = (session.owner, session.project)
        project = self._projects.get(key)
        if project is None:
            project = self._projects[key] = _Project()
        project.waiting.append(waiting)
        self.changes.notify()
        return waiting

    async def _wait(self, waiting: _Waiting, conn: Connection) -> None:
        turn = waiting.turn
        interval = self.settings.keepalive_interval
        next_keepalive = trio.current_time() + interval if interval > 0 else math.inf
        while waiting.job_id is None and waiting.refusal is None and not turn.state.final:
            await turn.sleep(conn, next_keepalive)
            if trio.current_time() >= next_keepalive:
                turn.keepalive()
                next_keepalive = trio.current_time() + interval

    async def _leave(self, waiting: _Waiting) -> None:
        """The turn stops waiting (decided for, or its client left): out of its project's
        lists; a job opened for it and never given is taken back."""
        key = (waiting.session.owner, waiting.session.project)
        project = self._projects.get(key)
        view = waiting.view
        if project is not None:
            if waiting in project.waiting:
                project.waiting.remove(waiting)
            project.queue.leave(view)
            if not project.waiting:
                del self._projects[key]
        if view.queued:
            self.waits.add(trio.current_time() - view.arrived)
        if view.opened and view.job_id is not None and waiting.job_id is None:
            job = self.board.jobs.get(view.job_id)
            if job is not None and not job.over:
                if job.claimed_by is None:
                    await self.board.withdraw(view.job_id, "its turn is no longer waiting")
                elif waiting.session.job_id is None and self.channels.get(job.id) is None:
                    # claimed, its channel not there yet: the session keeps it for its next turn
                    await self.sessions.bind(waiting.session, job.id)
        self.changes.notify()

    # -- the dispatcher's task -------------------------------------------------------------

    def _limits(self) -> DispatchLimits:
        s = self.settings
        return DispatchLimits(
            queue_length=s.queue_length,
            queue_wait=s.queue_wait,
            dial_within=s.runner_wait_timeout,
            redial_within=min(s.reconnect_timeout, s.runner_wait_timeout),
            fallback_after=min(FALLBACK_AFTER, s.runner_wait_timeout / 2),
            promote_after=s.priority_promote_after,
        )

    def _runners(self, key: Project) -> Fleet:
        """The project's runners now: the fleet the last step saw if none changed since, with
        those that did viewed again (a claim, a poll, a model list), or built anew (one added,
        gone, back or maybe silent). Never from every runner or job of the hub."""
        board = self.board
        table = board.runners
        now = trio.current_time()
        stamp = (table.version(*key), board.generation)
        kept = self._fleets.get(key)
        if kept is not None and kept[0] == stamp and now <= kept[1]:
            return kept[2]
        changed = table.take_changed(*key)
        runners = table.of(*key)
        fleet: Fleet | None = None
        if kept is not None and kept[0][1] == stamp[1] and now <= kept[1] and changed is not None:
            views: dict[str, RunnerView] = {}  # the others as they were: only these changed
            until = kept[1]
            for runner_id in changed:
                until = min(until, self._view(runner_id, runners.get(runner_id), now, views))
            if len(views) == len(changed):  # (one gone: built anew)
                fleet = kept[2].updated(views) or Fleet({**kept[2].runners, **views})
        if fleet is None:
            views, until = {}, math.inf
            for runner_id, state in runners.items():
                until = min(until, self._view(runner_id, state, now, views))
            fleet = Fleet(views)
        self._fleets[key] = (stamp, until, fleet)
        return fleet

    def _view(
        self, runner_id: str, state: RunnerState | None, now: float, into: dict[str, RunnerView]
    ) -> float:
        """The runner as a step sees it now, into ``into`` (none when the board has it no more);
        until when it stays so (when it may go silent)."""
        if state is None:
            return math.inf
        board = self.board
        last = board.last_seen.get(runner_id)
        alive = last is not None and now - last <= self.settings.offline_after
        caps = state.capabilities
        into[runner_id] = RunnerView(
            runner_id,
            alive,
            None if caps is None else protocol.CAPABILITY in caps,
            board.held(runner_id),
            state.models,
            state.listing,
            caps is not None and protocol.FALLBACK_TIER in caps,
        )
        order = self._chosen.setdefault((state.owner, state.project), OrderedDict())
        if runner_id not in order:  # never chosen: before every runner chosen since
            order[runner_id] = None
            order.move_to_end(runner_id, last=False)
        return last + self.settings.offline_after if alive and last is not None else math.inf

    def _jobs(self, project: _Project) -> dict[str, JobView]:
        out = {}
        for waiting in project.waiting:
            job_id = waiting.view.job_id
            if job_id is None or job_id in out:
                continue
            job = self.board.jobs.get(job_id)
            if job is None:
                continue
            over = job.over or job_id in self.channels.runner_ended
            channel = self.channels.get(job_id) is not None
            out[job_id] = JobView(
                job_id,
                job.claimed_by,
                over,
                channel,
                awaiting=not channel and self.coordination.awaiting(job_id),
                redial_by=self._redial_by(job_id),
            )
        return out

    def _redial_by(self, job_id: str) -> float | None:
        """Until when a job the hub restored, whose channel has not come back since, waits for
        its runner's redial before its session moves to a free runner: ``resume_within`` from
        the start (a runner polls again and redials within about a second)."""
        restored_at = self.channels.restored_at
        if restored_at is None or job_id not in self.channels.awaited:
            return None
        return restored_at + self.settings.resume_within

    async def step(self) -> float:
        """One step for every project with waiting turns; when the next falls due."""
        wake = math.inf
        limits = self._limits()
        self._prune_offers()
        for key, project in list(self._projects.items()):
            for waiting in project.waiting:  # a session's new job, taken by its other turns
                view = waiting.view
                if view.job_id is None and not view.opened:
                    view.job_id = waiting.session.job_id
            now = trio.current_time()
            views = [w.view for w in project.waiting if w.job_id is None and w.refusal is None]
            depth = len(project.queue)
            runners = self._runners(key)
            decided = plan(project.queue, views, runners, self._jobs(project), limits, now)
            if len(project.queue) != depth:
                self.changes.notify()  # whoever watches the queue (its depth) sees it
            self.counters.queued += len(decided.newly_queued)
            self.counters.redial_waits += len(decided.redialling)
            by_view = {id(w.view): w for w in project.waiting}
            for action in decided.actions:
                await self._apply(key, project, by_view, action, runners)
            wake = min(wake, decided.wake)
        for offer in self._offers.values():
            wake = min(wake, offer.until)
        return wake

    def _prune_offers(self) -> None:
        """The offers of jobs claimed, ended or withdrawn meanwhile forgotten."""
        jobs = self.board.jobs
        for job_id in [j for j in self._offers if (job := jobs.get(j)) is None or job.claimed_by]:
            del self._offers[job_id]

    def _offer(
        self,
        key: Project,
        job_id: str | None,
        targets: frozenset[str] | None,
        runners: Fleet,
    ) -> tuple[frozenset[str] | None, _Offer]:
        """Who a new job (``job_id``: None before it is opened) is offered to among the runners
        it may go to (``targets``, None: any): the runner chosen for it while it has time to
        claim it, else the next one (the least busy that hears a push, the longest unchosen
        first): one runner woken per new session, not the fleet. When none is left to choose,
        every eligible runner, as a poll finds it."""
        now = trio.current_time()
        if not self.coordination.narrows_offers():  # replicas: the runners' push streams are
            return targets, _Offer(None, math.inf)  # spread over them; offered to all
        offer = self._offers.get(job_id) if job_id is not None else None
        passed = offer.passed if offer is not None else set()
        if offer is not None and offer.runner is not None:
            view = runners.get(offer.runner)
            if (
                now < offer.until
                and view is not None
                and view.alive
                and view.capable is not False
                and (targets is None or offer.runner in targets)
            ):
                return frozenset({offer.runner}), offer
            passed.add(offer.runner)
            self._passed_at[offer.runner] = now
            log.info("job %s: runner %s did not take it in time: passed over", job_id, offer.runner)
        elif offer is not None:  # offered to every eligible runner already
            return targets, offer
        order = self._chosen.setdefault(key, OrderedDict())
        passed_at = self._passed_at
        chosen = runners.choose(
            order if self.board.any_subscribed(*key) else {},  # (none hears a push)
            self.board.subscribed,
            passed,
            lambda runner_id: now - passed_at.get(runner_id, -math.inf) < PASSED_FOR,
            targets,
        )
        if chosen is None:  # nobody left that a push reaches: any eligible runner's poll
            return targets, _Offer(None, math.inf, passed)
        order.move_to_end(chosen)
        return frozenset({chosen}), _Offer(chosen, now + OFFER_WITHIN, passed)

    async def _apply(
        self,
        key: Project,
        project: _Project,
        by_view: dict[int, _Waiting],
        action: object,
        runners: Fleet,
    ) -> None:
        if isinstance(action, Retarget):
            job = self.board.jobs.get(action.job_id)
            if job is not None and job.claimed_by is None:
                offered, offer = self._offer(key, job.id, action.runners, runners)
                self._offers[job.id] = offer
                before = job.runners
                try:
                    await self.board.target(job, offered)
                except StoreUnavailable:  # a team's store away (said once by the store): the
                    pass  # offer stands on this replica, the others learn it at its next write
                if job.runners != before:
                    self.board.announce(job)  # the runner now chosen is woken
            elif job is not None:
                await self.board.target(job, action.runners)
            return
        waiting = by_view.get(id(action.waiter)) if hasattr(action, "waiter") else None
        if waiting is None:
            return
        view = waiting.view
        session = waiting.session
        if isinstance(action, Assign):
            if view.opened and not await self._bind_new(session, action.job_id):
                # another replica gave the session a job first: this one goes, the turn
                # takes the session's (its next step)
                view.job_id, view.opened = session.job_id, False
                with trio.move_on_after(CANCEL_WITHIN) as scope:
                    scope.shield = True
                    await self.channels.cancel_job(action.job_id, "its session has another job")
                self.changes.notify()
                return
            waiting.job_id = action.job_id
            waiting.turn.wake()
        elif isinstance(action, Open):
            definition = dict(CHAT_DEFINITION)
            if waiting.traceparent is not None:
                definition["traceparent"] = waiting.traceparent
            offered, offer = self._offer(key, None, action.runners, runners)
            job = await self.board.enqueue(
                key[0],
                key[1],
                [protocol.CAPABILITY],
                definition,
                origin="frontdoor",
                runners=offered,
            )
            self._offers[job.id] = offer
            view.job_id, view.opened = job.id, True
        elif isinstance(action, Withdraw):
            await self.board.withdraw(action.job_id, "queued behind another request")
        elif isinstance(action, Move):
            await self._move(session, action)
        elif isinstance(action, Refuse):
            self._refuse(project, waiting, action)

    async def _bind_new(self, session: Session, job_id: str) -> bool:
        """The session's new job (a failover when it had one); False when another replica
        gave the session another job first."""
        old = session.job_id or session.had_job
        if await self.sessions.bind(session, job_id) != job_id:
            log.info(
                "session %s: another replica gave it job %s first", session.name, session.job_id
            )
            return False
        self.changes.notify()  # its session's other waiting turns take the job too
        job = self.board.jobs.get(job_id)
        runner = job.claimed_by if job is not None else None
        if old is not None and old != job_id:
            self.counters.failovers += 1
            log.warning(
                "session %s: job %s is gone, failed over to job %s (runner %s); failovers: %d",
                session.name,
                old,
                job_id,
                runner,
                self.counters.failovers,
            )
        else:
            log.info("session %s opened chat job %s (runner %s)", session.name, job_id, runner)
        return True

    async def _move(self, session: Session, action: Move) -> None:
        if action.immediate:
            self.counters.failovers_immediate += 1
            log.warning(
                "job %s: channel gone and another runner free: moving session %s at once "
                "(immediate failovers: %d)",
                action.job_id,
                session.name,
                self.counters.failovers_immediate,
            )
        else:
            log.warning("session %s leaves job %s: %s", session.name, action.job_id, action.reason)
        if session.job_id == action.job_id:
            session.had_job = action.job_id
            await self.sessions.bind(session, None)
        with trio.move_on_after(CANCEL_WITHIN) as scope:
            scope.shield = True
            await self.channels.cancel_job(action.job_id, action.reason)

    def _refuse(self, project: _Project, waiting: _Waiting, action: Refuse) -> None:
        counters = self.counters
        if action.why is Refusal.QUEUE_FULL:
            counters.queue_full += 1
        elif action.why is Refusal.QUEUE_TIMEOUT:
            counters.queue_timeouts += 1
        for other in project.waiting:  # the turns of its session behind it share its answer
            if other is waiting or (other.view.follows is waiting.view and other.refusal is None):
                other.refusal = action
                other.turn.wake()

    async def run(self) -> None:
        """Step whenever the board or the channels change or a wait falls due, until cancelled."""
        while True:
            event = self.changes.event
            wake = await self.step() if self._projects else math.inf
            if event.is_set():
                continue
            with trio.move_on_at(wake):
                await event.wait()

    # -- for the metrics ------------------------------------------------------------------

    def depth(self) -> dict[str, int]:
        """Turns waiting in each project's queue now (projects with any)."""
        return {f"{o}/{p}": len(q.queue) for (o, p), q in self._projects.items() if len(q.queue)}
