"""The job board: jobs queued, matched, claimed once, reported on, ended when offline; no HTTP."""

from __future__ import annotations

import logging
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal, NoReturn

import trio

from gateway.hub import forced
from gateway.hub.bounds import MAX_LOGS, MAX_MESSAGE, MAX_REASON, too_long
from gateway.hub.coordination import Alone, Coordination
from gateway.hub.job import Job
from gateway.hub.runnertable import RunnerState, RunnerTable
from gateway.hub.settings import HubSettings
from gateway.hub.store import Registration, Store

log = logging.getLogger("gateway.hub")

SUBSCRIBER_BUFFER = 64  # job_available events buffered per subscriber; more are dropped
RECENT_ENDED = 256  # ended jobs kept in memory (late reports land on them); older: the store
# One report's body at most (status or progress; the runner API reads no more: 413). A runner's
# final report carries a short ``logs`` (ours: 1,000 characters at most).
REPORT_MAX_BYTES = 16 * 1024

Refusal = Literal["not_found", "conflict", "forbidden", "invalid"]


class BoardError(Exception):
    """A runner's request the board refuses: ``kind`` says why, ``message`` for the runner."""

    def __init__(self, kind: Refusal, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _bounded(*passed: str | None) -> None:
    """BoardError (400) naming the first bound of ``gateway.hub.bounds`` a report passed."""
    for found in passed:
        if found is not None:
            raise BoardError("invalid", found)


class Changes:
    """A wake-up for whoever waits on the board's or the channels' state: ``notify`` wakes all."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()

    @property
    def event(self) -> trio.Event:
        """The event the next ``notify`` sets (take it before looking, wait on it after: a
        change in between is not missed)."""
        return self._event


@dataclass(frozen=True)
class Availability:
    """The runners of one project that gave a sign of life within ``offline_after``, by what
    they can do about a job that needs one capability right now."""

    free: int = 0  # their last poll advertised the capability
    unknown: int = 0  # not polled since the hub started: they may well advertise it
    busy: int = 0  # stopped advertising it while holding jobs: at their capacity
    down: int = 0  # stopped advertising it holding no job: their backends are down

    @property
    def live(self) -> int:
        return self.free + self.unknown + self.busy + self.down


class JobsView:
    """Every job the hub knows, by id: the live ones from memory, ended ones read from the store
    (a fresh copy each time)."""

    def __init__(self, board: JobBoard) -> None:
        self._board = board

    async def get(self, job_id: str) -> Job | None:
        """The job, or None when the hub knows no such job."""
        return await self._board.lookup(job_id)

    async def ids(self) -> list[str]:
        """Every job's id, oldest first."""
        return await self._board.store.job_ids()

    async def values(self) -> list[Job]:
        """Every job, oldest first."""
        found = [await self._board.lookup(job_id) for job_id in await self.ids()]
        return [job for job in found if job is not None]

    async def count(self) -> int:
        return await self._board.store.count_jobs()


class JobBoard:
    """Every Chat Job of the hub and what runners did with it; each change is saved to the store.

    ``jobs`` holds the live jobs only: a job leaves it when it is completed (it stays in the
    store, where ``lookup`` and ``JobsView`` find it), so polls scan only what can still run;
    the last ``RECENT_ENDED`` ended ones stay in memory too, for a late report.
    """

    def __init__(
        self,
        store: Store,
        settings: HubSettings,
        changes: Changes,
        coordination: Coordination | None = None,
    ) -> None:
        self.store = store
        # where its writes go and who decides a claim, an end, a withdrawal (``coordination``)
        self.coordination: Coordination = coordination or Alone(store)
        self.settings = settings
        self.changes = changes
        self.jobs: dict[str, Job] = {}  # the live ones: ``load`` reads them back at start
        self.last_seen: dict[str, float] = {}  # runner id -> trio clock of its last sign of life
        # runner id -> its project and last poll, and the live jobs it holds (claimed, not over),
        # counted by ``_count`` as a job's holder or over-ness changes (``hold``, ``set_status``,
        # ``cancel``, ``drop``): nobody walks the jobs to count them
        self.runners = RunnerTable()
        self.recent: OrderedDict[str, Job] = OrderedDict()  # the last ended jobs, oldest first
        self.late_reports = 0  # reports dropped: they came after their job's final report
        self._subscribers: dict[tuple[str, str], set[trio.MemorySendChannel[str]]] = {}
        # runner id -> its open push streams (a job offered to a few runners wakes only them)
        self._pushed: dict[str, set[trio.MemorySendChannel[str]]] = {}
        self._pushed_in: dict[tuple[str, str], int] = {}  # per project: its runners' push streams
        # per project, the jobs a poll may offer (queued, or claimed and not started yet), in
        # order: an idle poll looks at these, never at every live job (pruned as it looks)
        self._pending: dict[tuple[str, str], dict[str, Job]] = {}
        self.generation = 0  # bumped when a runner is seen first, or again after its silence
        self.scanned = 0  # jobs the polls looked at (a poll's work: tests count it)
        self.pushes = 0  # job_available events sent (tests count who a new job wakes)
        self.on_forget: list[Callable[[str], None]] = []  # told of each job leaving memory

    @property
    def all_jobs(self) -> JobsView:
        """Every job by id: live ones from memory, ended ones from the store."""
        return JobsView(self)

    async def load(self) -> None:
        """Read the live jobs back from the store (at start; a job already on the board stays)."""
        for stored in await self.store.load_jobs(live_only=True):
            if stored.id not in self.jobs:
                self.add(Job.from_record(stored))

    def add(self, job: Job) -> None:
        """A live job onto the board (and among its project's pending ones while a poll may
        still offer it)."""
        self.jobs[job.id] = job
        self._count(job.id)
        if job.status == "queued" and not job.channel_opened:
            self._pending.setdefault((job.owner, job.project), {})[job.id] = job

    async def lookup(self, job_id: str) -> Job | None:
        """The job, live (the board's own object) or ended (a copy read from the store)."""
        job = self.jobs.get(job_id) or self.recent.get(job_id)
        if job is not None:
            return job
        stored = await self.store.load_job(job_id)
        return Job.from_record(stored) if stored is not None else None

    async def _ended(self, job: Job) -> None:
        """A job completed: saved (unless its end was written already), then out of memory
        (the store keeps it)."""
        await self.coordination.decided(job)
        self.forget_ended(job)

    def forget_ended(self, job: Job) -> None:
        """An ended job out of the live ones (kept among the recent ones)."""
        if self.jobs.get(job.id) is job:
            self.drop(job.id)
            self.recent[job.id] = job
            while len(self.recent) > RECENT_ENDED:
                self.recent.popitem(last=False)
            for observe in self.on_forget:
                observe(job.id)

    # -- who holds what: the one place a live job's holder or over-ness changes ------------

    def hold(self, job: Job, runner_id: str, name: str | None, run_id: str | None) -> None:
        """The job is claimed by ``runner_id`` (its claim here, or another replica's)."""
        job.claimed_by, job.runner_name, job.run_id = runner_id, name, run_id
        job.claimed_at = trio.current_time()
        job.claimed.set()
        self._count(job.id)

    def set_status(self, job: Job, status: str) -> None:
        """The job's status (``completed``: it is over)."""
        job.status = status
        self._count(job.id)

    def cancel(self, job: Job, reason: str | None) -> None:
        """The job is cancelled (its first reason kept): over."""
        job.cancelled = True
        job.cancel_reason = job.cancel_reason or reason
        self._count(job.id)

    def drop(self, job_id: str) -> Job | None:
        """The job out of the live ones (ended, withdrawn before a claim, gone elsewhere)."""
        job = self.jobs.pop(job_id, None)
        self._count(job_id)
        return job

    def held(self, runner_id: str) -> int:
        """How many live jobs the runner holds (claimed, not completed nor withdrawn)."""
        return self.runners.held(runner_id)

    def _count(self, job_id: str) -> None:
        """The job counted for its holder as it is now: live, claimed and not over, or not."""
        job = self.jobs.get(job_id)
        self.runners.count(job_id, job.claimed_by if job is not None and not job.over else None)

    # -- jobs in ----------------------------------------------------------------

    async def enqueue(
        self,
        owner: str,
        project: str,
        needs: list[str],
        agent_definition: dict[str, Any] | None = None,
        *,
        origin: str = "api",
        runners: frozenset[str] | None = None,
    ) -> Job:
        """Queue a Job for ``owner/project`` (offered to ``runners`` only, when given) and tell
        every subscriber of that project."""
        job = Job(
            id=str(uuid.uuid4()),
            owner=owner,
            project=project,
            needs=list(needs),
            agent_definition=dict(agent_definition) if agent_definition is not None else {},
            origin=origin,
            runners=runners,
        )
        self.add(job)
        await self.save(job)
        self.changes.notify()
        self.announce(job)
        return job

    def announce(self, job: Job) -> None:
        """``job_available`` for the job to the push streams of the runners it is offered to
        (``job.runners``: a few the dispatcher chose), or of its whole project (offered to any)."""
        if job.runners is None:
            self._push(job.id, self._subscribers.get((job.owner, job.project), set()))
            return
        for runner_id in job.runners:
            self._push(job.id, self._pushed.get(runner_id, set()))

    def _push(self, job_id: str, subscribers: set[trio.MemorySendChannel[str]]) -> None:
        for send_ch in list(subscribers):
            self.pushes += 1
            try:
                send_ch.send_nowait(job_id)
            except trio.WouldBlock:
                pass  # that subscriber has events pending already: it will poll anyway
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                subscribers.discard(send_ch)

    def subscribed(self, runner_id: str) -> bool:
        """Whether the runner has a push stream open to this hub."""
        return bool(self._pushed.get(runner_id))

    def any_subscribed(self, owner: str, project: str) -> bool:
        """Whether any runner of ``owner/project`` has a push stream open to this hub."""
        return bool(self._pushed_in.get((owner, project)))

    @contextmanager
    def subscribe(
        self, owner: str, project: str, runner_id: str | None = None
    ) -> Iterator[trio.MemoryReceiveChannel[str]]:
        """The ids of jobs queued in ``owner/project`` while the block runs (a few buffered):
        those offered to any runner, and those offered to ``runner_id``."""
        send_ch, recv_ch = trio.open_memory_channel[str](SUBSCRIBER_BUFFER)
        subscribers = self._subscribers.setdefault((owner, project), set())
        subscribers.add(send_ch)
        if runner_id is not None:
            self._pushed.setdefault(runner_id, set()).add(send_ch)
            self._pushed_in[(owner, project)] = self._pushed_in.get((owner, project), 0) + 1
        try:
            yield recv_ch
        finally:
            subscribers.discard(send_ch)
            if not subscribers and self._subscribers.get((owner, project)) is subscribers:
                del self._subscribers[(owner, project)]
            if runner_id is not None:
                left = self._pushed_in[(owner, project)] - 1
                if left:
                    self._pushed_in[(owner, project)] = left
                else:
                    del self._pushed_in[(owner, project)]
                own = self._pushed.get(runner_id)
                if own is not None:
                    own.discard(send_ch)
                    if not own:
                        del self._pushed[runner_id]
            send_ch.close()

    async def save(self, job: Job) -> None:
        """Write the job's state to the store (after every change)."""
        await self.coordination.save_job(job)

    async def target(self, job: Job, runners: frozenset[str] | None) -> None:
        """Offer the unclaimed job to ``runners`` only (None: any capable one); the other
        replicas are told (a change only), and the runners when it widens (``job_available``:
        a runner it now goes to polls at once)."""
        if job.runners == runners:
            return
        widened = job.runners is not None and (runners is None or not runners <= job.runners)
        job.runners = runners
        if widened and job.claimed_by is None and not job.over:
            self.announce(job)
        if job.claimed_by is None and not job.over:
            await self.coordination.offered(job)

    # -- what runners do --------------------------------------------------------

    def seen(self, runner_id: str, registration: Registration | None = None) -> None:
        """The runner gave a sign of life (the first one wakes whoever waits on the board);
        its ``registration``, when the caller has it, tells the board its project."""
        now = trio.current_time()
        last = self.last_seen.get(runner_id)
        first = last is None
        if last is None or now - last > self.settings.offline_after:
            self.generation += 1  # a runner new, or back from silence: live lists differ
        self.last_seen[runner_id] = now
        if registration is not None:
            state = self.runners.get(runner_id)
            project = (registration.owner, registration.project)
            if state is None:
                state = self.runners[runner_id] = RunnerState(*project)
            elif (state.owner, state.project) != project:  # moved: indexed under its new one
                state = self.runners[runner_id] = replace(
                    state, owner=project[0], project=project[1]
                )
            state.name, state.labels = registration.name, registration.labels
        self.coordination.runner_seen(runner_id, first)  # a runner new here: told at once
        if first:
            self.changes.notify()

    def polled(
        self, runner_id: str, owner: str, project: str, caps: set[str], stop: bool = False
    ) -> None:
        """Note what a runner's poll advertised (a change wakes whoever waits on the board);
        ``stop``: its last poll said it stops (a clean stop)."""
        state = self.runners.get(runner_id)
        if state is None:
            state = self.runners[runner_id] = RunnerState(owner, project)
        changed = state.capabilities != caps or state.stopped != stop
        state.capabilities, state.polled_at = frozenset(caps), trio.current_time()
        state.stopped = stop
        if changed:
            self.changes.notify()
            self.coordination.runner_seen(runner_id, True)

    def alive(self, runner_id: str) -> bool:
        """The runner gave a sign of life within ``offline_after``."""
        last = self.last_seen.get(runner_id)
        return last is not None and trio.current_time() - last <= self.settings.offline_after

    def up(self, runner_id: str) -> bool:
        """The runner is alive and did not say it stopped (its last poll, at a clean stop)."""
        state = self.runners.get(runner_id)
        return self.alive(runner_id) and not (state is not None and state.stopped)

    def availability(
        self, owner: str, project: str, capability: str, *, exclude: str | None = None
    ) -> Availability:
        """The live runners of ``owner/project`` (but ``exclude``), by whether they can take a
        job needing ``capability`` now."""
        counts = {"free": 0, "unknown": 0, "busy": 0, "down": 0}
        for runner_id, state in self.runners.of(owner, project).items():
            if runner_id == exclude:
                continue
            if not self.alive(runner_id):
                continue
            if state.capabilities is None:
                counts["unknown"] += 1
            elif capability in state.capabilities:
                counts["free"] += 1
            elif self.held(runner_id):
                counts["busy"] += 1
            else:
                counts["down"] += 1
        return Availability(**counts)

    def unstarted_claim(self, job: Job, runner_id: str) -> bool:
        """``runner_id`` claimed the job and has not started it (no in_progress, no channel)."""
        return (
            job.claimed_by == runner_id
            and job.status == "queued"
            and not job.cancelled
            and not job.channel_opened
        )

    def offered(
        self, runner_id: str, owner: str, project: str, capabilities: set[str], stop: bool = False
    ) -> list[Job]:
        """The jobs a poll offers: queued, within the capabilities, or this runner's own unstarted
        claim after ``reoffer_after`` (its claim answer may have been lost)."""
        self.polled(runner_id, owner, project, capabilities, stop)
        now = trio.current_time()
        pending = self._pending.get((owner, project))
        if not pending:
            return []
        out = []
        for job in list(pending.values()):
            self.scanned += 1
            if (
                self.jobs.get(job.id) is not job
                or job.status != "queued"
                or job.channel_opened
                or job.cancelled
            ):
                del pending[job.id]  # no poll offers it again: out of the index
                continue
            if not set(job.needs) <= capabilities:
                continue
            if job.claimed_by is None:
                targets = job.runners
                if targets is None or runner_id in targets:
                    out.append(job)
                continue
            claimed_at = -math.inf if job.claimed_at is None else job.claimed_at
            due = now - claimed_at >= self.settings.reoffer_after
            if due and self.unstarted_claim(job, runner_id):
                out.append(job)
        if not pending:
            del self._pending[(owner, project)]
        return out

    async def claim(self, runner_id: str, owner: str, project: str, job_id: str, name: str) -> str:
        """Claim a job for ``runner_id``: its run id. The same runner again before starting it
        gets the same run id (it lost the answer); anyone else a conflict. On replicas the claim
        is one conditional statement: it lands once, whatever replica each claim reaches."""
        job = await self.lookup(job_id)
        if job is None or (job.owner, job.project) != (owner, project):
            raise BoardError("not_found", "no such job")
        if self.unstarted_claim(job, runner_id):
            log.info(
                "job %s claimed again by runner %s: same run %s", job.id, runner_id, job.run_id
            )
            assert job.run_id is not None
            return job.run_id
        if job.claimed_by is not None or job.status != "queued" or job.cancelled:
            raise BoardError("conflict", "this job is already claimed")
        run_id = str(uuid.uuid4())
        if not await self.coordination.claim_job(job, runner_id, name, run_id):
            # another claim (or a withdrawal) came first
            found = await self.coordination.reread_job(job_id, None)
            if found is not None and self.unstarted_claim(found, runner_id):
                assert found.run_id is not None
                return found.run_id
            raise BoardError("conflict", "this job is already claimed")
        self.hold(job, runner_id, name, run_id)
        await self.coordination.decided(job)
        self.changes.notify()
        return run_id

    async def own_job(
        self, runner_id: str, owner: str, project: str, run_id: str, job_id: str
    ) -> Job:
        """The job a runner reports on, if it is that runner's claim under that run."""
        job = await self.lookup(job_id)
        if job is None or job.claimed_by != runner_id or job.run_id != run_id:
            # claimed through another replica a moment ago?
            job = await self.coordination.reread_job(job_id, job)
        if job is None or (job.owner, job.project) != (owner, project):
            raise BoardError("not_found", "no such job")
        if job.claimed_by != runner_id:
            raise BoardError("forbidden", "this job is not claimed by this runner")
        if job.run_id != run_id:
            raise BoardError("not_found", "no such run for this job")
        return job

    async def report_status(self, job: Job, report: dict[str, Any]) -> None:
        """A status report (``in_progress`` or the one ``completed``), validated before anything
        is kept. Kept: the first ``in_progress`` (a repeated one changes nothing) and the final
        report. Not kept: a refused report, or one after the job's final report (a conflict,
        counted in ``late_reports``)."""
        status = report.get("status")
        if status not in ("in_progress", "completed"):
            raise BoardError("invalid", '"status" must be "in_progress" or "completed"')
        if job.status == "completed":
            self._late()
        if status == "in_progress":
            if job.status != "in_progress":
                self.set_status(job, "in_progress")
                await self._keep_report(job, report)
                await self.save(job)
            return
        conclusion = report.get("conclusion")
        if conclusion not in ("success", "failure"):
            raise BoardError("invalid", '"conclusion" must be "success" or "failure"')
        for key, limit in (("logs", MAX_LOGS), ("completionReason", MAX_REASON)):
            if report.get(key) is not None:
                if not isinstance(report[key], str):
                    raise BoardError("invalid", f'"{key}" must be a string')
                _bounded(too_long(f'"{key}"', report[key], limit))
        if not await self.coordination.complete_job(job, conclusion, True):
            await self.coordination.reread_job(job.id, job)  # another replica ended it first
            self._late()
        await self._keep_report(job, report)
        self.set_status(job, "completed")
        job.conclusion = conclusion
        job.final_reported = True
        job.completed.set()
        await self._ended(job)
        self.changes.notify()

    def report_progress(self, job: Job, report: dict[str, Any]) -> None:
        """A heartbeat (``{"stage", "message"?}``), validated before it is kept: the job keeps
        its last one and their count only, in memory; none after the job's final report (a
        conflict, counted in ``late_reports``)."""
        if not isinstance(report.get("stage"), str):
            raise BoardError("invalid", '"stage" must be a string')
        if report.get("message") is not None and not isinstance(report["message"], str):
            raise BoardError("invalid", '"message" must be a string or null')
        _bounded(
            too_long('"stage"', report["stage"], MAX_REASON),
            too_long('"message"', report.get("message") or "", MAX_MESSAGE),
        )
        if job.status == "completed":
            self._late()
        job.last_progress = report
        job.heartbeats += 1

    def _late(self) -> NoReturn:
        """A report after its job's final one: dropped, counted, refused as a conflict."""
        self.late_reports += 1
        raise BoardError("conflict", "this job is already completed")

    async def channel_job(self, runner_id: str, job_id: str) -> Job | None:
        """``may_open_channel``, after reading the job again when this hub's copy says no (on
        replicas: claimed through another replica a moment ago)."""
        job = self.may_open_channel(runner_id, job_id)
        if job is None and await self.coordination.reread_job(job_id, None) is not None:
            job = self.may_open_channel(runner_id, job_id)
        return job

    def may_open_channel(self, runner_id: str, job_id: str) -> Job | None:
        """The job when ``runner_id`` may open its channel now (its claim, not over), else None."""
        job = self.jobs.get(job_id)
        if job is None or job.claimed_by != runner_id or job.over:
            return None
        return job

    # -- the Server's own decisions -------------------------------------------------

    async def withdraw(self, job_id: str, reason: str) -> None:
        """Mark a job cancelled (without telling its runner: the caller sends chat.end first).

        A queued job is forgotten; a claimed one stays, cancelled: its channel is refused from
        now on, so its runner ends the session and sends its final report.
        """
        job = self.jobs.get(job_id)
        if job is None or job.status == "completed":
            return
        outcome = await self.coordination.withdraw_job(job, reason)
        if outcome is None:  # ended meanwhile, through another replica
            await self.coordination.reread_job(job_id, job)
            return
        self.cancel(job, reason)
        if outcome == "deleted":
            self.drop(job_id)
        await self.coordination.decided(job)
        self.changes.notify()

    async def check_offline(self) -> list[Job]:
        """Force-complete the open jobs of runners silent for ``offline_after`` s (``forced``)."""
        return await forced.offline(self)

    async def revoked(self, runner_id: str) -> list[Job]:
        """A runner's registration was revoked: its open jobs force-completed (``forced``)."""
        return await forced.revoked(self, runner_id)

    async def _keep_report(self, job: Job, report: dict[str, Any]) -> None:
        job.reports.append(report)
        await self.store.add_job_report(job.id, report)
