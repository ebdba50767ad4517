"""One Chat Channel connection: a reader, and one task per in-flight turn (its answer relayed
read by read by ``relay.Relay``, in the runner's ``Poller`` while other turns stream too)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import trio

from gateway.observe import Counters, Histogram, Redactor
from gateway.runner.backends import Backend, BackendError, BackendPool, BackendUnreachable
from gateway.runner.poller import Poller
from gateway.runner.relay import Outlet, Relay
from gateway.runner.turn import Ending, Turn, TurnEnd
from gateway.wire import http1, protocol
from gateway.wire.stream import BadPayload
from gateway.wire.wsclient import ChannelClosed, WebSocket

if TYPE_CHECKING:  # imported only when tracing is on (Runner.run: gateway.ops.otel.Tracing.start)
    from gateway.ops.otel import SessionTrace

log = logging.getLogger("gateway.channel")

SHUTTING_DOWN = "runner shutting down"
_ERROR_BODY_LIMIT = 512


class TurnFailed(Exception):
    """The turn cannot be served; the message is safe for a frame (no key)."""


_DONE_END = TurnEnd(Ending.DONE)
_CANCELLED_END = TurnEnd(Ending.CANCELLED, protocol.CANCELLED)
_SESSION_END = TurnEnd(Ending.SESSION_ENDED, "session ended")
_SHUTDOWN_END = TurnEnd(Ending.SHUTDOWN, SHUTTING_DOWN)


_TRACED_ERRORS = (Ending.FAILED, Ending.SHUTDOWN)  # a turn span's error status: not the client's


@dataclass
class SessionLimits:
    """A Chat Job's time limits (``agentDefinition``, in seconds; None: none) and the clock they
    run on, kept by the runner across the job's redials."""

    idle: float | None
    total: float | None
    started: float  # trio clock: when the session started
    last_active: float  # trio clock: when the last turn ended (or the session started)

    def idle_reason(self) -> str:
        assert self.idle is not None
        return f"session idle for {self.idle / 60:g} min (idleTimeoutMinutes)"

    def total_reason(self) -> str:
        assert self.total is not None
        return f"session reached its time limit of {self.total / 60:g} min (maxTimeoutMinutes)"


@dataclass(frozen=True, kw_only=True)
class ChannelKit:
    """What every Chat Channel of one runner shares: the backends, the shutdown event and the
    grace turns get after it, the counters and histograms, and the poller (None: each streaming
    turn reads its own socket)."""

    pool: BackendPool
    shutdown: trio.Event
    grace: float = 30.0
    counters: Counters = field(default_factory=Counters)
    ttft: Histogram = field(default_factory=Histogram)
    relay: Histogram = field(default_factory=Histogram)
    poller: Poller | None = None


@dataclass
class ChannelEnd:
    """How a channel connection ended: by the Server (chat.end), the runner (shutdown) or a drop."""

    by: Literal["server", "runner", "drop"]
    reason: str


class Channel:
    """Serves one open Chat Channel WebSocket of one Chat Job until it ends or drops.

    Turns run concurrently, each in its own task; each backend read's frames are written at
    once when no write is in progress, else together with the others in the next write
    (``WebSocket.offer``), before the next turn's socket is read. A slow Server makes the turns
    wait for room, so the backend reads slow down too and memory stays bounded.
    """

    def __init__(
        self,
        job_id: str,
        ws: WebSocket,
        kit: ChannelKit,
        *,
        frame_log: Redactor | None = None,
        trace: SessionTrace | None = None,
        limits: SessionLimits | None = None,
    ) -> None:
        self.job_id = job_id
        self.ws = ws
        self.pool = kit.pool
        self.shutdown = kit.shutdown
        self.grace = kit.grace
        self._turns: dict[str, Turn] = {}
        self._no_turns = trio.Event()
        self._no_turns.set()
        self._draining = False
        self._drain_reason = SHUTTING_DOWN
        self._end: ChannelEnd | None = None
        self._nursery: trio.Nursery | None = None
        self.counters = kit.counters
        self.frame_log = frame_log  # --verbose-frames: every frame, cut and redacted
        out: Outlet = ws if frame_log is None else _LoggedOutlet(ws, job_id, frame_log)
        self._send = out.send
        # the turns' answers to frames; the poller reads the backend sockets of streaming
        # turns (None: each turn its own)
        self.relay = Relay(out, kit.poller, kit.ttft, kit.relay)
        self.trace = trace  # tracing on: the session's span; off: None, and turns do no tracing
        self.limits = limits
        self._turn_began: trio.Event | None = None  # set when a turn starts (idle limit only)

    @property
    def in_flight(self) -> int:
        return len(self._turns)

    async def serve(self) -> ChannelEnd:
        """Serve frames until ``chat.end``, runner shutdown, or the connection drops."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.ws.run)
            nursery.start_soon(self._watch_shutdown)
            limits = self.limits
            if limits is not None and limits.total is not None:
                nursery.start_soon(self._watch_total, limits)
            if limits is not None and limits.idle is not None:
                nursery.start_soon(self._watch_idle, limits)
            await self._reader()
            nursery.cancel_scope.cancel()
        assert self._end is not None
        return self._end

    def _finish(self, end: ChannelEnd) -> None:
        if self._end is None:
            self._end = end
        for request_id in list(self._turns):
            self._cancel_turn(request_id, _SESSION_END)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- the socket --------------------------------------------------------------------

    async def _reader(self) -> None:
        while self._end is None:
            try:
                message = await self.ws.receive()
            except ChannelClosed as exc:
                self._finish(ChannelEnd("drop", f"channel closed ({exc})"))
                return
            if self.frame_log is not None:
                log.info("job %s ← %s", self.job_id, self.frame_log(message))
            self._handle(message)

    def _handle(self, message: str | bytes) -> None:
        if isinstance(message, bytes):
            log.warning("job %s: ignored a binary frame (%d bytes)", self.job_id, len(message))
            return
        try:
            frame = protocol.decode_frame(message)
        except protocol.FrameError as exc:
            log.warning("job %s: ignored a bad frame: %s", self.job_id, exc)
            if exc.request_id is not None:
                self._post(protocol.error_frame(self.job_id, exc.request_id, f"bad frame: {exc}"))
            return
        if isinstance(frame, protocol.Unknown):
            log.debug("job %s: ignored a frame of unknown type %r", self.job_id, frame.type)
            return
        if frame.jobId is not None and frame.jobId != self.job_id:
            log.warning("job %s: ignored a frame for job %s", self.job_id, frame.jobId)
            request_id = getattr(frame, "requestId", None)
            if request_id is not None:
                self._post(
                    protocol.error_frame(
                        self.job_id,
                        request_id,
                        f"frame for job {frame.jobId} on this job's channel",
                    )
                )
            return
        assert self._nursery is not None
        if isinstance(frame, protocol.CompletionRequest):
            self._start_turn(frame)
        elif isinstance(frame, protocol.CompletionCancel):
            self._cancel_turn(frame.requestId, _CANCELLED_END)
        elif isinstance(frame, protocol.ModelsRequest):
            self._nursery.start_soon(self._answer_models, frame.requestId)
        elif isinstance(frame, protocol.End):
            reason = frame.reason or "ended by the Server"
            log.info("job %s: chat.end from the Server (%s)", self.job_id, reason)
            self._finish(ChannelEnd("server", reason))

    def _post(self, frame: str) -> None:
        """Send a frame from the reader, which never waits: in a task of its own."""
        assert self._nursery is not None
        self._nursery.start_soon(self._send_or_drop, frame)

    async def _send_or_drop(self, frame: bytes | str) -> None:
        try:
            await self._send(frame)
        except ChannelClosed:
            pass  # the channel is ending; there is no one to tell

    # -- shutdown ----------------------------------------------------------------------

    async def _watch_shutdown(self) -> None:
        await self.shutdown.wait()
        await self._wind_down(SHUTTING_DOWN)

    async def _watch_total(self, limits: SessionLimits) -> None:
        """``maxTimeoutMinutes``: at the session's time limit, wind it down."""
        assert limits.total is not None
        await trio.sleep_until(limits.started + limits.total)
        await self._wind_down(limits.total_reason())

    async def _watch_idle(self, limits: SessionLimits) -> None:
        """``idleTimeoutMinutes``: once no turn has been in flight for that long, end it."""
        assert limits.idle is not None
        while True:
            while self._turns:
                await self._no_turns.wait()
            self._turn_began = began = trio.Event()
            with trio.move_on_at(limits.last_active + limits.idle) as waited:
                await began.wait()
            if waited.cancelled_caught and not self._turns:
                break
        await self._wind_down(limits.idle_reason())

    async def _wind_down(self, reason: str) -> None:
        """No new turn; in-flight ones get the grace, then are cancelled; then ``chat.end``
        with ``reason`` and the channel ends (by the runner). Once: the first reason wins."""
        if self._draining:
            return
        self._draining = True
        self._drain_reason = reason
        with trio.move_on_after(self.grace):
            await self._no_turns.wait()
        end = _SHUTDOWN_END if reason == SHUTTING_DOWN else TurnEnd(Ending.SHUTDOWN, reason)
        for request_id in list(self._turns):
            self._cancel_turn(request_id, end)
        await self._no_turns.wait()
        await self._send_or_drop(protocol.end_frame(self.job_id, reason))
        with trio.move_on_after(5):  # what is written so far reaches the socket, chat.end last
            await self.ws.drain()
        self._finish(ChannelEnd("runner", reason))

    # -- turns -------------------------------------------------------------------------

    def _start_turn(self, frame: protocol.CompletionRequest) -> None:
        request_id = frame.requestId
        if self._draining:
            self._post(protocol.error_frame(self.job_id, request_id, self._drain_reason))
            return
        if request_id in self._turns:
            log.warning("job %s request %s: duplicate requestId refused", self.job_id, request_id)
            self._post(
                protocol.error_frame(
                    self.job_id, request_id, "duplicate requestId: a turn with this id is in flight"
                )
            )
            return
        frames = protocol.TurnFrames(self.job_id, request_id)
        turn = self._turns[request_id] = Turn(request_id, frames, trio.current_time())
        if self._no_turns.is_set():  # one event per busy spell: its waiters see it end
            self._no_turns = trio.Event()
        if self._turn_began is not None:
            self._turn_began.set()
        assert self._nursery is not None
        self._nursery.start_soon(self._turn, frame, turn)

    def _cancel_turn(self, request_id: str, end: TurnEnd) -> None:
        turn = self._turns.get(request_id)
        if turn is not None:
            turn.stop(end)

    async def _turn(self, frame: protocol.CompletionRequest, turn: Turn) -> None:
        request_id = frame.requestId
        if self.trace is not None:
            turn.span = self.trace.turn(request_id, frame.model, traceparent=frame.traceparent)
        try:
            end = _DONE_END
            try:
                with turn.scope:
                    try:
                        await self._forward(frame, turn)
                    except TurnFailed as exc:
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except protocol.FrameError as exc:  # a body that cannot take its model
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except ChannelClosed:
                        end = _SESSION_END
            except trio.Cancelled:  # the channel itself is ending: no one left to tell
                self._conclude_quietly(turn, turn.stopped or _SESSION_END)
                raise
            if turn.scope.cancelled_caught:
                end = turn.stopped or _CANCELLED_END
            await self._conclude(turn, end)
        finally:
            if self.limits is not None:
                self.limits.last_active = trio.current_time()
            del self._turns[request_id]
            if not self._turns:
                self._no_turns.set()

    async def _conclude(self, turn: Turn, end: TurnEnd) -> None:
        """Count, log, trace and frame one turn's outcome: the one place that does."""
        self._conclude_quietly(turn, end)
        if end.ending.framed:
            frame = protocol.error_frame(self.job_id, turn.request_id, end.message)
            await self._send_or_drop(frame)

    def _conclude_quietly(self, turn: Turn, end: TurnEnd) -> None:
        """Count, log and trace one turn's outcome (``_conclude`` without the frame)."""
        ending = end.ending
        self.counters.inc(ending.counter)
        if ending.logged:
            log.warning("job %s request %s: %s", self.job_id, turn.request_id, end.message)
        if turn.span is not None:
            error = end.message if ending in _TRACED_ERRORS else None
            turn.span.end(ending.name.lower(), error, turn.chunks, turn.last_payload)

    async def _forward(self, frame: protocol.CompletionRequest, turn: Turn) -> None:
        """Route one turn, hold a slot on a backend serving its model, relay its chunks and
        done frame; ``TurnFailed`` when it cannot. A backend that cannot be reached (nothing
        was sent) is probed at once, and the turn goes to the next backend serving the model."""
        request_id = frame.requestId
        try:
            route = await self.pool.route(frame.model, bytes(frame.body))
        except BackendError as exc:
            raise TurnFailed(str(exc)) from None
        span = turn.span
        traceparent = None
        if span is not None:
            span.routed(route.model or route.requested)
            traceparent = span.traceparent
        tried: list[Backend] = []
        while True:
            backend: Backend | None = None
            try:
                async with self.pool.turn(route, self.job_id, request_id, tried) as backend:
                    if span is not None:
                        span.backend(backend.url)
                    async with backend.stream(route.body, traceparent) as response:
                        await self._relay(turn, response, backend.key)
                        return
            except BackendUnreachable as exc:
                assert backend is not None
                self.pool.suspect(backend)
                tried.append(backend)
                if len(tried) >= len(route.candidates):
                    raise TurnFailed(str(exc)) from None
                log.warning(
                    "job %s request %s: %s; trying another backend", self.job_id, request_id, exc
                )
            except BackendError as exc:
                raise TurnFailed(str(exc)) from None
            except (BadPayload, http1.ProtocolError) as exc:
                url = backend.url if backend is not None else "?"
                raise TurnFailed(f"backend {url} {exc}") from None
            except http1.ExchangeFailed as exc:
                url = backend.url if backend is not None else "?"
                raise TurnFailed(f"backend {url} stream broke: {exc}") from None

    async def _relay(self, turn: Turn, response: http1.Response, key: str | None = None) -> None:
        """Relay one backend answer: every SSE event becomes a chunk frame written the moment
        its read is split (``Relay``, in the poller's task while it streams), then the done
        frame. An error answer's body goes to the Server in the error frame, with the backend's
        key (``key``), bearer tokens and credential fields masked: a backend that echoes the
        request's headers must not hand the key on."""
        if not 200 <= response.status < 300:
            # read a key's length more, so a key cut at the limit is still masked whole
            extra = len(key) if key else 0
            body = await response.read_body(_ERROR_BODY_LIMIT + extra)
            text = Redactor([key], limit=None)(body)
            text = _truncated(text.encode(), _ERROR_BODY_LIMIT)
            raise TurnFailed(f"backend returned {response.status}: {text}")
        try:
            await self.relay.answer(turn, response)
        finally:
            self.counters.inc("chunks", turn.chunks)

    async def _answer_models(self, request_id: str) -> None:
        models = await self.pool.models()
        await self._send_or_drop(protocol.models_frame(self.job_id, request_id, models))


def _truncated(data: bytes, limit: int) -> str:
    if len(data) > limit:
        return data[:limit].decode(errors="replace").strip() + "…"
    return data.decode(errors="replace").strip()


class _LoggedOutlet:
    """The channel's WebSocket with every frame sent logged (``--verbose-frames``: cut and
    redacted): the relay's outlet then."""

    def __init__(self, ws: WebSocket, job_id: str, frame_log: Redactor) -> None:
        self.ws = ws
        self.job_id = job_id
        self.frame_log = frame_log

    def offer(self, message: bytes) -> bool:
        log.info("job %s → %s", self.job_id, self.frame_log(message))
        return self.ws.offer(message)

    def offer_batch(self, messages: list[bytes]) -> bool:
        for message in messages:
            log.info("job %s → %s", self.job_id, self.frame_log(message))
        return self.ws.offer_batch(messages)

    async def wait_room(self) -> None:
        await self.ws.wait_room()

    async def send(self, message: bytes | str) -> None:
        log.info("job %s → %s", self.job_id, self.frame_log(message))
        await self.ws.send(message)
