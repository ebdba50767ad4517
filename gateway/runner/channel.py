"""One Chat Channel connection: a reader, and one task per in-flight turn (its stream relayed
read by read by ``relay.SSERelay``, in the runner's ``Poller`` while other turns stream too)."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import trio

from gateway.observe import Counters, Histogram, Redactor
from gateway.runner.backends import Backend, BackendError, BackendPool, BackendUnreachable
from gateway.runner.poller import Poller
from gateway.runner.relay import SSERelay, TurnFailed, payload_problem
from gateway.wire import http1, protocol
from gateway.wire.wsclient import ChannelClosed, WebSocket

if TYPE_CHECKING:  # imported only when tracing is on (Runner.run: gateway.ops.otel.Tracing.start)
    from gateway.ops.otel import SessionTrace, TurnTrace

log = logging.getLogger("gateway.channel")

SHUTTING_DOWN = "runner shutting down"
_ERROR_BODY_LIMIT = 512
_DRAIN_AFTER_DONE = 2.0  # s: after [DONE], how long the rest of the response may take (reuse)


class Ending(enum.Enum):
    """How a turn ended: the counter it adds to, whether the Server is told (an error frame)
    and whether it is worth a log line. ``Channel._conclude`` does all three, in one place."""

    DONE = ("turns_done", False, False)
    FAILED = ("turns_error", True, True)
    CANCELLED = ("turns_cancelled", True, False)  # the Server asked (chat.completion.cancel)
    SHUTDOWN = ("turns_cancelled", True, True)  # the runner is shutting down
    SESSION_ENDED = ("turns_cancelled", False, False)  # chat.end or the channel is gone

    def __init__(self, counter: str, framed: bool, logged: bool) -> None:
        self.counter = counter
        self.framed = framed
        self.logged = logged


@dataclass(frozen=True)
class TurnEnd:
    """One turn's outcome: how it ended and the message the Server and the log get."""

    ending: Ending
    message: str = ""


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
        pool: BackendPool,
        *,
        shutdown: trio.Event,
        grace: float = 30.0,
        counters: Counters | None = None,
        ttft: Histogram | None = None,
        relay: Histogram | None = None,
        frame_log: Redactor | None = None,
        trace: SessionTrace | None = None,
        limits: SessionLimits | None = None,
        poller: Poller | None = None,
    ) -> None:
        self.job_id = job_id
        self.ws = ws
        self.pool = pool
        self.shutdown = shutdown
        self.grace = grace
        self._turns: dict[str, trio.CancelScope] = {}
        self._stopped: dict[str, TurnEnd] = {}  # why a turn was cancelled
        self._started: dict[str, float] = {}  # request id -> when its frame arrived
        self._no_turns = trio.Event()
        self._no_turns.set()
        self._draining = False
        self._drain_reason = SHUTTING_DOWN
        self._end: ChannelEnd | None = None
        self._nursery: trio.Nursery | None = None
        self.turns_served = 0
        self.counters = counters if counters is not None else Counters()
        self.ttft = ttft if ttft is not None else Histogram()
        self.relay = relay if relay is not None else Histogram()
        self.frame_log = frame_log  # --verbose-frames: every frame, cut and redacted
        self._send = ws.send if frame_log is None else self._send_logged
        self._offer = ws.offer if frame_log is None else self._offer_logged
        self._offer_batch = ws.offer_batch if frame_log is None else self._offer_batch_logged
        self.poller = poller  # reads the backend sockets of streaming turns (None: each its own)
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

    async def _send_logged(self, frame: bytes | str) -> None:
        log.info("job %s → %s", self.job_id, self.frame_log(frame))  # type: ignore[misc]
        await self.ws.send(frame)

    def _offer_logged(self, frame: bytes) -> bool:
        log.info("job %s → %s", self.job_id, self.frame_log(frame))  # type: ignore[misc]
        return self.ws.offer(frame)

    def _offer_batch_logged(self, frames: list[bytes]) -> bool:
        for frame in frames:
            log.info("job %s → %s", self.job_id, self.frame_log(frame))  # type: ignore[misc]
        return self.ws.offer_batch(frames)

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
        scope = trio.CancelScope()
        self._turns[request_id] = scope
        self._started[request_id] = trio.current_time()
        if self._no_turns.is_set():  # one event per busy spell: its waiters see it end
            self._no_turns = trio.Event()
        if self._turn_began is not None:
            self._turn_began.set()
        assert self._nursery is not None
        self._nursery.start_soon(self._turn, frame, scope)

    def _cancel_turn(self, request_id: str, end: TurnEnd) -> None:
        scope = self._turns.get(request_id)
        if scope is not None:
            self._stopped.setdefault(request_id, end)
            scope.cancel()

    async def _turn(self, frame: protocol.CompletionRequest, scope: trio.CancelScope) -> None:
        request_id = frame.requestId
        span: TurnTrace | None = None
        if self.trace is not None:
            span = self.trace.turn(request_id, frame.model, traceparent=frame.traceparent)
        try:
            end = _DONE_END
            try:
                with scope:
                    try:
                        await self._forward(frame, span)
                    except TurnFailed as exc:
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except protocol.FrameError as exc:  # a body that cannot take its model
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except ChannelClosed:
                        end = _SESSION_END
            except trio.Cancelled:  # the channel itself is ending: no one left to tell
                end = self._stopped.get(request_id, _SESSION_END)
                self._conclude_quietly(request_id, end, span)
                raise
            if scope.cancelled_caught:
                end = self._stopped.get(request_id, _CANCELLED_END)
            await self._conclude(request_id, end, span)
        finally:
            if self.limits is not None:
                self.limits.last_active = trio.current_time()
            del self._turns[request_id]
            self._started.pop(request_id, None)
            self._stopped.pop(request_id, None)
            if not self._turns:
                self._no_turns.set()

    async def _conclude(self, request_id: str, end: TurnEnd, span: TurnTrace | None) -> None:
        """Count, log, trace and frame one turn's outcome: the one place that does."""
        self._conclude_quietly(request_id, end, span)
        if end.ending.framed:
            await self._send_or_drop(protocol.error_frame(self.job_id, request_id, end.message))

    def _conclude_quietly(self, request_id: str, end: TurnEnd, span: TurnTrace | None) -> None:
        """Count, log and trace one turn's outcome (``_conclude`` without the frame)."""
        ending = end.ending
        self.counters.inc(ending.counter)
        if ending.logged:
            log.warning("job %s request %s: %s", self.job_id, request_id, end.message)
        self.turns_served += 1
        if span is not None:
            error = end.message if ending in _TRACED_ERRORS else None
            span.end(ending.name.lower(), error, span.chunks, span.last_payload)

    async def _forward(self, frame: protocol.CompletionRequest, span: TurnTrace | None) -> None:
        """Route one turn, hold a slot on a backend serving its model, relay its chunks and
        done frame; ``TurnFailed`` when it cannot. A backend that cannot be reached (nothing
        was sent) is probed at once, and the turn goes to the next backend serving the model."""
        request_id = frame.requestId
        try:
            route = await self.pool.route(frame.model, bytes(frame.body))
        except BackendError as exc:
            raise TurnFailed(str(exc)) from None
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
                        await self._relay(request_id, backend.url, response, span, backend.key)
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
            except http1.ProtocolError as exc:
                url = backend.url if backend is not None else "?"
                raise TurnFailed(f"backend {url} {exc}") from None
            except http1.HTTPError as exc:
                url = backend.url if backend is not None else "?"
                raise TurnFailed(f"backend {url} stream broke: {exc}") from None

    async def _relay(
        self,
        request_id: str,
        url: str,
        response: http1.Response,
        span: TurnTrace | None = None,
        key: str | None = None,
    ) -> None:
        """Relay one backend answer: every SSE event becomes a chunk frame written the moment
        its read is split (``SSERelay``, in the poller's task while it streams), then the done
        frame. An error answer's body goes to the Server in the error frame, with the backend's
        key (``key``), bearer tokens and credential fields masked: a backend that echoes the
        request's headers must not hand the key on."""
        send = self._send
        if not 200 <= response.status < 300:
            # read a key's length more, so a key cut at the limit is still masked whole
            extra = len(key) if key else 0
            body = await response.read_body(_ERROR_BODY_LIMIT + extra)
            text = Redactor([key], limit=None)(body)
            text = _truncated(text.encode(), _ERROR_BODY_LIMIT)
            raise TurnFailed(f"backend returned {response.status}: {text}")
        frames = protocol.TurnFrames(self.job_id, request_id)
        if b"text/event-stream" not in (response.header(b"content-type") or b""):
            payload = (await response.read_body()).strip()
            problem = payload_problem(payload)
            if problem is not None:
                raise TurnFailed(f"backend {url} answered {problem}")
            if span is not None:
                span.first_token()
                span.chunks, span.last_payload = 1, payload
            await send(frames.chunk(payload))
            await send(frames.done)
            return
        relay = SSERelay(
            response,
            url=url,
            frames=frames,
            offer=self._offer,
            offer_batch=self._offer_batch,
            request_id=request_id,
            stopped=self._stopped,
            started=self._started.get(request_id, 0.0),
            ttft=self.ttft,
            relay=self.relay,
            span=span,
        )
        try:
            await relay.run(self.poller, self.ws.wait_room)
        finally:
            self.counters.inc("chunks", relay.chunks)
            if span is not None:  # bytes already in hand, read once the stream is over
                span.chunks, span.last_payload = relay.chunks, relay.last_payload
        if relay.done:
            await _drain(response)
            return
        for rest in relay.rest():
            problem = payload_problem(rest)
            if problem is not None:
                raise TurnFailed(f"backend {url} sent an SSE event that is {problem}")
            await send(frames.chunk(rest))
            if span is not None:
                span.chunks, span.last_payload = span.chunks + 1, rest
        await send(frames.done)

    async def _answer_models(self, request_id: str) -> None:
        models = await self.pool.models()
        await self._send_or_drop(protocol.models_frame(self.job_id, request_id, models))


async def _drain(response: http1.Response) -> None:
    """After ``[DONE]``: read the rest of the response (briefly), so the connection is reused."""
    if response.complete:
        return
    with trio.move_on_after(_DRAIN_AFTER_DONE):
        try:
            while not response.complete:
                await response.read_more()
                response.body = []
        except http1.HTTPError:
            pass  # the turn is done; the connection is just not kept


def _truncated(data: bytes, limit: int) -> str:
    if len(data) > limit:
        return data[:limit].decode(errors="replace").strip() + "…"
    return data.decode(errors="replace").strip()
