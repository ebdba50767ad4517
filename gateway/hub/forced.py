"""Jobs the Server ends itself, each as failure with one forced report saying why: the open jobs
of a runner silent for ``offline_after`` s, and those of a runner whose registration was revoked
(the job board's own decisions, beside the runners' reports it takes in ``board``)."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any, Protocol

import trio

from gateway.hub.coordination import Coordination
from gateway.hub.job import Job
from gateway.hub.settings import HubSettings

log = logging.getLogger("gateway.hub.board")


class ForcedBoard(Protocol):
    """What of ``board.JobBoard`` these decisions use (the board calls them with itself)."""

    settings: HubSettings
    changes: Any  # board.Changes: ``notify``
    jobs: dict[str, Job]
    last_seen: dict[str, float]

    @property
    def runners(self) -> MutableMapping[str, Any]: ...  # board.RunnerTable

    generation: int
    coordination: Coordination  # where its decisions are made

    async def _keep_report(self, job: Job, report: dict[str, Any]) -> None: ...

    def set_status(self, job: Job, status: str) -> None: ...

    async def _ended(self, job: Job) -> None: ...


async def offline(board: ForcedBoard) -> list[Job]:
    """Force-complete (as failure, one report each) the open jobs of runners silent for
    ``offline_after`` s; returns them."""
    now = trio.current_time()
    forced: list[Job] = []
    for job in list(board.jobs.values()):
        if job.claimed_by is None or job.status == "completed":
            continue
        last = board.last_seen.get(job.claimed_by)
        if last is None:  # a job reloaded at start: its runner gets offline_after to show up
            board.last_seen[job.claimed_by] = now
            board.generation += 1
            continue
        if now - last <= board.settings.offline_after:
            continue
        if await force_end(board, job, "runner offline"):
            forced.append(job)
            log.info("runner %s offline: job %s force-completed", job.claimed_by, job.id)
    if forced:
        board.changes.notify()
    return forced


async def revoked(board: ForcedBoard, runner_id: str) -> list[Job]:
    """A runner's registration was revoked: its open jobs force-completed (as failure, one
    report each: ``runner revoked``), and the runner forgotten (never offered a job again,
    no longer listed); returns those jobs."""
    forced = [
        job
        for job in list(board.jobs.values())
        if job.claimed_by == runner_id
        and job.status != "completed"
        and await force_end(board, job, "runner revoked")
    ]
    board.last_seen.pop(runner_id, None)
    board.runners.pop(runner_id, None)
    board.changes.notify()
    return forced


async def force_end(board: ForcedBoard, job: Job, why: str) -> bool:
    """End a claimed job as failure with one forced report saying ``why``; False when
    another replica ended it first."""
    report = {"status": "completed", "conclusion": "failure", "logs": why, "forced": True}
    if not await board.coordination.complete_job(job, "failure", False):
        await board.coordination.reread_job(job.id, job)  # another replica ended it
        return False
    await board._keep_report(job, report)
    board.set_status(job, "completed")
    job.conclusion = "failure"
    job.completed.set()
    await board._ended(job)
    return True
