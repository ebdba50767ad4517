"""A Chat Job as the hub keeps it in memory: its claim, status and reports, the events its
waiters wait on, and the JSON each API shows of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from gateway.hub.store import StoredJob


@dataclass(eq=False)
class Job:
    """One queued or claimed Chat Job (mirrored in the hub's store)."""

    id: str
    owner: str
    project: str
    needs: list[str]
    agent_definition: dict[str, Any]
    origin: str = "api"  # "api" (enqueue_job) or "frontdoor" (a /v1 chat or listing session)
    run_id: str | None = None
    claimed_by: str | None = None  # runner id
    runner_name: str | None = None  # the "name" sent with the claim
    status: str = "queued"  # "queued" | "in_progress" | "completed"
    conclusion: str | None = None  # "success" | "failure"
    # status reports kept: the first in_progress and the final one (the runner's, or forced)
    reports: list[dict[str, Any]] = field(default_factory=list)
    last_progress: dict[str, Any] | None = None  # the last heartbeat (memory only)
    heartbeats: int = 0  # progress reports accepted (memory only)
    completed: trio.Event = field(default_factory=trio.Event)
    claimed: trio.Event = field(default_factory=trio.Event)
    cancelled: bool = False
    cancel_reason: str | None = None
    final_reported: bool = False  # a runner's "completed" report was accepted
    claimed_at: float | None = None  # trio clock; None for a job reloaded at start
    channel_opened: bool = False  # a channel of this job was accepted (since this hub started)
    # offered only to these runners (None: any capable one): the dispatcher's placement by
    # model, a listing for one runner; not stored (an unclaimed job does not outlive a restart)
    runners: frozenset[str] | None = None

    @property
    def over(self) -> bool:
        """No channel can serve this job any more (completed or cancelled)."""
        return self.status == "completed" or self.cancelled

    def record(self) -> StoredJob:
        """The job as the store keeps it (without its reports)."""
        return StoredJob(
            id=self.id,
            owner=self.owner,
            project=self.project,
            needs=list(self.needs),
            agent_definition=self.agent_definition,
            origin=self.origin,
            run_id=self.run_id,
            claimed_by=self.claimed_by,
            runner_name=self.runner_name,
            status=self.status,
            conclusion=self.conclusion,
            final_reported=self.final_reported,
            cancelled=self.cancelled,
            cancel_reason=self.cancel_reason,
        )

    @classmethod
    def from_record(cls, stored: StoredJob) -> Job:
        """A job reloaded from the store, its events set to match its state."""
        job = cls(
            id=stored.id,
            owner=stored.owner,
            project=stored.project,
            needs=list(stored.needs),
            agent_definition=dict(stored.agent_definition),
            origin=stored.origin,
            run_id=stored.run_id,
            claimed_by=stored.claimed_by,
            runner_name=stored.runner_name,
            status=stored.status,
            conclusion=stored.conclusion,
            reports=list(stored.reports),
            cancelled=stored.cancelled,
            cancel_reason=stored.cancel_reason,
            final_reported=stored.final_reported,
        )
        if job.claimed_by is not None:
            job.claimed.set()
        if job.status == "completed":
            job.completed.set()
        return job

    def admin_json(self) -> dict[str, Any]:
        """Everything about the job, for ``GET /api/hub/jobs``."""
        return {
            "id": self.id,
            "runId": self.run_id,
            "owner": self.owner,
            "project": self.project,
            "needs": list(self.needs),
            "agentDefinition": self.agent_definition,
            "origin": self.origin,
            "claimedBy": self.claimed_by,
            "runnerName": self.runner_name,
            "status": self.status,
            "conclusion": self.conclusion,
            "finalReported": self.final_reported,
            "cancelled": self.cancelled,
            "cancelReason": self.cancel_reason,
            "reports": list(self.reports),
        }

    def to_json(self) -> dict[str, Any]:
        """The Job as a poll reply lists it."""
        return {
            "id": self.id,
            "runId": None,
            "needs": list(self.needs),
            "agentDefinition": self.agent_definition,
        }
