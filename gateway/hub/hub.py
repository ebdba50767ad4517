"""One hub, wired: its store, credentials, job board, channels, sessions, dispatcher, model
catalog, accounting, serving and front door, and the background work they do while it serves."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import trio

from gateway.hub.accounting import Accounting
from gateway.hub.board import Changes, Job, JobBoard
from gateway.hub.catalog import Catalog
from gateway.hub.channel import CLOSE_OFFLINE, Channels
from gateway.hub.coordination import Alone, Coordination
from gateway.hub.counters import HubCounters
from gateway.hub.dispatcher import Dispatcher
from gateway.hub.frontdoor import FrontDoor
from gateway.hub.keys import Keys
from gateway.hub.metrics import HubMetrics
from gateway.hub.oidc import Oidc
from gateway.hub.people import People
from gateway.hub.pushstreams import PushStreams
from gateway.hub.replicas.coordination import replicated
from gateway.hub.replicas.replica import Replication
from gateway.hub.runners import REVOCATION_CHECK, RunnerAdmin
from gateway.hub.serving import Serving
from gateway.hub.sessions import Sessions
from gateway.hub.settings import HubSettings
from gateway.hub.snapshot import HubSnapshot, take
from gateway.hub.store import StoreError, open_store, token_hash
from gateway.hub.store.journal import Journal

log = logging.getLogger("gateway.hub")


class Hub:
    """The hub's parts, made and wired here and nothing more: ``Hub(data_dir, settings=...)``
    or with settings by name (``Hub(offline_after=5)``); served by ``gateway.hub.app``."""

    def __init__(
        self,
        data_dir: pathlib.Path | str | None = None,
        *,
        admin_token: str | None = None,
        settings: HubSettings | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = settings = dataclasses.replace(settings or HubSettings(), **overrides)
        self.data_dir = pathlib.Path(data_dir).expanduser() if data_dir is not None else None
        self.store = store = open_store(
            settings.store or self.data_dir,
            pool_size=settings.store_pool,
            usage_retention=settings.usage_retention,
        )
        # the admin credential: given, or the store's (made at the first start; on PostgreSQL
        # a later replica knows only its hash, and ``admin_token`` is None there)
        self.admin_token: str | None
        if admin_token is not None:
            self.admin_token, self.admin_token_created = admin_token, False
            admin_hash = token_hash(admin_token)
        else:
            credential = store.admin_credential(self.data_dir)
            self.admin_token, admin_hash = credential.token, credential.hash
            self.admin_token_created = credential.created
        self.counters = counters = HubCounters()
        changes = Changes()
        self.keys = keys = Keys(store, settings, admin_hash)
        # people who sign in with OpenID Connect (issue 34): none without --oidc-issuer
        self.people = People(
            store, settings, Oidc(settings) if settings.oidc_issuer is not None else None
        )
        # on a store other hubs share, this hub is one of their replicas (gateway.hub.replicas):
        # its parts call them through its coordination (gateway.hub.coordination)
        replicas = replicated(store, settings, self.data_dir)
        self.coordination: Coordination = replicas or Alone(store)
        self.board = board = JobBoard(store, settings, changes, self.coordination)
        self.channels = channels = Channels(board, changes, counters)
        self.sessions = sessions = Sessions(
            store,
            idle_timeout=lambda: settings.session_idle_timeout,
            max_per_key=lambda: settings.max_sessions_per_key,
            key_check_interval=lambda: settings.key_check_interval,
            job_over=self._job_over,
            end_job=channels.cancel_job,
            coordination=self.coordination,
        )
        board.on_forget.append(sessions.job_ended)  # its session looked at by the next walk
        self.runner_admin = RunnerAdmin(store, board, channels)
        self.dispatcher = dispatcher = Dispatcher(settings, board, channels, sessions, counters)
        self.catalog = catalog = Catalog(store, settings, board, channels)
        dispatcher.relist = lambda ch: catalog.ask(ch, settings.models_timeout)
        self.accounting = accounting = Accounting(
            store, settings, label=catalog.label, coordination=self.coordination
        )
        self.frontdoor = FrontDoor(
            settings,
            keys,
            catalog,
            Serving(settings, accounting, sessions, dispatcher, catalog.embeds),
        )
        self.metrics = HubMetrics()
        # the runners' push streams, kept alive by one ticker (started by ``run``)
        self.push_streams = PushStreams(self._events_quiet)
        accounting.observers.append(self.metrics.observe)
        keys.on_revoked.append(sessions.check_keys)
        keys.on_revoked_key.append(self._revoked)  # its turns in flight end at once
        sessions.on_key_check.append(self._key_check)
        keys.on_limits.append(accounting.forget_limits)
        sessions.on_key_check.append(keys.keep_active)
        # a replica's own machinery (its peers, their channels, the store's notifications)
        self.team: Replication | None = self.coordination.join(
            hub_store=store, board=board, channels=channels, sessions=sessions, catalog=catalog
        )

    def _events_quiet(self) -> float:
        """The longest a runner's events stream stays quiet: ``keepalive_interval``, and at most
        half the ping interval (a runner reads a stream silent past its ping interval and
        timeout as a dead path: docs/protocol.md §2)."""
        s = self.settings
        quiet = s.keepalive_interval
        if s.ping_interval > 0:
            quiet = min(quiet, s.ping_interval / 2)
        return quiet

    def _revoked(self, key_id: str) -> None:
        """A key revoked here (or, on a team, by another replica): its turns in flight end."""
        self.accounting.end_turns(key_id.__eq__)

    def _key_check(self, active: set[str]) -> None:
        """The sessions' key check: the turns of a key revoked by another process end too."""
        self.accounting.end_turns(lambda key_id: key_id not in active)

    def _job_over(self, job_id: str) -> bool:
        """No further turn can be served by this job (completed, cancelled, its runner ended it)."""
        job = self.board.jobs.get(job_id)
        return job is None or job.over or job_id in self.channels.runner_ended

    def snapshot(self) -> HubSnapshot:
        """What the admin routes, ``/metrics`` and the status page read."""
        return take(
            board=self.board,
            channels=self.channels,
            sessions=self.sessions,
            dispatcher=self.dispatcher,
            catalog=self.catalog,
            accounting=self.accounting,
            counters=self.counters,
            connected=self.coordination.connected_runners(),
            replica=self.coordination.identity(),
        )

    async def restore(self) -> None:
        """The live jobs and the stored sessions back (before serving); a front-door job no
        stored session points at lost its client in the restart (or its key was revoked):
        withdrawn, so its runner's redial is refused and the runner reports the job's outcome.
        With a data directory, its usage journal is taken on first: the turns a kill left out of
        the ledger (ended, or cut by it) are written."""
        if self.data_dir is not None and self.store.journal is None:
            recovered = await self.store.recover_journal(Journal(self.data_dir))
            if recovered:
                log.warning(
                    "usage of %d turn(s) that ended or were cut as the hub last stopped: "
                    "recorded from its journal",
                    recovered,
                )
        await self.coordination.restore(self._restore)  # a replica reads the store as it starts

    async def _restore(self) -> None:
        """``restore`` of a hub alone."""
        await self.board.load()
        kept = await self.sessions.restore()
        for job in list(self.board.jobs.values()):
            if job.origin in ("frontdoor", "listing") and job.id not in kept and not job.over:
                await self.board.withdraw(job.id, "its chat session was lost in a hub restart")
        # the claimed jobs' runners come back and redial them from now on
        self.channels.restored_at = trio.current_time()
        self.channels.awaited = {
            job.id for job in self.board.jobs.values() if job.claimed_by and not job.over
        }

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Everything the hub does on its own while it serves, until cancelled: its jobs and
        sessions (read back before ``started``), the dispatcher, the model catalog, offline
        runners, the store's writer (its queued usage rows written at stop)."""
        await self.restore()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.coordination.run)
                task_status.started()
                nursery.start_soon(self.store.run)
                nursery.start_soon(self.sessions.run)
                nursery.start_soon(self.dispatcher.run)
                nursery.start_soon(self.catalog.run)
                nursery.start_soon(self._watch_offline)
                nursery.start_soon(self.runner_admin.run)
                nursery.start_soon(self._watch_revoked_keys)
                nursery.start_soon(self.push_streams.run)
        finally:
            log.info(
                "hub stopped; counters: %s",
                ", ".join(f"{k} {v}" for k, v in self.counters.as_json().items() if v) or "none",
            )

    async def check_offline(self) -> list[Job]:
        """Force-complete the open jobs of runners silent for ``offline_after`` s, and close
        their channels; returns those jobs."""
        forced = await self.board.check_offline()
        for job in forced:
            ch = self.channels.local(job.id)
            if ch is not None:
                ch.request_close(CLOSE_OFFLINE, "runner offline")
        return forced

    async def _watch_revoked_keys(self) -> None:
        """A key revoked by another replica or process (the CLI): its turns in flight here end
        within ``REVOCATION_CHECK`` s, the store asked only while turns are in flight (one
        revoked here ends them at once, ``_revoked``)."""
        while True:
            await trio.sleep(REVOCATION_CHECK)
            if not self.accounting.in_flight:
                continue
            try:
                active = await self.store.active_key_ids()
            except StoreError as exc:  # the store says so once; asked again at the next check
                log.debug("API keys' revocations not read: %s", exc)
                continue
            self._key_check(active)  # as the sessions' key check ends them

    async def _watch_offline(self) -> None:
        while True:
            await trio.sleep(min(max(self.settings.offline_after / 5, 0.02), 5.0))
            await self.check_offline()
