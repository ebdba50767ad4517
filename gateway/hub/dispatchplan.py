"""Which waiting turn gets which channel, and which new Chat Jobs to open: one pure step over a
project's waiting turns, its runners and their jobs (pure: no trio, no I/O; the hub's
``Dispatcher`` applies what it decides, as httpcore's pool assigns requests to connections).

A turn waits here when its session has no open channel that serves its model. ``plan`` looks
at every waiting turn of a project and says, for each: served now (its job's channel is open),
its session moved (its runner is gone, or does not serve the model), a job opened or withdrawn,
refused (and why), or nothing yet; and when to look again.

New jobs wait in a fair queue (``FairQueue``): lanes, one per API key, FIFO within a lane, the
lanes taking turns, so one key's burst cannot starve another; a higher priority class (its key's:
interactive, standard, background) before a lower one, fair within a class, and a turn that waited
``promote_after`` s served as one class higher (again after as many more), so none starves. As many turns of the order hold a
job as there are free runners that serve their model (at least the first of each model, so a
runner that frees up claims exactly that one); a turn behind them waits, its place kept by
arrival and lane, never by job.

Runners come in two tiers (a runner of the ``fallback`` tier says so in its poll's capabilities,
``gateway.wire.protocol.FALLBACK_TIER``): a new job for a model goes to the ``primary`` runners
that can serve it (alive, and advertising ``chat-llm:v1`` or at capacity), and to the fallback
ones only when none can, or when the primaries it was offered to did not take it within
``Limits.fallback_after`` (a primary killed looks alive until ``offline_after``).
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from gateway.hub.dispatchfleet import Fleet as Fleet
from gateway.hub.dispatchfleet import RunnerView as RunnerView
from gateway.hub.dispatchfleet import eligible as eligible
from gateway.hub.dispatchfleet import serves

RECENT_WAITS = 256  # the last waits kept for the metrics (seconds each)


class FairQueue:
    """One project's waiting turns: round-robin across lanes (API keys), FIFO within one."""

    def __init__(self, promote_after: float = math.inf) -> None:
        self._lanes: OrderedDict[str, deque[Waiter]] = OrderedDict()  # in rotation order
        self.promote_after = promote_after  # s a turn waits before it counts one class higher
        self.now = 0.0  # the clock the promotions are judged by (``plan`` sets it)

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def __contains__(self, waiter: Waiter) -> bool:
        lane = self._lanes.get(waiter.lane)
        return lane is not None and waiter in lane

    def join(self, waiter: Waiter) -> None:
        """At the end of its lane (a new lane at the back of the rotation)."""
        lane = self._lanes.get(waiter.lane)
        if lane is None:
            lane = self._lanes[waiter.lane] = deque()
        lane.append(waiter)

    def leave(self, waiter: Waiter, served: bool = False) -> None:
        """Out of the queue; ``served``: it got its runner, and its lane's turn is over (the lane
        goes to the back of the rotation). A turn that gave up leaves the rotation as it is."""
        lane = self._lanes.get(waiter.lane)
        if lane is None or waiter not in lane:
            return
        lane.remove(waiter)
        if not lane:
            del self._lanes[waiter.lane]
        elif served:
            self._lanes.move_to_end(waiter.lane)

    def rank(self, waiter: Waiter) -> int:
        """The class it is served in now: its key's, one higher for each ``promote_after`` s
        it waited (0, interactive, the highest)."""
        if waiter.priority <= 0:
            return 0
        waited = self.now - (waiter.seeking if waiter.seeking is not None else waiter.arrived)
        return max(0, waiter.priority - int(max(0.0, waited) // self.promote_after))

    def order(self) -> list[Waiter]:
        """Every waiting turn in the order it would be served: class by class, the highest
        first; within one, the lanes interleaved, one turn each in turn, from the lane whose
        turn it is."""
        lanes = list(self._lanes.values())
        ranks = {id(w): self.rank(w) for lane in lanes for w in lane}
        out: list[Waiter] = []
        for rank in sorted(set(ranks.values())):
            of_rank = [[w for w in lane if ranks[id(w)] == rank] for lane in lanes]
            depth = max((len(lane) for lane in of_rank), default=0)
            for i in range(depth):
                out.extend(lane[i] for lane in of_rank if i < len(lane))
        return out

    def position(self, waiter: Waiter) -> tuple[int, int]:
        """(its place in the order of service from 1, how many wait); a turn not in the queue:
        the place it would take if it joined now, of one more."""
        if waiter in self:
            return self.order().index(waiter) + 1, len(self)
        self.join(waiter)
        try:
            return self.order().index(waiter) + 1, len(self)
        finally:
            self.leave(waiter)

    def lanes(self) -> dict[str, int]:
        """Turns waiting per lane, in rotation order."""
        return {key: len(lane) for key, lane in self._lanes.items()}


@dataclass(eq=False)
class Waiter:
    """One turn waiting for a channel, as the dispatcher sees it."""

    lane: str  # its API key's id (the fair queue's lane)
    session: Hashable  # its session (turns of one session share a new job)
    model: str | None  # the model it asks for (None: any runner)
    arrived: float  # clock
    job_id: str | None = None  # its session's job, or the job opened for it
    opened: bool = False  # ``job_id`` was opened for this turn (withdrawn if it gives up)
    claimed_at: float | None = None  # when the job opened for it was claimed (the dial wait)
    queued: bool = False  # it waited with every runner that serves it at capacity
    redial_until: float | None = None  # its session's channel is gone: the redial waited until
    seeking: float | None = None  # clock: since when it needs a new job (its waits count from)
    follows: Waiter | None = None  # the turn of its session whose new job it will share
    priority: int = 1  # its key's class: 0 interactive, 1 standard, 2 background


@dataclass(frozen=True)
class JobView:
    """One job a waiting turn waits on."""

    id: str
    claimed_by: str | None
    over: bool  # completed, cancelled, or its runner ended it (no channel will come)
    channel: bool  # a channel of it is open
    # its channel went with the replica that held it (its runner lives and redials another):
    # the redial is waited for even when another runner is free
    awaiting: bool = False
    # no channel yet but its runner's redial is expected until then (a restarted hub's job: its
    # runner comes back and redials it): waited for even while another runner is free
    redial_by: float | None = None


@dataclass(frozen=True)
class DispatchLimits:
    """The dispatcher's settings (``HubSettings``' values)."""

    queue_length: int  # turns that may wait for a busy runner (one more: queue_full)
    queue_wait: float  # s a turn waits for a busy runner before queue_timeout
    dial_within: float  # s for a new job to be claimed and its channel opened (no_runner)
    redial_within: float  # s a session's dropped channel is waited for when no runner is free
    # s a new job offered only to primary runners waits for one of them to take it before the
    # fallback tier's runners may take it too
    fallback_after: float = math.inf
    promote_after: float = math.inf  # s a queued turn waits before it counts one class higher


class Refusal(enum.Enum):
    """Why a waiting turn is answered with an error (the edge maps each to its HTTP answer)."""

    NO_RUNNER_CONNECTED = "no_runner_connected"  # no runner of the project is alive
    NO_CAPABLE_RUNNER = "no_capable_runner"  # runners alive, none advertises chat-llm:v1
    NO_RUNNER = "no_runner"  # a runner could, none took the job (or dialled) in time
    QUEUE_FULL = "queue_full"  # every runner busy and ``queue_length`` turns wait
    QUEUE_TIMEOUT = "queue_timeout"  # every runner busy for ``queue_wait``
    UNKNOWN_MODEL = "model_not_found"  # every live runner's list is known: none lists it


@dataclass(frozen=True)
class Assign:
    """Serve the turn on this job's open channel."""

    waiter: Waiter
    job_id: str


@dataclass(frozen=True)
class Open:
    """Open a new Chat Job for the turn, offered only to ``runners`` (None: any capable one)."""

    waiter: Waiter
    runners: frozenset[str] | None


@dataclass(frozen=True)
class Retarget:
    """The turn's unclaimed job is now for these runners (a runner appeared or listed models)."""

    job_id: str
    runners: frozenset[str] | None


@dataclass(frozen=True)
class Withdraw:
    """Take back the unclaimed job opened for the turn: it waits on without one."""

    waiter: Waiter
    job_id: str


@dataclass(frozen=True)
class Move:
    """The turn's session leaves its job (``immediate``: another runner was free, no wait for
    the redial); the turn then needs a new one."""

    waiter: Waiter
    job_id: str
    reason: str
    immediate: bool = False


@dataclass(frozen=True)
class Refuse:
    """Answer the turn with an error: ``position`` of ``of`` in the queue where that matters."""

    waiter: Waiter
    why: Refusal
    busy: int = 0
    live: int = 0
    position: int = 0
    of: int = 0
    models: tuple[str, ...] = ()  # UNKNOWN_MODEL: the models the live runners list
    # NO_RUNNER: the runners it waited for, which list its model but withdrew chat-llm:v1 (one
    # that stopped, a session's runner that restarts): the answer names them, not "no runner"
    waited_for: tuple[str, ...] = ()


Action = Assign | Open | Retarget | Withdraw | Move | Refuse


@dataclass
class Plan:
    """What one step decided, in order, and when the next step is due (math.inf: on a change)."""

    actions: list[Action] = field(default_factory=list)
    wake: float = math.inf
    newly_queued: list[Waiter] = field(default_factory=list)  # turns that started to wait
    redialling: list[Waiter] = field(default_factory=list)  # turns that started to await a redial


def plan(
    queue: FairQueue,
    waiters: list[Waiter],
    runners: Mapping[str, RunnerView] | Fleet,
    jobs: Mapping[str, JobView],
    limits: DispatchLimits,
    now: float,
) -> Plan:
    """One step for one project: what happens to each of its waiting turns (``waiters``, in
    arrival order), given its runners and the turns' jobs now. The turns that need a new job
    join ``queue`` here and leave it when their job is claimed; everything else the caller
    applies (``Plan.actions``) and then takes the served and refused turns out. ``runners``:
    the project's runners, or a ``Fleet`` of them kept from an earlier step."""
    out = Plan()
    queue.now, queue.promote_after = now, limits.promote_after
    fleet = runners if isinstance(runners, Fleet) else Fleet(runners)
    leaders: dict[Hashable, Waiter] = {}  # each session's turn that seeks its new job
    seeking: list[Waiter] = []
    for waiter in waiters:
        waiter.follows = None
        if waiter.job_id is not None and not waiter.opened:
            if _session_job(waiter, jobs.get(waiter.job_id), fleet, limits, now, out):
                continue
        elif waiter.job_id is not None:
            job = jobs.get(waiter.job_id)
            if job is None or job.over:  # withdrawn or ended before its channel came
                waiter.job_id, waiter.opened, waiter.claimed_at = None, False, None
            elif job.claimed_by is not None:
                if _dialling(waiter, job, queue, fleet, limits, now, out):
                    leaders.setdefault(waiter.session, waiter)  # its session's turns follow it
                    continue
        leader = leaders.get(waiter.session)
        if leader is not None:
            waiter.follows = leader  # served with its session's new job, when it comes
            continue
        leaders[waiter.session] = waiter
        seeking.append(waiter)
    if seeking:
        _queue(queue, seeking, fleet, jobs, limits, now, out)
    return out


def _learning(runner: RunnerView, model: str | None) -> bool:
    """Whether the turn waits for ``runner``'s model list, asked as its channel opened (its
    first: until then it may or may not serve ``model``)."""
    return model is not None and runner.models is None and runner.listing


def _dialling(
    waiter: Waiter,
    job: JobView,
    queue: FairQueue,
    fleet: Fleet,
    limits: DispatchLimits,
    now: float,
    out: Plan,
) -> bool:
    """A turn whose new job was claimed: out of the queue (served), its channel awaited for
    ``dial_within``; True when decided here, False when the runner that took it turned out not
    to serve its model (a runner whose list was not known yet): the job is left, a new one is
    sought."""
    holder = fleet.get(job.claimed_by) if job.claimed_by else None
    if holder is not None and holder.models is not None and not serves(holder, waiter.model):
        out.actions.append(Move(waiter, job.id, f"its runner does not serve {waiter.model}"))
        waiter.job_id, waiter.opened, waiter.claimed_at = None, False, None
        return False
    queue.leave(waiter, served=True)
    if job.channel:
        if holder is not None and _learning(holder, waiter.model):
            return True  # its models come in a moment (a change): served then, or moved
        out.actions.append(Assign(waiter, job.id))
        return True
    if waiter.claimed_at is None:
        waiter.claimed_at = now
    due = waiter.claimed_at + limits.dial_within
    if now >= due:
        out.actions.append(Refuse(waiter, Refusal.NO_RUNNER))
    else:
        out.wake = min(out.wake, due)
    return True


def _session_job(
    waiter: Waiter,
    job: JobView | None,
    fleet: Fleet,
    limits: DispatchLimits,
    now: float,
    out: Plan,
) -> bool:
    """A turn whose session has a job: True when decided here (served, or waiting for its
    redial), False when the session moves on (a ``Move`` when it leaves a live job)."""
    assert waiter.job_id is not None
    if job is None or job.over:
        waiter.job_id = None  # its runner ended it, or it was withdrawn: a new job
        return False
    holder = fleet.get(job.claimed_by) if job.claimed_by else None
    if holder is not None and holder.models is not None and not serves(holder, waiter.model):
        out.actions.append(Move(waiter, job.id, f"its runner does not serve {waiter.model}"))
        waiter.job_id = None
        return False
    if job.channel:
        if holder is not None and _learning(holder, waiter.model):
            return True  # its models come in a moment (a change): served then, or moved
        out.actions.append(Assign(waiter, job.id))
        return True
    movable = fleet.movable(waiter.model)
    others = len(movable) > (job.claimed_by in movable)  # a free runner besides its own
    if others and job.redial_by is not None and now < job.redial_by:
        out.wake = min(out.wake, job.redial_by)  # its runner's redial first (its KV cache)
        return True
    if others and not job.awaiting:  # another runner can serve it now: no wait for the dead
        out.actions.append(Move(waiter, job.id, "channel lost", immediate=True))
        waiter.job_id = None
        return False
    if waiter.redial_until is None:
        waiter.redial_until = now + limits.redial_within
        out.redialling.append(waiter)
    if now < waiter.redial_until:
        out.wake = min(out.wake, waiter.redial_until)
        return True
    out.actions.append(Move(waiter, job.id, "channel lost"))
    waiter.job_id = None
    return False


def _queue(
    queue: FairQueue,
    seeking: list[Waiter],
    fleet: Fleet,
    jobs: Mapping[str, JobView],
    limits: DispatchLimits,
    now: float,
    out: Plan,
) -> None:
    """The turns that need a new job (one per session), through the fair queue."""
    pool = fleet.pool
    if not pool.live or (not pool.free and not pool.busy):
        why = Refusal.NO_RUNNER_CONNECTED if not pool.live else Refusal.NO_CAPABLE_RUNNER
        for waiter in seeking:
            # one that waits in the queue waits on, within queue_wait: a runner at capacity
            # whose job just ended looks down until its next poll (on a team, until its
            # presence is read after the job's end)
            since = waiter.seeking if waiter.seeking is not None else waiter.arrived
            due = since + limits.queue_wait
            if waiter.queued and pool.live and now < due:
                out.wake = min(out.wake, due)
                continue
            out.actions.append(Refuse(waiter, why, live=pool.live))
        return
    for waiter in seeking:
        if waiter.seeking is None:
            waiter.seeking = now
    # a runner that withdrew chat-llm:v1 and holds no job (one that stopped, whose last poll
    # withdrew it; or one whose backends are down) takes no new job: no turn waits for its
    # list (a model it listed waits for it to come back, as before; its models are still named)

    def targets_for(key: tuple[str | None, bool]) -> tuple[frozenset[str] | None, int]:
        return fleet.targets(*key)

    fresh: set[int] = set()  # the turns that join the queue now
    for waiter in seeking:  # newcomers: served at once, or waiting (within the queue's bound)
        if waiter in queue:
            continue
        targets, free = targets_for((waiter.model, False))
        if targets == frozenset() and fleet.all_known and waiter.model not in fleet.listed:
            out.actions.append(Refuse(waiter, Refusal.UNKNOWN_MODEL, models=tuple(fleet.listed)))
            continue
        ahead_hold = all(e.job_id is not None for e in queue.order() if e.model == waiter.model)
        if not (free and ahead_hold) and len(queue) >= limits.queue_length:
            position, of = queue.position(waiter)
            out.actions.append(
                Refuse(waiter, Refusal.QUEUE_FULL, busy=len(pool.busy), position=position, of=of)
            )
            continue
        queue.join(waiter)
        fresh.add(id(waiter))
    order = queue.order()
    rank: dict[str | None, int] = {}
    all_hold: dict[str | None, bool] = {}
    for position, waiter in enumerate(order, 1):
        model = waiter.model
        # offered to the primary tier only, not taken within fallback_after: the fallback too
        since = waiter.seeking if waiter.seeking is not None else waiter.arrived
        spill = not waiter.queued and now >= since + limits.fallback_after
        targets, free = targets_for((model, spill))
        if not spill and not waiter.queued and targets_for((model, True))[0] != targets:
            out.wake = min(out.wake, since + limits.fallback_after)
        nth = rank.get(model, 0)
        rank[model] = nth + 1
        before_hold = all_hold.get(model, True)
        job = jobs.get(waiter.job_id) if waiter.job_id is not None else None
        if job is None:
            # as many hold a job as runners are free (at least the first); and one that comes
            # while a runner is free, every turn ahead of it holding one, opens its own at once
            held = before_hold and (nth < max(1, free) or (id(waiter) in fresh and free > 0))
            if held:
                out.actions.append(Open(waiter, targets))
        elif not free and nth > 0:
            out.actions.append(Withdraw(waiter, job.id))  # it waits on, its place kept
            held = False
        else:
            out.actions.append(Retarget(job.id, targets))
            held = True
        all_hold[model] = before_hold and held
        # its model is listed only by runners that withdrew chat-llm:v1 (stopped): it waits for
        # one to come back (``dial_within``), not in the queue for a busy one
        gone = _withdrawn(fleet.alive, model) if targets == frozenset() else ()
        if not waiter.queued and (not held or not free) and not gone:
            waiter.queued = True  # it waits with every runner that serves it at capacity
            out.newly_queued.append(waiter)
        limit = limits.queue_wait if waiter.queued else limits.dial_within
        since = waiter.seeking if waiter.seeking is not None else waiter.arrived
        if queue.rank(waiter) > 0 and math.isfinite(queue.promote_after):  # its next class
            steps = int(max(0.0, now - since) // queue.promote_after) + 1
            out.wake = min(out.wake, since + steps * queue.promote_after)
        due = since + limit
        if now < due:
            out.wake = min(out.wake, due)
        elif waiter.queued:
            out.actions.append(
                Refuse(
                    waiter,
                    Refusal.QUEUE_TIMEOUT,
                    busy=len(pool.busy),
                    position=position,
                    of=len(order),
                )
            )
        else:
            out.actions.append(Refuse(waiter, Refusal.NO_RUNNER, waited_for=gone))


def _withdrawn(alive: list[RunnerView], model: str | None) -> tuple[str, ...]:
    """The live runners that list ``model`` but withdrew chat-llm:v1 and hold no job."""
    return tuple(
        r.id for r in alive if r.capable is False and not r.held and model in (r.models or ())
    )
