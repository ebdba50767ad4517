"""One hub: settings, store, admin token, job board, channels, front door, background work."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import pathlib
from typing import Any

import trio

from gateway.hub.board import Changes, Job, JobBoard, JobsView
from gateway.hub.channel import CLOSE_OFFLINE, Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.frontdoor import FrontDoor
from gateway.hub.hubmetrics import HubMetrics
from gateway.hub.settings import HubSettings
from gateway.hub.store import (
    ADMIN_TOKEN_PREFIX,
    DEFAULT_KEY_PROJECT,
    ApiKey,
    KeyLimits,
    Registration,
    limits_of,
    load_or_create_admin_token,
    new_token,
    open_store,
    token_hash,
)

log = logging.getLogger("gateway.hub")


class Hub:
    """The ALP Server emulator's state: ``Hub(data_dir, settings=...)`` or with settings by name
    (``Hub(offline_after=5)``); served by ``gateway.hub.app.serve_hub``."""

    def __init__(
        self,
        data_dir: pathlib.Path | str | None = None,
        *,
        admin_token: str | None = None,
        settings: HubSettings | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = dataclasses.replace(settings or HubSettings(), **overrides)
        self.data_dir = pathlib.Path(data_dir).expanduser() if data_dir is not None else None
        self.store = open_store(self.data_dir, usage_retention=self.settings.usage_retention)
        if admin_token is not None:
            self.admin_token, self.admin_token_created = admin_token, False
        elif self.data_dir is not None:
            self.admin_token, self.admin_token_created = load_or_create_admin_token(self.data_dir)
        else:
            self.admin_token, self.admin_token_created = new_token(ADMIN_TOKEN_PREFIX), True
        self._admin_hash = token_hash(self.admin_token)
        self.counters = HubCounters()
        changes = Changes()
        self.board = JobBoard(self.store, self.settings, changes)
        self.channels = Channels(self.board, changes, self.counters)
        self.frontdoor = FrontDoor(
            self.store, self.settings, self.board, self.channels, self.counters
        )
        # /metrics and the status page's per-key totals: told of every ended turn
        self.metrics = HubMetrics(self)
        self.frontdoor.usage.observers.append(self.metrics.observe)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Everything the hub does on its own while it serves, until cancelled: the live jobs and
        the front door's sessions (read back before ``started``), offline runners' jobs
        force-ended, the store's writer (its queued usage rows written at stop)."""
        await self.board.load()
        await self.frontdoor.restore()
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.store.run)
                nursery.start_soon(self.frontdoor.run)
                nursery.start_soon(self._watch_offline)
        finally:
            log.info("hub counters at stop: %s", self.counters.as_json())

    # -- jobs and channels ------------------------------------------------------------

    @property
    def jobs(self) -> JobsView:
        """Every job by id: live ones from memory, ended ones from the store (``JobsView``)."""
        return JobsView(self.board)

    @property
    def last_seen(self) -> dict[str, float]:
        """Runner id -> trio clock of its last sign of life."""
        return self.board.last_seen

    async def enqueue_job(
        self,
        owner: str,
        project: str,
        needs: list[str],
        agent_definition: dict[str, Any] | None = None,
        *,
        origin: str = "api",
    ) -> Job:
        """Queue a Job for ``owner/project`` and tell every events subscriber of that project."""
        return await self.board.enqueue(owner, project, needs, agent_definition, origin=origin)

    async def save_job(self, job: Job) -> None:
        await self.board.save(job)

    async def withdraw_job(self, job_id: str, reason: str) -> None:
        await self.board.withdraw(job_id, reason)

    def channel(self, job_id: str) -> ServerChannel | None:
        """The job's current open channel, or None."""
        return self.channels.get(job_id)

    def open_channels(self) -> list[ServerChannel]:
        return self.channels.all()

    @property
    def runners_connected(self) -> set[str]:
        """Runner ids with an open channel."""
        return {ch.runner_id for ch in self.channels.all()}

    async def wait_channel(
        self,
        job_id: str,
        timeout: float | None = None,  # noqa: ASYNC109 (the shared API)
    ) -> ServerChannel | None:
        """The job's open channel, waiting for a (re)connect (None on timeout or once it is over)."""
        return await self.channels.wait(job_id, timeout)

    async def end_job(self, job_id: str, reason: str) -> None:
        """Send ``chat.end`` on the job's channel if one is open."""
        await self.channels.end_job(job_id, reason)

    async def cancel_job(self, job_id: str, reason: str = "cancelled") -> None:
        """Withdraw a job: a queued one leaves the queue; an open one gets ``chat.end`` first."""
        await self.channels.cancel_job(job_id, reason)

    async def check_offline(self) -> list[Job]:
        """Force-complete the open jobs of runners silent for ``offline_after`` s, close their
        channels; returns those jobs."""
        forced = await self.board.check_offline()
        for job in forced:
            ch = self.channels.get(job.id)
            if ch is not None:
                ch.request_close(CLOSE_OFFLINE, "runner offline")
        return forced

    async def _watch_offline(self) -> None:
        while True:
            await trio.sleep(min(max(self.settings.offline_after / 5, 0.02), 5.0))
            await self.check_offline()

    # -- registrations and credentials ------------------------------------------------------

    async def register_runner(
        self, owner: str, project: str, name: str, labels: list[str]
    ) -> dict[str, Any]:
        """Register a runner for ``owner/project``: ``{"id","name","token","registeredAt"}``."""
        registration, token = await self.store.add_registration(owner, project, name, list(labels))
        self.board.seen(registration.id, registration)  # a registration: its first sign of life
        return {
            "id": registration.id,
            "name": registration.name,
            "token": token,
            "registeredAt": registration.registered_at,
        }

    async def registration_by_token(self, token: str) -> Registration | None:
        return await self.store.registration_by_token(token)

    def is_admin_token(self, token: str) -> bool:
        return hmac.compare_digest(token_hash(token), self._admin_hash)

    async def create_api_key(
        self,
        name: str,
        project: str = DEFAULT_KEY_PROJECT,
        *,
        rpm: int | None = None,
        tpm: int | None = None,
        tokens_per_day: int | None = None,
        max_streams: int | None = None,
    ) -> str:
        """Create an API key (returned, shown once) with its limits (None or 0: no limit);
        ValueError on a bad name, project or limit."""
        limits = limits_of(rpm, tpm, tokens_per_day, max_streams)
        key = await self.store.create_api_key(name, project, limits)
        self.frontdoor.forget_keys()
        self.frontdoor.usage.forget_limits()
        return key

    async def update_api_key_limits(self, name: str, limits: KeyLimits) -> bool:
        """Replace the active key ``name``'s limits (None or 0: no limit), applied at once;
        False when there is no such key, ValueError on a bad limit."""
        limits = limits_of(limits.rpm, limits.tpm, limits.tokens_per_day, limits.max_streams)
        updated = await self.store.set_key_limits(name, limits)
        self.frontdoor.usage.forget_limits()
        return updated

    async def api_key_limits(self, name: str) -> KeyLimits | None:
        """The active key ``name``'s limits, or None when there is no such key."""
        found = await self.store.key_limits(name)
        return None if found is None else found[1]

    async def list_api_keys(self) -> list[dict[str, Any]]:
        return await self.store.list_api_keys()

    async def revoke_api_key(self, name: str) -> bool:
        """Revoke the active key ``name``: its chat sessions end at once (``chat.end``)."""
        revoked = await self.store.revoke_api_key(name)
        self.frontdoor.forget_keys()
        if revoked:
            self.frontdoor.sessions.check_keys()
        return revoked

    async def check_api_key(self, token: str) -> ApiKey | None:
        return await self.store.check_api_key(token)
