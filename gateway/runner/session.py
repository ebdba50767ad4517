"""One Chat Job's life after its claim: ``in_progress``, heartbeats, its channel (redialled
within the reconnect window), and the one final report (docs/protocol.md §3, §4).

The supervisor (``gateway.runner.supervisor``) claims a job and hands it over as a ``ChatJob``
with the ``SessionKit`` every session of the runner shares; ``Session.run`` returns once the
report is in (or given up). The session frees its slot before the report: a Server that is gone
may take the report's bounded retries, and the slot is not held for them.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import trio

from gateway.config import Config
from gateway.observe import Redactor
from gateway.runner.alp import AlpClient, OfferedJob, Refused, ServerUnavailable, describe_error
from gateway.runner.backoff import backoff_delay
from gateway.runner.channel import Channel, ChannelEnd, ChannelKit
from gateway.runner.turn import Ending, TurnEnd
from gateway.runner.turns import SessionLimits, Turns
from gateway.wire.traceparent import valid_traceparent
from gateway.wire.wsclient import HandshakeError, WebSocket
from gateway.wire.wsclient import connect as dial_channel

if TYPE_CHECKING:  # imported only when tracing is on
    from gateway.runner.otel import SessionTrace, Tracing

log = logging.getLogger("gateway.runner")
REDIAL_CAP = 1.0  # s: the longest wait between two redials of a dropped channel

PROGRESS_STAGE = "chat_llm_active"
REPORT_ATTEMPTS = 8
STOPPED_AT_ONCE_REPORT_S = 2.0  # after a second signal, how long a final report may take
REPORT_GRACE_AT_STOP_S = 1.0  # once the runner stops, how long a final report may still be retried
RUNNER_STOPPED = "the runner was stopped at once (a second signal): this answer ends here"
_STOPPED_END = TurnEnd(Ending.SHUTDOWN, RUNNER_STOPPED)


@dataclass
class ChatJob:
    """A claimed Kind B job: what its ``agentDefinition`` says that the runner uses."""

    id: str
    run_id: str
    channel_url: str | None = None
    traceparent: str | None = None  # the trace it belongs to (W3C), when the Server gave one
    idle_timeout: float | None = None  # s without a turn before the runner ends it
    max_timeout: float | None = None  # s in all before the runner ends it
    trace: SessionTrace | None = field(default=None, repr=False)  # its span, tracing on

    @classmethod
    def of(cls, job: OfferedJob, run_id: str) -> ChatJob:
        definition = job.definition
        return cls(
            job.id,
            run_id,
            job.channel_url,
            traceparent=valid_traceparent(definition.traceparent),
            idle_timeout=_minutes(job.id, "idleTimeoutMinutes", definition.idleTimeoutMinutes),
            max_timeout=_minutes(job.id, "maxTimeoutMinutes", definition.maxTimeoutMinutes),
        )

    def limits(self) -> SessionLimits | None:
        """The session's clock, started now, when the job has a time limit."""
        if self.idle_timeout is None and self.max_timeout is None:
            return None
        now = trio.current_time()
        return SessionLimits(self.idle_timeout, self.max_timeout, started=now, last_active=now)


def _minutes(job_id: str, name: str, value: Any) -> float | None:
    """``value`` (minutes, a positive number) in seconds; None when absent or not valid, the
    latter said in one log line (the job is served without that limit, docs/protocol.md §2)."""
    if value is None:
        return None
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        return float(value) * 60.0
    log.warning(
        "job %s: %s is %.40r, not a positive number of minutes; no such limit",
        job_id,
        name,
        value,
    )
    return None


def _linger(config: Config) -> float:
    """How long an ended turn's frames are kept while its channel is up: the time a dead path
    takes to be found (a ping, then its timeout), or the resume window with pings off."""
    if config.ping_interval > 0:
        return config.ping_interval + (config.ping_timeout or config.ping_interval)
    return config.resume_window


def channel_url(server: str, job: ChatJob, token: str) -> str:
    """``ws(s)://{authority}/api/lives/chat/channel/ws?jobId=…&token=…`` (or the job's own URL)."""
    if job.channel_url:
        parts = urlsplit(job.channel_url)
        query = parts.query
        extra = {k: v for k, v in (("jobId", job.id), ("token", token)) if f"{k}=" not in query}
        if extra:
            query = f"{query}&{urlencode(extra)}" if query else urlencode(extra)
        return urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
    parts = urlsplit(server)
    scheme = "wss" if parts.scheme == "https" else "ws"
    query = urlencode({"jobId": job.id, "token": token})
    return f"{scheme}://{parts.netloc}/api/lives/chat/channel/ws?{query}"


@dataclass(frozen=True, kw_only=True)
class SessionKit(ChannelKit):
    """What every session of one runner shares: its channels' kit (the shutdown event, set by
    the first signal: turns get the grace, no redial after a drop), and the rest. ``alp``
    holds the Server's URL and the current runner token (a re-registration replaces it there):
    each dial reads both afresh."""

    config: Config
    alp: AlpClient
    ssl_context: ssl.SSLContext
    tracing: Tracing | None = None


class ClaimedJob:
    """One Chat Job from its claim to its one final report."""

    def __init__(self, job: ChatJob, kit: SessionKit) -> None:
        self.job = job
        self.kit = kit
        self._stopping_now = False
        self._report_scope: trio.CancelScope | None = None
        # why the Server has no final report of this job, unreachable (None: it has one, none was
        # due yet, or it refused it: that is logged at once)
        self.report_lost: str | None = None
        self._report_error: str | None = "no answer in time"
        self._redial: trio.CancelScope | None = None  # a redial in progress: a stop ends it
        self._channel: Channel | None = None  # the channel connection being served
        self.turns: Turns | None = None  # the job's turns, while its channel is served

    def stopping(self) -> None:
        """The runner's stop began: a final report being retried gets at most
        ``REPORT_GRACE_AT_STOP_S`` more (one not begun yet gets as much when it begins). A
        Server that is gone would otherwise hold the stop for the report's every retry (and
        for a redial in progress: it is given up)."""
        if self._redial is not None:
            self._redial.cancel()
        scope = self._report_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + REPORT_GRACE_AT_STOP_S)

    def stop_now(self) -> None:
        """The second signal: each turn in flight is stopped with an error frame that says so
        (``RUNNER_STOPPED``; the supervisor gives the frames a moment before it cancels
        everything); a final report still being retried is given up at once, and one not begun
        yet gets at most ``STOPPED_AT_ONCE_REPORT_S``."""
        self._stopping_now = True
        if self.turns is not None:
            self.turns.stop_all(_STOPPED_END)
        if self._report_scope is not None:
            self._report_scope.cancel()

    async def run(self, runner_name: str, free_slot: Callable[[], None]) -> None:
        """Serve the job, call ``free_slot`` once the channel is done, then report."""
        job, kit = self.job, self.kit
        log.info("session start job=%s run=%s", job.id, job.run_id)
        kit.counters.inc("sessions_started")
        conclusion, reason = "failure", "session ended unexpectedly"
        budget: float | None = None  # how long the final report may be retried
        if kit.tracing is not None:
            job.trace = kit.tracing.session(job.id, job.run_id, job.traceparent, runner_name)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._mark_in_progress)  # the dial does not wait for it
                nursery.start_soon(self._heartbeat)
                conclusion, reason = await self._serve_channel(job.limits())
                nursery.cancel_scope.cancel()
        except BaseException:  # cancelled (a second signal) or crashed: report, but do not linger
            reason, budget = "runner stopped at once", STOPPED_AT_ONCE_REPORT_S
            raise
        finally:
            free_slot()
            # shielded from the session's own cancellation, but not from a second signal:
            # stop_now() cancels the scope (a Server that is gone would hold the exit ~15 s)
            report = self._report_scope = trio.CancelScope(shield=True)
            if self._stopping_now:
                budget = min(budget or STOPPED_AT_ONCE_REPORT_S, STOPPED_AT_ONCE_REPORT_S)
            elif kit.shutdown.is_set():
                budget = min(budget or REPORT_GRACE_AT_STOP_S, REPORT_GRACE_AT_STOP_S)
            recorded = False
            try:
                with report, trio.move_on_after(budget or math.inf):
                    recorded = await self._report(conclusion, reason)
            finally:
                self._report_scope = None
            if not recorded:  # the supervisor says it, once for every such job of the stop
                self.report_lost = self._report_error
            # the Server recorded it (reports_success, reports_failure), or it never will
            kit.counters.inc(f"reports_{conclusion}" if recorded else "reports_lost")
            if job.trace is not None:
                job.trace.end(conclusion, reason)
            kit.counters.inc("sessions_ended")
            log.info("session end job=%s conclusion=%s reason=%s", job.id, conclusion, reason)

    async def _mark_in_progress(self) -> None:
        job = self.job
        try:
            await self.kit.alp.set_status(job.run_id, job.id, {"status": "in_progress"})
        except (ServerUnavailable, Refused) as exc:
            log.warning("job %s: in_progress not recorded: %s", job.id, exc)

    async def _heartbeat(self) -> None:
        """A progress heartbeat every ``heartbeat_interval``, but while the channel served is
        one whose Server said in its hello that the channel is the job's sign of life
        (docs/protocol.md §6, ``liveness``): one liveness signal per session, not two."""
        job, kit = self.job, self.kit
        while True:
            await trio.sleep(kit.config.heartbeat_interval)
            channel = self._channel
            if channel is not None and channel.liveness:
                kit.counters.inc("heartbeats_spared")
                continue
            try:
                await kit.alp.progress(job.run_id, job.id, PROGRESS_STAGE)
                kit.counters.inc("heartbeats")
            except (ServerUnavailable, Refused) as exc:
                log.warning("job %s: heartbeat failed: %s", job.id, exc)

    async def _serve_channel(self, limits: SessionLimits | None) -> tuple[str, str]:
        """Dial, serve, redial on drops within the reconnect window; the (conclusion, reason).
        The job's turns live here, across redials (a resume carries them over, §6)."""
        config = self.kit.config
        async with trio.open_nursery() as nursery:
            self.turns = Turns(
                self.job.id,
                self.kit,
                nursery,
                trace=self.job.trace,
                limits=limits,
                resume_buffer=config.resume_buffer,
                resume_window=config.resume_window,
                linger=_linger(config),
            )
            try:
                return await self._dial_loop()
            finally:
                nursery.cancel_scope.cancel()

    async def _dial_loop(self) -> tuple[str, str]:
        job, kit, config = self.job, self.kit, self.kit.config
        window = config.reconnect_window
        dropped_at: float | None = None
        last_problem = ""
        failures = 0
        while True:
            if kit.shutdown.is_set() and dropped_at is not None:
                return "failure", f"runner shut down while the channel was down ({last_problem})"
            url = channel_url(kit.alp.server, job, kit.alp.token or "")
            end: ChannelEnd | None = None
            # one deadline on the whole dial: connect, TLS and the upgrade
            dial = trio.CancelScope(deadline=trio.current_time() + config.connect_timeout)
            if dropped_at is not None and not kit.shutdown.is_set():
                self._redial = dial
            try:
                ws: WebSocket | None = None
                with dial:
                    ws = await dial_channel(
                        url,
                        ssl_context=kit.ssl_context if url.startswith("wss:") else None,
                        max_message_size=config.max_frame_size,
                        ping_interval=config.ping_interval,
                        ping_timeout=config.ping_timeout,
                        on_ping=self._on_ping,
                    )
                if ws is not None:
                    try:
                        end = await self._serve_connected(ws, dropped_at is not None)
                    finally:
                        await ws.aclose()
                    failures = 0
                    dropped_at = None
            except HandshakeError as exc:
                status = exc.status_code
                if status is not None and 400 <= status < 500:
                    return "failure", f"the Server refused the chat channel ({status})"
                last_problem = f"channel handshake failed: {exc}"
            except OSError as exc:
                last_problem = f"channel unreachable: {describe_error(exc, url)}"
            self._redial = None
            if dial.cancelled_caught and end is None and not kit.shutdown.is_set():
                last_problem = f"channel handshake took over {config.connect_timeout:.0f} s"
            if end is not None:
                if end.by != "drop":
                    return "success", end.reason
                last_problem = end.reason
                log.warning("job %s: %s; redialling", job.id, end.reason)
            now = trio.current_time()
            if dropped_at is None:
                dropped_at = now
            if now - dropped_at >= window:
                return (
                    "failure",
                    f"gave up redialling the chat channel after {window:.0f} s: {last_problem}",
                )
            failures += 1
            # at most REDIAL_CAP between tries: a Server back from a restart has its channels
            # again within that (docs/protocol.md §6), and a refused connection costs nothing
            delay = min(backoff_delay(failures, 0.25, REDIAL_CAP), window - (now - dropped_at))
            with trio.move_on_after(delay):
                await kit.shutdown.wait()

    def _on_ping(self, what: str) -> None:
        counters = self.kit.counters
        if what == "sent":
            counters.inc("pings_sent")
        else:  # no pong, nor any other frame, in time: the channel is dead
            counters.inc("pong_timeouts")
            counters.inc("channels_dead")

    def _frame_log(self) -> Redactor | None:
        """With ``verbose_frames``: every secret the runner holds masked (read per connection:
        the runner token may have been replaced)."""
        config = self.kit.config
        if not config.verbose_frames:
            return None
        keys = [spec.key for spec in config.backends]
        return Redactor([*keys, config.backend_key, config.user_token, self.kit.alp.token])

    async def _serve_connected(self, ws: WebSocket, redial: bool) -> ChannelEnd:
        """Serve one open channel connection until it ends."""
        job, kit, turns = self.job, self.kit, self.turns
        if redial:
            log.info("job %s: channel redialled", job.id)
            kit.counters.inc("reconnects")
        assert turns is not None
        channel = self._channel = Channel(
            job.id,
            ws,
            kit,
            frame_log=self._frame_log(),
            trace=job.trace,
            limits=turns.limits,
            turns=turns,
        )
        if self._stopping_now:
            turns.stop_all(_STOPPED_END)
        try:
            return await channel.serve()
        finally:
            self._channel = None

    async def _report(self, conclusion: str, reason: str) -> bool:
        """The one final report; retried (bounded) while the Server is unavailable. Whether
        the Server recorded it."""
        job, kit = self.job, self.kit
        for attempt in range(1, REPORT_ATTEMPTS + 1):
            try:
                await kit.alp.report(job.run_id, job.id, conclusion, reason[:1000])
                return True
            except ServerUnavailable as exc:
                self._report_error = str(exc).partition(": ")[2] or str(exc)  # without the URL
                if attempt == REPORT_ATTEMPTS:
                    log.error(
                        "job %s: final report lost after %d attempts: %s", job.id, attempt, exc
                    )
                    return False
                await trio.sleep(backoff_delay(attempt, 0.5, 10.0))
            except Refused as exc:
                if exc.status == 409 and attempt > 1:  # an earlier attempt landed, its answer lost
                    log.info("job %s: final report was already recorded", job.id)
                    return True
                log.error("job %s: final report refused: %s", job.id, exc)
                self._report_error = None
                return False
        return False  # not reached: the last attempt returns
