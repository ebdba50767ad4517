"""The Server side of Chat Channels: one accepted WebSocket each, and each job's open one."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import msgspec
import trio

from gateway import protocol
from gateway.hub.board import Changes, JobBoard
from gateway.hub.counters import HubCounters
from gateway.hub.http import Message, Receive, Send

log = logging.getLogger("gateway.hub")

REQUEST_BUFFER = 256  # inbound frames buffered per open request before the reader pushes back
GENERAL_BUFFER = 1024  # inbound frames buffered for recv(); more are dropped
CLOSE_REPLACED = 4000  # an old channel replaced by a new connection for the same job
CLOSE_OFFLINE = 1001  # the runner was declared offline
DEAD_CODES = (1006, 1011)  # ended with no close handshake, or silent past the ping timeout


class _Envelope(msgspec.Struct):
    """Just enough of an inbound frame to route it; every other field is skipped."""

    type: Any = None
    requestId: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_json_encoder = msgspec.json.Encoder()


class ServerChannel:
    """One accepted Chat Channel WebSocket, seen from the Server side."""

    def __init__(self, job_id: str, runner_id: str, send: Send, channels: Channels) -> None:
        self.job_id = job_id
        self.runner_id = runner_id
        self.closed = trio.Event()
        self._asgi_send = send
        self._channels = channels
        self._lock = trio.Lock()
        self._requests: dict[str, trio.MemorySendChannel[tuple[str, float]]] = {}
        self._general_send, self._general_recv = trio.open_memory_channel[tuple[str, float]](
            GENERAL_BUFFER
        )
        self._loop_scope = trio.CancelScope()
        self._close_code: int | None = None
        self._close_reason: str | None = None
        self._terminated = trio.Event()
        self.dropped = 0  # inbound frames dropped because recv() was not read
        self.end_code: int | None = None  # the close code the channel ended with
        self.runner_ended = False  # the runner sent chat.end on it

    def __repr__(self) -> str:
        state = "closed" if self.closed.is_set() else "open"
        return f"<ServerChannel job={self.job_id} runner={self.runner_id} {state}>"

    async def send(self, frame: dict[str, Any] | str | bytes) -> None:
        """Send one message: a dict as JSON text, a str as text, bytes as a binary message.

        A send on a closed (or breaking) channel is dropped quietly: its requests see
        EndOfChannel.
        """
        if isinstance(frame, dict):
            message: Message = {
                "type": "websocket.send",
                "text": _json_encoder.encode(frame).decode(),
            }
        elif isinstance(frame, str):
            message = {"type": "websocket.send", "text": frame}
        elif isinstance(frame, bytes | bytearray | memoryview):
            message = {"type": "websocket.send", "bytes": bytes(frame)}
        else:
            raise TypeError(f"cannot send {type(frame).__name__} on a channel")
        async with self._lock:
            if self.closed.is_set():
                return
            try:
                await self._asgi_send(message)
            except OSError as exc:  # the socket broke: the reader ends the channel
                log.debug("channel %s: send failed: %r", self.job_id, exc)

    def open_request(self, request_id: str) -> trio.MemoryReceiveChannel[tuple[str, float]]:
        """Route inbound text messages whose ``requestId`` is ``request_id`` to the returned channel.

        Each item is ``(text, time.perf_counter() at receipt)``. When the socket closes the
        channel ends (EndOfChannel); on an already closed channel it ends at once.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already open on this channel")
        send_ch, recv_ch = trio.open_memory_channel[tuple[str, float]](REQUEST_BUFFER)
        if self.closed.is_set():
            send_ch.close()
        else:
            self._requests[request_id] = send_ch
        return recv_ch

    def close_request(self, request_id: str) -> None:
        """Stop routing ``request_id``; later messages for it go to ``recv()``."""
        send_ch = self._requests.pop(request_id, None)
        if send_ch is not None:
            send_ch.close()

    async def recv(self) -> tuple[str, float]:
        """The next inbound text message not routed to an open request; EndOfChannel once closed."""
        return await self._general_recv.receive()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close the WebSocket (``code`` != 1000 simulates a dropped channel)."""
        self.request_close(code, reason)
        with trio.move_on_after(5):
            await self._terminated.wait()

    def request_close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close without waiting: end the channel now, the close frame follows from its own task."""
        if self._close_code is None and not self._terminated.is_set():
            self._close_code = code
            self._close_reason = reason
        self._finish()
        self._loop_scope.cancel()

    # -- internals, driven by the hub's WebSocket handler --------------------

    def _finish(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for send_ch in self._requests.values():
            send_ch.close()
        self._requests.clear()
        self._general_send.close()
        self._channels.gone(self)

    async def _route(self, text: str, at: float) -> None:
        try:
            envelope = _envelope_decoder.decode(text)
        except msgspec.DecodeError:
            request_id = None
        else:
            request_id = envelope.requestId if isinstance(envelope.requestId, str) else None
            if request_id is None and envelope.type == protocol.END:
                self.runner_ended = True  # known before the close that follows it
                self._channels.runner_ended.add(self.job_id)
        if request_id is not None:
            send_ch = self._requests.get(request_id)
            if send_ch is not None:
                try:
                    try:
                        send_ch.send_nowait((text, at))  # no scheduling point per frame
                    except trio.WouldBlock:
                        await send_ch.send((text, at))  # that request reads slowly: push back
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    if self._requests.get(request_id) is send_ch:
                        del self._requests[request_id]
        try:
            self._general_send.send_nowait((text, at))
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("channel %s: recv() not read, dropping inbound frames", self.job_id)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def serve(self, receive: Receive) -> None:
        """Pump inbound messages until the socket closes or ``close()`` is asked for."""
        disconnected = False
        seen, runner_id = self._channels.board.seen, self.runner_id
        try:
            with self._loop_scope:
                while True:
                    message = await receive()
                    kind = message.get("type")
                    if kind == "websocket.disconnect":
                        disconnected = True
                        self.end_code = message.get("code", 1005)
                        break
                    if kind != "websocket.receive":
                        continue
                    text = message.get("text")
                    if text is None:
                        continue  # binary inbound frames are ignored
                    at = time.perf_counter()
                    seen(runner_id)
                    await self._route(text, at)
        finally:
            self._finish()
            try:
                if not disconnected:
                    close: Message = {"type": "websocket.close", "code": self._close_code or 1000}
                    if self._close_reason:
                        close["reason"] = self._close_reason
                    async with self._lock:
                        await self._asgi_send(close)
            finally:
                self._terminated.set()


class Channels:
    """The open channel of each job: accepted ones replace older ones, closed ones leave."""

    def __init__(self, board: JobBoard, changes: Changes, counters: HubCounters) -> None:
        self.board = board
        self.changes = changes
        self.counters = counters
        self._open: dict[str, ServerChannel] = {}
        self.runner_ended: set[str] = set()  # job ids whose runner sent chat.end (no redial)

    def get(self, job_id: str) -> ServerChannel | None:
        """The job's current open channel, or None."""
        return self._open.get(job_id)

    def all(self) -> list[ServerChannel]:
        """Every open channel."""
        return list(self._open.values())

    def accept(self, job_id: str, runner_id: str, send: Send) -> ServerChannel:
        """A new channel for the job (its handshake accepted); an older one is closed."""
        ch = ServerChannel(job_id, runner_id, send, self)
        old = self._open.get(job_id)
        self._open[job_id] = ch
        if old is not None:
            old.request_close(CLOSE_REPLACED, "replaced by a new connection")
        self.changes.notify()
        return ch

    def gone(self, ch: ServerChannel) -> None:
        """``ch`` closed: it is no longer the job's channel (counted dead when it ended without
        a close handshake, silent past the ping timeout, or with its runner offline)."""
        code = ch.end_code if ch.end_code is not None else ch._close_code
        if code in DEAD_CODES or code == CLOSE_OFFLINE:
            self.counters.channels_dead += 1
            log.warning(
                "channel of job %s (runner %s) is dead (close code %s); channels declared dead: %d",
                ch.job_id,
                ch.runner_id,
                code,
                self.counters.channels_dead,
            )
        if self._open.get(ch.job_id) is ch:
            del self._open[ch.job_id]
            self.changes.notify()

    async def end_job(self, job_id: str, reason: str) -> None:
        """Send ``chat.end`` on the job's channel if one is open."""
        ch = self._open.get(job_id)
        if ch is not None:
            await ch.send(protocol.end_frame(job_id, reason))

    async def cancel_job(self, job_id: str, reason: str = "cancelled") -> None:
        """Withdraw a job: a queued one leaves the queue; an open one gets ``chat.end`` first."""
        job = self.board.jobs.get(job_id)
        if job is None or job.status == "completed":
            return
        if job.claimed_by is not None:
            job.cancel_reason = reason
            await self.end_job(job_id, reason)
        self.board.withdraw(job_id, reason)

    async def wait(self, job_id: str, within: float | None = None) -> ServerChannel | None:
        """The job's open channel, waiting ``within`` s for a (re)connect: None after that, and
        at once when the job is unknown, completed or cancelled (no channel can come then)."""
        with trio.move_on_after(math.inf if within is None else within):
            while True:
                ch = self._open.get(job_id)
                if ch is not None:
                    return ch
                job = self.board.jobs.get(job_id)
                if job is None or job.over:
                    return None
                await self.changes.wait()
        return None
