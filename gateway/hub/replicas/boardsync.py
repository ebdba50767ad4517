"""One replica's job board kept in step with the team's store: its writes (``BoardSync``, what
the board's coordination calls: claims, ends and withdrawals as conditional statements), the
rows other replicas changed read back into it (``apply``), and the runners they heard from
(``seen_remote``)."""

from __future__ import annotations

import trio

from gateway.hub.board import JobBoard
from gateway.hub.job import Job
from gateway.hub.replicas.store.base import Presence, ReplicaStore, TeamJob
from gateway.hub.runnertable import RunnerState


class BoardSync:
    """The board's writes on a team (``coordination.Replicated`` makes them through it)."""

    def __init__(self, board: JobBoard, store: ReplicaStore) -> None:
        self.board = board
        self.store = store
        self.touched: set[str] = set()
        self._changed = False
        self.wake = trio.Event()  # a runner's capabilities changed: the presence is written

    @property
    def changed(self) -> bool:
        """A runner's advertised capabilities changed since the presence was written."""
        return self._changed

    @changed.setter
    def changed(self, value: bool) -> None:
        self._changed = value
        if value:
            self.wake.set()

    async def save(self, job: Job) -> None:
        await self.store.save_job(job.record(), job.runners)

    async def claim(self, job: Job, runner_id: str, name: str, run_id: str) -> TeamJob | None:
        return await self.store.claim_job(job.id, runner_id, name, run_id)

    async def complete(self, job: Job, conclusion: str, final: bool) -> bool:
        return await self.store.complete_job(job.id, conclusion, final)

    async def withdraw(self, job_id: str, reason: str) -> str | None:
        return await self.store.withdraw_job(job_id, reason)

    async def refresh(self, job_id: str) -> Job | None:
        return apply(self.board, job_id, await self.store.load_job(job_id))


def apply(board: JobBoard, job_id: str, found: TeamJob | None) -> Job | None:
    """The job as the store has it now (another replica changed it) into ``board``: a new
    queued one is announced to this replica's subscribers, an ended one leaves memory, one gone
    (withdrawn before a claim) is forgotten. The live job, or None."""
    job = board.jobs.get(job_id)
    if found is None:
        if job is not None:
            board.cancel(job, None)
            board.drop(job_id)
            board.changes.notify()
        return None
    stored = found.job
    if job is None:
        if stored.status == "completed" or job_id in board.recent:
            return None
        job = Job.from_record(stored)
        job.runners = found.offered_to
        board.add(job)
        board.changes.notify()
        if job.claimed_by is None and not job.cancelled:
            board.announce(job)
        return job
    before = (job.claimed_by, job.status, job.cancelled, job.runners)
    if job.claimed_by is None and stored.claimed_by is not None:
        board.hold(job, stored.claimed_by, stored.runner_name, stored.run_id)
    if job.claimed_by is None and job.runners != found.offered_to:
        job.runners = found.offered_to
        if not job.cancelled:  # offered to others now: those of them here are told
            board.announce(job)
    if stored.cancelled and not job.cancelled:
        board.cancel(job, stored.cancel_reason)
    if job.status != "completed" and stored.status != job.status:
        board.set_status(job, stored.status)
    job.conclusion = job.conclusion or stored.conclusion
    job.final_reported = job.final_reported or stored.final_reported
    if len(stored.reports) > len(job.reports):
        job.reports = list(stored.reports)
    if job.status == "completed":
        job.completed.set()
        board.forget_ended(job)
    if (job.claimed_by, job.status, job.cancelled, job.runners) != before:
        board.changes.notify()
    return job if job.id in board.jobs else None


def seen_remote(board: JobBoard, presence: Presence) -> None:
    """A runner as any replica saw it: its last sign of life (the later of this replica's and
    the store's), and what its last poll advertised (the newer)."""
    now = trio.current_time()
    runner_id = presence.runner_id
    state = board.runners.get(runner_id)
    if state is None:
        state = board.runners[runner_id] = RunnerState(presence.owner, presence.project)
    if presence.name is not None:
        state.name, state.labels = presence.name, presence.labels
    seen = now - presence.seen_age
    first = runner_id not in board.last_seen
    if first or seen > board.last_seen[runner_id]:
        if first or now - board.last_seen[runner_id] > board.settings.offline_after:
            board.generation += 1  # a runner new or back: the live lists differ
        board.last_seen[runner_id] = seen
    changed = first
    if presence.capabilities is not None and presence.polled_age is not None:
        polled = now - presence.polled_age
        if state.polled_at is None or polled > state.polled_at:
            changed = changed or state.capabilities != presence.capabilities
            changed = changed or state.stopped != presence.stopped
            state.capabilities, state.polled_at = presence.capabilities, polled
            state.stopped = presence.stopped
    if changed:
        board.changes.notify()


def presence_of(board: JobBoard, runner_id: str) -> Presence | None:
    """What this replica knows of a runner, for the store (None: not enough yet)."""
    state = board.runners.get(runner_id)
    seen = board.last_seen.get(runner_id)
    if state is None or seen is None:
        return None
    now = trio.current_time()
    return Presence(
        runner_id,
        state.owner,
        state.project,
        state.name,
        tuple(state.labels),
        max(0.0, now - seen),
        state.capabilities,
        None if state.polled_at is None else max(0.0, now - state.polled_at),
        state.stopped,
    )
