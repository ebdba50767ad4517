"""The supervisor: registration, the poll loop, push events, claims, the start of metrics and
tracing, signals and shutdown; each claimed Chat Job is a ``ClaimedJob`` (``gateway.runner.session``)
in a slot of its own."""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

import trio

from gateway import __version__
from gateway.config import Config, split_project
from gateway.observe import Counters, Histogram
from gateway.runner import tracing
from gateway.runner.alp import (
    AlpClient,
    CertificateRefused,
    Deadlines,
    EventsUnavailable,
    MalformedReply,
    OfferedJob,
    Refused,
    RegistrationRefused,
    ServerSilent,
    ServerUnavailable,
    SpeaksTls,
    TokenRefused,
    make_ssl_context,
)
from gateway.runner.backends import BackendPool
from gateway.runner.backendurl import missing_v1
from gateway.runner.backoff import backoff_delay, poll_delay
from gateway.runner.metrics import MetricsServer, open_metrics
from gateway.runner.poller import Poller
from gateway.runner.session import ChatJob, ClaimedJob, SessionKit
from gateway.runner.snapshot import BackendStatus, HistogramStatus, RunnerSnapshot
from gateway.runner.state import SavedRegistration, StateError, StateStore
from gateway.signals import watch_signals
from gateway.wire.protocol import CAPABILITY, FALLBACK_TIER

if TYPE_CHECKING:  # imported only when tracing is on
    from gateway.runner.otel import Tracing

log = logging.getLogger("gateway.runner")
UNREACHABLE_CAP = 1.5  # s: the longest wait between polls of a Server that cannot be reached
POLL_FAILED_EVERY = 60.0  # s: a Server that stays unreachable is said again this often at most

TRACES_SHUTDOWN_S = 5.0  # at exit, how long the last spans may take to leave
STOP_NOW_S = 1.0  # after a second signal, how long the turns in flight have to say they stopped
FAREWELL_S = 2.0  # at a clean stop, how long the last poll (chat-llm:v1 withdrawn) may take
BACKEND_URL_CHECK_S = 5.0  # at start, how long asking a backend whether its URL lacks /v1 may take


class RunnerExit(Exception):
    """The runner cannot go on; the message is one line for the user, ``code`` the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Runner:
    """Polls the Server, claims Kind B jobs, and serves each as a session in its own task."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ssl_context = make_ssl_context(config.ca_file)
        self.store = StateStore(config.state_dir)
        # a backend going down or coming back changes the capabilities: poll at once
        self.pool = BackendPool.from_config(
            config, ssl_context=self.ssl_context, on_change=lambda: self._wake.set()
        )
        self.poller: Poller | None = None  # opened by run: the streaming turns' backend reads
        self.registration: SavedRegistration | None = None
        self.alp: AlpClient | None = None
        self.sessions: dict[str, ClaimedJob] = {}  # the open sessions: one slot each
        self._reporting: dict[
            str, ClaimedJob
        ] = {}  # ended sessions whose final report is on its way
        self._lost_at_stop: dict[str, str] = {}  # job id -> why the Server has no final report
        self._stopping_now = False  # a second signal came
        self._polling: trio.CancelScope | None = None  # the poll request in flight: a stop ends it
        self.shutdown = trio.Event()
        self._wake = trio.Event()
        self.counters = Counters()
        self.histograms = {"ttft_seconds": Histogram(), "relay_seconds": Histogram()}
        self.last_poll_ok: float | None = None  # trio clock of the last successful poll
        self.last_poll_error: str | None = None
        self.first_poll = trio.Event()
        self._kit: SessionKit | None = None  # what the sessions share, made by run()
        self.metrics: MetricsServer | None = None  # bound in run() when --metrics-listen is given
        # tracing: decided once, here; the SDK is imported and started by run() only when on
        self.trace_endpoint = tracing.endpoint_from_env(os.environ, config.otlp_endpoint)
        self.tracing: Tracing | None = None
        self._sessions_nursery: trio.Nursery | None = None  # open while run() polls

    def status(self) -> RunnerSnapshot:
        """The read-only snapshot every reader (metrics, /healthz, doctor) takes of the runner."""
        age = None if self.last_poll_ok is None else trio.current_time() - self.last_poll_ok
        return RunnerSnapshot(
            max_sessions=self.config.max_sessions,
            poll_interval=self.config.poll_interval,
            ping_interval=self.config.ping_interval,
            sessions_open=len(self.sessions),
            shutting_down=self.shutdown.is_set(),
            last_poll_age=age,
            last_poll_error=self.last_poll_error,
            backends=tuple(BackendStatus.of(b) for b in self.pool.backends),
            counters=self.counters.values,
            histograms={k: HistogramStatus.of(h) for k, h in self.histograms.items()},
        )

    # -- registration --------------------------------------------------------------------

    async def _ensure_registration(self) -> SavedRegistration:
        """The saved registration for this Server and project (``StateStore.find``), else a new
        one made with the user credential. A runner token goes only to the Server that issued
        it: another ``--server`` registers anew there, and the first one's is kept."""
        config = self.config
        assert config.project
        store = self.store
        reg = store.find(config.server, config.project, server_given=config.server_explicit)
        if reg is None and config.server.startswith("http://"):  # found to speak https://
            reg = store.find("https://" + config.server[len("http://") :], config.project)
        if reg is not None:
            return reg
        if not config.user_token:
            raise RunnerExit(
                f"{store.missing(config.server, config.project)}: give a user credential "
                f"(--user-token or AGENTICS_USER_TOKEN) so that the runner registers with "
                f"{config.server}, or run `alp-gateway register --server {config.server}` with one",
                2,
            )
        return await self.register()

    async def register(
        self, *, wait_for_server: bool = True, server: str | None = None
    ) -> SavedRegistration:
        """Register with the user credential at ``server`` (the configured one by default) and
        save it.

        A Server that cannot be reached (a refused connection, a host name that does not
        resolve, a timeout, a 5xx) is waited for when ``wait_for_server`` (``run``: in compose
        or Kubernetes the Server, or the cluster's DNS, may come up after the runner; the pod's
        startup probe allows it minutes), with backoff up to 30 s and the reason logged when it
        changes and every 10th attempt. Without it (``alp-gateway register``, run by a person)
        the first such failure ends the command with that one reason. TLS that cannot work
        (a refused certificate, https:// to a plain-HTTP Server) and a refusal end both."""
        config = self.config
        assert config.project and config.user_token
        client = AlpClient(
            server or config.server,
            *split_project(config.project),
            ssl_context=self.ssl_context,
            ca_file=self.config.ca_file,
            connect_timeout=config.connect_timeout,
            deadlines=Deadlines.of(config.ping_interval, config.ping_timeout),
        )
        tls_tried = False
        try:
            failures = 0
            said = ""
            while True:
                try:
                    try:
                        reg = await client.register(
                            config.user_token, config.name, list(config.labels)
                        )
                        break
                    except SpeaksTls as plain:
                        if tls_tried:
                            raise
                        tls_tried = True  # a bare host:port of a TLS Server: https:// once
                        twin = await self._register_at(plain)
                        if twin is None:
                            raise
                        await client.aclose()
                        client, reg = twin
                        break
                except ServerUnavailable as exc:
                    if isinstance(exc, (CertificateRefused, MalformedReply)):
                        raise RunnerExit(str(exc), 2) from None  # waiting will not mend it
                    if not wait_for_server:
                        raise RunnerExit(f"registration: {exc}", 1) from None
                    failures += 1
                    self.counters.inc("registration_errors")
                    delay = backoff_delay(failures, 1.0, 30.0)
                    loud = str(exc) != said or failures % 10 == 0
                    log.log(
                        logging.WARNING if loud else logging.DEBUG,
                        "registration: %s; attempt %d, retrying in %.1f s",
                        exc,
                        failures,
                        delay,
                    )
                    said = str(exc)
                    with trio.move_on_after(delay):
                        await self.shutdown.wait()
                    if self.shutdown.is_set():
                        raise RunnerExit("stopped before the runner could register", 0) from None
        except (RegistrationRefused, Refused) as exc:
            raise RunnerExit(str(exc), 2) from None
        finally:
            await client.aclose()
        self.store.save(reg)
        log.info("registered as runner %s (%s) for %s on %s", reg.name, reg.id, reg.key, reg.server)
        return reg

    async def _register_at(self, plain: SpeaksTls) -> tuple[AlpClient, SavedRegistration] | None:
        """Registration at ``plain.https``, the Server's https:// twin, when its http:// failed
        as a TLS port fails (its 400, or a close without a word): the client and registration;
        None when https:// does not work either (the http:// failure stands); a certificate
        refused there ends it (the Server speaks TLS: what is wrong with it is said)."""
        config = self.config
        assert config.project and config.user_token
        log.warning("%s: trying %s", plain, plain.https)
        client = AlpClient(
            plain.https,
            *split_project(config.project),
            ssl_context=self.ssl_context,
            ca_file=config.ca_file,
            connect_timeout=config.connect_timeout,
            deadlines=Deadlines.of(config.ping_interval, config.ping_timeout),
        )
        try:
            reg = await client.register(config.user_token, config.name, list(config.labels))
        except CertificateRefused as exc:
            await client.aclose()
            if "does not speak TLS" in str(exc):
                return None
            raise RunnerExit(str(exc), 2) from None
        except ServerUnavailable:
            await client.aclose()
            return None
        except BaseException:
            await client.aclose()
            raise
        return client, reg

    # -- main ------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until shutdown (first SIGINT/SIGTERM) or a fatal error (RunnerExit)."""
        self.registration = await self._ensure_registration()
        reg = self.registration
        self.alp = AlpClient(
            reg.server,
            reg.owner,
            reg.project,
            ssl_context=self.ssl_context,
            ca_file=self.config.ca_file,
            connect_timeout=self.config.connect_timeout,
            deadlines=Deadlines.of(self.config.ping_interval, self.config.ping_timeout),
        )
        self.alp.token = reg.token
        log.info(
            "runner %s serving %s on %s, backend %s",
            reg.name,
            reg.key,
            reg.server,
            ", ".join(b.url for b in self.pool.backends) or "(none)",
        )
        fatal: RunnerExit | StateError | None = None
        if self.trace_endpoint is not None:
            from gateway.runner.otel import Tracing  # only when tracing is on: the SDK is heavy

            self.tracing = Tracing.start(self.trace_endpoint, service_version=__version__)
        try:
            if self.config.metrics_listen is not None:  # binds now: a busy port fails the start
                host, port = self.config.metrics_listen
                try:
                    self.metrics = await open_metrics(host, port, self.status)
                except OSError as exc:
                    raise RunnerExit(
                        f"--metrics-listen {host}:{port}: {exc.strerror or exc}", 2
                    ) from None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._events_loop)
                self.poller = Poller.open()
                if self.poller is not None:
                    nursery.start_soon(self.poller.run)
                await nursery.start(self.pool.run)  # models discovered, backends probed: then poll
                nursery.start_soon(self._say_missing_v1)
                if self.metrics is not None:
                    nursery.start_soon(self.metrics.serve)
                self._kit = SessionKit(
                    config=self.config,
                    alp=self.alp,
                    pool=self.pool,
                    shutdown=self.shutdown,
                    grace=self.config.grace,
                    counters=self.counters,
                    ttft=self.histograms["ttft_seconds"],
                    relay=self.histograms["relay_seconds"],
                    ssl_context=self.ssl_context,
                    poller=self.poller,
                    tracing=self.tracing,
                )
                async with trio.open_nursery() as sessions:
                    self._sessions_nursery = sessions
                    try:
                        await self._poll_loop()
                    except (RunnerExit, StateError) as exc:
                        fatal = exc  # raised below, outside the nurseries, unwrapped
                        sessions.cancel_scope.cancel()
                    # shutting down: the sessions drain themselves; events are no longer needed
                if fatal is None:
                    await self._farewell()
                nursery.cancel_scope.cancel()
        finally:
            self._say_lost_reports()
            with trio.CancelScope(shield=True):
                await self.alp.aclose()
                await self.pool.aclose()
                await self._stop_tracing()
        if fatal is not None:
            raise fatal
        log.info("runner stopped")

    async def _farewell(self) -> None:
        """At a clean stop, its sessions drained: one last poll without chat-llm:v1 (the
        capability withdrawn, docs/protocol.md §2), so that the Server stops counting on this
        runner now rather than after ``offline_after``. Bounded; a failure is only said."""
        assert self.alp is not None
        with trio.move_on_after(FAREWELL_S):
            try:
                await self.alp.poll([], stopping=True)
            except (ServerUnavailable, Refused, TokenRefused) as exc:
                log.debug("the last poll (capability withdrawn) failed: %s", exc)

    async def _say_missing_v1(self) -> None:
        """A backend that lists no model because its URL lacks ``/v1``: said once, at start, in
        one WARNING line with doctor's words (``gateway.runner.backendurl``)."""
        for backend in self.pool.backends:
            if not backend.models:
                wrong = None
                with trio.move_on_after(BACKEND_URL_CHECK_S):
                    wrong = await missing_v1(backend)
                if wrong is not None:  # our own words: whole (a value is capped at 200)
                    log.warning("backend %s: " + wrong.line.replace("%", "%%"), backend.name)

    def _say_lost_reports(self) -> None:
        """One line for every final report the stop left unsent (the Server was unreachable):
        the Server ends those jobs itself once it counts the runner offline, without knowing
        how each ended (docs/protocol.md §3)."""
        lost = self._lost_at_stop
        if not lost:
            return
        shown = ", ".join(list(lost)[:5]) + (", …" if len(lost) > 5 else "")
        log.warning(
            "stopped without the final report of %d job(s) (%s): the Server at %s was "
            "unreachable (%s); it ends them itself once it counts this runner offline, without "
            "their outcome",
            len(lost),
            shown,
            self.alp.server if self.alp is not None else self.config.server,
            next(iter(lost.values())),
        )

    async def _stop_tracing(self) -> None:
        """Flush the last spans and stop the exporter, in a thread (it blocks), bounded: a
        collector that does not answer costs at most ``TRACES_SHUTDOWN_S`` at exit."""
        if self.tracing is None:
            return
        with trio.move_on_after(TRACES_SHUTDOWN_S):
            await trio.to_thread.run_sync(self.tracing.shutdown, abandon_on_cancel=True)

    async def watch_signals(
        self,
        done: trio.CancelScope,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """First SIGINT/SIGTERM: graceful shutdown. Second: stop at once (``gateway.signals``)."""

        def first(signum: int) -> None:
            log.info(
                "%s: shutting down (in-flight turns get up to %.0f s; signal again to stop now)",
                signal.Signals(signum).name,
                self.config.grace,
            )
            self.begin_shutdown()

        def again(signum: int) -> None:
            log.warning("second signal: stopping now")
            self.stop_now()
            # the turns in flight say that the runner stopped, then everything is cancelled
            done.deadline = min(done.deadline, trio.current_time() + STOP_NOW_S)

        await watch_signals(first, again, task_status=task_status)

    @property
    def stopped_now(self) -> bool:
        """Whether a second signal came (the command's exit status is 130 then)."""
        return self._stopping_now

    def stop_now(self) -> None:
        """The second signal: each turn in flight ends with an error frame saying the runner
        stopped (and its channel with ``chat.end``), final reports still being retried are
        given up at once (and a session ending from now on has at most 2 s for its report)."""
        self._stopping_now = True
        for session in [*self.sessions.values(), *self._reporting.values()]:
            session.stop_now()

    def begin_shutdown(self) -> None:
        self.shutdown.set()
        self._wake.set()
        if self._polling is not None:
            self._polling.cancel()
        for session in [*self.sessions.values(), *self._reporting.values()]:
            session.stopping()

    def capabilities(self) -> list[str]:
        """What can be served right now (recomputed on every poll); a runner of the fallback
        tier says so in every poll (docs/protocol.md §6)."""
        tier = [FALLBACK_TIER] if self.config.tier == "fallback" else []
        if not self.pool.any_up or len(self.sessions) >= self.config.max_sessions:
            return tier  # no backend up (or none configured), or no free session slot
        return [CAPABILITY, *tier]

    async def _poll_loop(self) -> None:
        assert self.alp is not None
        interval = self.config.poll_interval
        failures = 0
        said_at = -POLL_FAILED_EVERY  # when a failed poll was last said (at WARNING)
        while not self.shutdown.is_set():
            self._wake = trio.Event()
            delay = interval
            try:
                with trio.CancelScope() as self._polling:  # a Server gone quiet: not waited for
                    jobs = await self.alp.poll(self.capabilities())
                if self._polling.cancelled_caught:
                    break  # stopping: nothing was claimed
                if failures:
                    log.info("poll works again after %d failure(s)", failures)
                failures = 0
                self.last_poll_ok, self.last_poll_error = trio.current_time(), None
                delay = poll_delay(interval)  # the fleet's timers kept apart
                await self._consider(jobs)
            except ServerUnavailable as exc:
                failures += 1
                # a Server down or unreachable: tried again within UNREACHABLE_CAP, so that a
                # Server back from a restart has its runners polling at once (a refused
                # connection costs it nothing)
                delay = backoff_delay(failures, min(interval, 0.25), UNREACHABLE_CAP)
                if isinstance(exc, ServerSilent) and failures == 1:
                    delay = 0.0  # a dead kept-alive connection, dropped: at once, on a new one
                now = trio.current_time()
                if failures == 1:
                    said_at = now
                    log.warning("poll failed: %s; next try in %.1f s", exc, delay)
                elif now - said_at >= POLL_FAILED_EVERY:  # not a line per poll for a night
                    said_at = now
                    log.warning(
                        "poll failed %d times in a row, the last: %s; trying again every %.1f s "
                        "at most (said once a minute)",
                        failures,
                        exc,
                        UNREACHABLE_CAP,
                    )
                else:
                    log.debug("poll failed: %s; next try in %.1f s", exc, delay)
                self.counters.inc("poll_errors")
                self.last_poll_error = str(exc)
            except TokenRefused as exc:
                await self._token_refused(str(exc))
                continue
            except Refused as exc:
                failures += 1
                delay = backoff_delay(failures, interval, interval * 6)
                log.warning("%s; next try in %.1f s", exc, delay)
            finally:
                self.counters.inc("polls")
                self.first_poll.set()
            if self.shutdown.is_set():
                break
            with trio.move_on_after(delay):
                await self._wake.wait()

    async def _token_refused(self, message: str) -> None:
        if not self.config.user_token:
            raise RunnerExit(
                f"{message}: the runner registration is no longer valid; run `alp-gateway register` "
                "again or give a user credential (AGENTICS_USER_TOKEN) so the runner re-registers",
                3,
            )
        log.warning("%s: registering again with the user credential", message)
        assert self.alp is not None
        # at the Server the runner polls: the saved registration's, which may not be the default
        self.registration = await self.register(server=self.alp.server)
        assert self.alp is not None
        self.alp.token = self.registration.token

    async def _consider(self, jobs: list[OfferedJob]) -> None:
        assert self.alp is not None and self.registration is not None
        for job in jobs:
            if self.shutdown.is_set() or len(self.sessions) >= self.config.max_sessions:
                return
            if not job.is_chat_job:
                continue  # not ours: left queued for a capable runner
            if job.id in self.sessions or job.id in self._reporting:
                continue
            try:
                run_id = await self._claim(job.id)
            except ServerUnavailable as exc:
                log.warning("claim of job %s failed: %s", job.id, exc)
                continue
            if run_id is None:
                log.debug("job %s was taken by another runner", job.id)
                continue
            assert self._kit is not None  # made by run() before the first poll
            session = ClaimedJob(ChatJob.of(job, run_id), self._kit)
            if self._stopping_now:
                session.stop_now()
            self.sessions[job.id] = session
            assert self._sessions_nursery is not None  # _consider runs inside run()'s nursery
            self._sessions_nursery.start_soon(self._run_session, session)

    async def _run_session(self, session: ClaimedJob) -> None:
        """One session in its slot; the slot is freed when its channel is done, before the
        final report (a report to a Server that is gone may take its bounded retries)."""
        job_id = session.job.id

        def free_slot() -> None:
            self._reporting[job_id] = self.sessions.pop(job_id)
            self._wake.set()  # a slot is free: poll now

        try:
            await session.run(self.registration.name if self.registration else "", free_slot)
        finally:
            self.sessions.pop(job_id, None)  # when it failed before it could free it
            self._reporting.pop(job_id, None)
            if session.report_lost is not None and self.shutdown.is_set():
                self._lost_at_stop[job_id] = session.report_lost

    async def _claim(self, job_id: str) -> str | None:
        """Claim a job; when the answer is lost on the way, ask once more at once: the claim may
        have landed, and a Server that stops offering a claimed job would otherwise lose it."""
        assert self.alp is not None and self.registration is not None
        try:
            return await self.alp.claim(job_id, self.registration.name)
        except ServerUnavailable as exc:
            log.info("claim of job %s: %s; asking once more", job_id, exc)
            return await self.alp.claim(job_id, self.registration.name)

    async def _events_loop(self) -> None:
        """Subscribe to ``runners/events`` and poll at once on ``job_available``."""
        assert self.alp is not None
        failures = 0
        while True:
            try:
                async with self.alp.events() as job_ids:
                    async for _job_id in job_ids:
                        failures = 0
                        self._wake.set()
                log.debug("events stream ended; resubscribing")
            except EventsUnavailable:
                log.info(
                    "the Server offers no push events; short-polling every %.0f s",
                    self.config.poll_interval,
                )
                await trio.sleep(600)
                continue
            except ServerUnavailable as exc:
                failures += 1
                log.debug("events subscription: %s", exc)
                self._wake.set()  # a job_available may have been lost: poll now
                await trio.sleep(backoff_delay(failures, 0.25, UNREACHABLE_CAP))
                continue
            except TokenRefused as exc:
                failures += 1
                log.debug("events subscription: %s", exc)
                self._wake.set()
            await trio.sleep(backoff_delay(failures + 1, 1.0, self.config.poll_interval * 6))
