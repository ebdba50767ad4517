"""One Chat Channel connection: a reader, the frames it reads served, and its end; its turns
(``gateway.runner.turns.Turns``) run in tasks that may outlive it (a resume, docs/protocol.md §6).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import trio

from gateway.observe import Redactor
from gateway.runner.embed import embed
from gateway.runner.relay import Outlet
from gateway.runner.turn import Ending, TurnEnd
from gateway.runner.turns import (
    HELLO_WAIT,
    SESSION_END,
    SHUTTING_DOWN,
    ChannelKit,
    SessionLimits,
    Turns,
)
from gateway.wire import protocol
from gateway.wire.wsclient import ChannelClosed, WebSocket

if (
    TYPE_CHECKING
):  # imported only when tracing is on (Runner.run: gateway.runner.otel.Tracing.start)
    from gateway.runner.otel import SessionTrace
    from gateway.runner.relay import Relay

__all__ = ["SHUTTING_DOWN", "Channel", "ChannelEnd", "ChannelKit", "SessionLimits"]

log = logging.getLogger("gateway.channel")

_CANCELLED_END = TurnEnd(Ending.CANCELLED, protocol.CANCELLED)
_SHUTDOWN_END = TurnEnd(Ending.SHUTDOWN, SHUTTING_DOWN)


@dataclass
class ChannelEnd:
    """How a channel connection ended: by the Server (chat.end), the runner (shutdown) or a drop."""

    by: Literal["server", "runner", "drop"]
    reason: str


class Channel:
    """Serves one open Chat Channel WebSocket of one Chat Job until it ends or drops.

    Turns run concurrently, each in its own task (``Turns``: the session's, so that a resume
    can carry them over to the next connection; without one, the channel's own); each backend
    read's frames are written at once when no write is in progress, else together with the
    others in the next write (``WebSocket.offer``), before the next turn's socket is read. A
    slow Server makes the turns wait for room, so the backend reads slow down too and memory
    stays bounded.
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
        turns: Turns | None = None,
    ) -> None:
        self.job_id = job_id
        self.ws = ws
        self.kit = kit
        self.shutdown = kit.shutdown
        self.grace = kit.grace
        self._end: ChannelEnd | None = None
        self._nursery: trio.Nursery | None = None
        self.counters = kit.counters
        self.frame_log = frame_log  # --verbose-frames: every frame, cut and redacted
        self.out: Outlet = ws if frame_log is None else _LoggedOutlet(ws, job_id, frame_log)
        self._send = self.out.send
        self.trace = trace  # tracing on: the session's span; off: None, and turns do no tracing
        self.limits = limits
        self.turns = turns  # None: made by ``serve``, its turns ending with this connection
        self._first = True  # the next frame read is the connection's first (a hello?)
        # the Server's hello offered embeddings (docs/protocol.md §6): taken up in the models
        # answer, and chat.embeddings.request served
        self.embeddings = False
        # the Server's hello said this channel is its job's sign of life (§6): no heartbeat
        # while it is up
        self.liveness = False

    @property
    def relay(self) -> Relay:
        """The relay of the turns' answers (once ``serve`` has begun)."""
        assert self.turns is not None
        return self.turns.relay

    @property
    def in_flight(self) -> int:
        return 0 if self.turns is None else self.turns.in_flight

    async def serve(self) -> ChannelEnd:
        """Serve frames until ``chat.end``, runner shutdown, or the connection drops."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.turns is None:
                self.turns = Turns(
                    self.job_id, self.kit, nursery, trace=self.trace, limits=self.limits
                )
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
        assert self.turns is not None
        if end.by == "drop":
            self.turns.dropped(self.out)
        else:
            self.turns.end_all(SESSION_END)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- the socket --------------------------------------------------------------------

    async def _reader(self) -> None:
        assert self.turns is not None
        awaiting_hello = self.turns.attach(self.out)
        while self._end is None:
            try:
                if awaiting_hello:  # kept turns wait for this connection's hello, bounded
                    message = None
                    with trio.move_on_after(HELLO_WAIT):
                        message = await self.ws.receive()
                    awaiting_hello = False
                    if message is None:
                        log.warning(
                            "job %s: no chat.channel.hello within %g s: kept turns cancelled",
                            self.job_id,
                            HELLO_WAIT,
                        )
                        self._first = False
                        self.turns.no_hello(self.out)
                        continue
                else:
                    message = await self.ws.receive()
            except ChannelClosed as exc:
                self._finish(ChannelEnd("drop", f"channel closed ({exc})"))
                return
            if self.frame_log is not None:
                log.info("job %s ← %s", self.job_id, self.frame_log(message))
            self._handle(message)

    def _handle(self, message: str | bytes) -> None:
        turns = self.turns
        assert turns is not None and self._nursery is not None
        first, self._first = self._first, False
        frame: protocol.InboundFrame | None = None
        if isinstance(message, bytes):
            log.warning("job %s: ignored a binary frame (%d bytes)", self.job_id, len(message))
        else:
            try:
                frame = protocol.decode_frame(message)
            except protocol.FrameError as exc:
                log.warning("job %s: ignored a bad frame: %s", self.job_id, exc)
                if exc.request_id is not None:
                    self._post(
                        protocol.error_frame(self.job_id, exc.request_id, f"bad frame: {exc}")
                    )
        if first:  # a Server with extensions says so first (docs/protocol.md §6)
            if isinstance(frame, protocol.Hello) and frame.jobId in (None, self.job_id):
                self.embeddings = protocol.EMBEDDINGS in frame.extensions
                self.liveness = protocol.LIVENESS in frame.extensions
                turns.hello(self.out, frame)
                return
            turns.no_hello(self.out)
        if frame is None:
            return
        if isinstance(frame, protocol.Unknown):
            log.debug("job %s: ignored a frame of unknown type %r", self.job_id, frame.type)
            return
        if isinstance(frame, protocol.Hello):  # not the first frame, or another job's
            log.warning(
                "job %s: ignored a chat.channel.hello (for job %s)", self.job_id, frame.jobId
            )
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
        if isinstance(frame, protocol.CompletionRequest):
            self._start_turn(frame)
        elif isinstance(frame, protocol.CompletionCancel):
            turns.cancel(frame.requestId, _CANCELLED_END)
        elif isinstance(frame, protocol.ModelsRequest):
            self._nursery.start_soon(self._answer_models, frame.requestId)
        elif isinstance(frame, protocol.EmbeddingsRequest):
            if self.embeddings:
                self._nursery.start_soon(self._embed, frame)
            else:  # a Server that did not offer the extension: not ours to guess
                error = "chat.embeddings.request without the embeddings extension in the hello"
                self._post(protocol.error_frame(self.job_id, frame.requestId, error))
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
        assert limits.idle is not None and self.turns is not None
        turns = self.turns
        while True:
            await turns.wait_idle()
            turns.turn_began = began = trio.Event()
            with trio.move_on_at(limits.last_active + limits.idle) as waited:
                await began.wait()
            if waited.cancelled_caught and not turns.in_flight:
                break
        await self._wind_down(limits.idle_reason())

    async def _wind_down(self, reason: str) -> None:
        """No new turn; in-flight ones get the grace, then are cancelled; then ``chat.end``
        with ``reason`` and the channel ends (by the runner). Once: the first reason wins."""
        turns = self.turns
        assert turns is not None
        if turns.draining:
            return
        turns.draining = True
        turns.drain_reason = reason
        with trio.move_on_after(self.grace):
            await turns.wait_idle()
        turns.stop_all(
            _SHUTDOWN_END if reason == SHUTTING_DOWN else TurnEnd(Ending.SHUTDOWN, reason)
        )
        await turns.wait_idle()
        await self._send_or_drop(protocol.end_frame(self.job_id, reason))
        with trio.move_on_after(5):  # what is written so far reaches the socket, chat.end last
            await self.ws.drain()
        self._finish(ChannelEnd("runner", reason))

    # -- turns -------------------------------------------------------------------------

    def _start_turn(self, frame: protocol.CompletionRequest) -> None:
        turns = self.turns
        assert turns is not None
        request_id = frame.requestId
        if turns.draining:
            self._post(protocol.error_frame(self.job_id, request_id, turns.drain_reason))
            return
        if request_id in turns:
            log.warning("job %s request %s: duplicate requestId refused", self.job_id, request_id)
            self._post(
                protocol.error_frame(
                    self.job_id, request_id, "duplicate requestId: a turn with this id is in flight"
                )
            )
            return
        turns.start(frame)

    async def _answer_models(self, request_id: str) -> None:
        pool = self.kit.pool
        models = await pool.models()
        taken = [protocol.EMBEDDINGS] if self.embeddings else None
        frame = protocol.models_frame(self.job_id, request_id, models, pool.contexts(models), taken)
        await self._send_or_drop(frame)

    async def _embed(self, frame: protocol.EmbeddingsRequest) -> None:
        """A ``/v1/embeddings`` request: its answer's frames, or its error (``embed``)."""
        frames = await embed(self.kit.pool, self.job_id, frame)
        for message in frames:
            await self._send_or_drop(message)


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
