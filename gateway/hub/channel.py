"""The Server side of Chat Channels: one accepted WebSocket each, and each job's open one."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

import msgspec
import trio

from gateway.hub.board import Changes, JobBoard
from gateway.hub.counters import HubCounters
from gateway.hub.http import ClientGone
from gateway.wire import protocol
from gateway.wire.server import ServerWebSocket
from gateway.wire.wsframes import OP_BINARY

log = logging.getLogger("gateway.hub")

_CHUNK = protocol.COMPLETION_CHUNK
REQUEST_BUFFER = 256  # inbound frames buffered per open request before the reader pushes back
GENERAL_BUFFER = 1024  # inbound frames buffered for recv(); more are dropped
CLOSE_REPLACED = 4000  # an old channel replaced by a new connection for the same job
CLOSE_OFFLINE = 1001  # the runner was declared offline
# ended with no close handshake, failed for a protocol violation, or silent past the ping timeout
DEAD_CODES = (1002, 1006, 1007, 1009, 1011)


class Frame(msgspec.Struct):
    """An inbound frame, decoded once where it is read: the fields that route it and end a turn;
    ``chunk`` stays raw bytes (never re-encoded), every other field is skipped."""

    type: Any = None
    requestId: Any = None
    chunk: msgspec.Raw = msgspec.Raw(b"")
    error: Any = None
    reason: Any = None


_frame_decoder = msgspec.json.Decoder(Frame)
_json_encoder = msgspec.json.Encoder()


class TurnSink(Protocol):
    """Where the channel's reader puts a streamed turn's frames (the front door's client)."""

    def chunk(self, chunk: msgspec.Raw, frame: bytes) -> None:
        """One chunk frame's chunk, in order (``frame``: the whole frame's bytes, to search
        without a copy)."""

    def flush_batch(self) -> None:
        """Every chunk of the read at hand is in: write them."""

    def frame(self, frame: Frame) -> None:
        """Any other frame of the turn (done, error)."""

    def lost(self) -> None:
        """The channel ended."""


class ServerChannel:
    """One accepted Chat Channel WebSocket, seen from the Server side.

    Its reader runs in the connection's own task: each read's frames are decoded once, and a
    streamed turn's chunks go straight to that turn's ``TurnSink`` (its client's socket); frames
    of requests opened with ``open_request`` go to their memory channel, the rest to ``recv``.
    """

    def __init__(
        self, job_id: str, runner_id: str, ws: ServerWebSocket | None, channels: Channels
    ) -> None:
        self.job_id = job_id
        self.runner_id = runner_id
        self.closed = trio.Event()
        self._ws = ws
        self._channels = channels
        self._requests: dict[str, trio.MemorySendChannel[tuple[str, float]]] = {}
        self._sinks: dict[str, TurnSink] = {}
        self._general_send, self._general_recv = trio.open_memory_channel[tuple[str, float]](
            GENERAL_BUFFER
        )
        self._close_code: int | None = None
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
            data, binary = _json_encoder.encode(frame), False
        elif isinstance(frame, str):
            data, binary = frame.encode(), False
        elif isinstance(frame, bytes | bytearray | memoryview):
            data, binary = bytes(frame), True
        else:
            raise TypeError(f"cannot send {type(frame).__name__} on a channel")
        if self.closed.is_set() or self._ws is None:
            return
        try:
            if binary:
                await self._ws.send_message(OP_BINARY, data)
            else:
                await self._ws.send_text(data)
        except ClientGone as exc:  # the socket broke: the reader ends the channel
            log.debug("channel %s: send failed: %r", self.job_id, exc)

    def open_request(self, request_id: str) -> trio.MemoryReceiveChannel[tuple[str, float]]:
        """Route inbound text messages whose ``requestId`` is ``request_id`` to the returned channel.

        Each item is ``(text, time.perf_counter() at receipt)``. When the socket closes the
        channel ends (EndOfChannel); on an already closed channel it ends at once.
        """
        if request_id in self._requests or request_id in self._sinks:
            raise ValueError(f"request {request_id!r} is already open on this channel")
        send_ch, recv_ch = trio.open_memory_channel[tuple[str, float]](REQUEST_BUFFER)
        if self.closed.is_set():
            send_ch.close()
        else:
            self._requests[request_id] = send_ch
        return recv_ch

    def open_turn(self, request_id: str, sink: TurnSink) -> None:
        """Hand the frames of ``request_id`` to ``sink`` as they are read (``lost`` at once on a
        closed channel)."""
        if request_id in self._requests or request_id in self._sinks:
            raise ValueError(f"request {request_id!r} is already open on this channel")
        if self.closed.is_set():
            sink.lost()
        else:
            self._sinks[request_id] = sink

    def close_request(self, request_id: str) -> None:
        """Stop routing ``request_id``; later messages for it go to ``recv()``."""
        self._sinks.pop(request_id, None)
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
        """Close without waiting: end the channel now, the close frame written at once."""
        if self._close_code is None and not self._terminated.is_set():
            self._close_code = code
        if self._ws is not None:
            self._ws.close_nowait(code, reason or "")
        self._finish()

    # -- internals, driven by the connection's reader --------------------------------------

    def _finish(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for send_ch in self._requests.values():
            send_ch.close()
        self._requests.clear()
        sinks = list(self._sinks.values())
        self._sinks.clear()
        for sink in sinks:
            sink.lost()
        self._general_send.close()
        self._channels.gone(self)

    async def on_texts(self, texts: list[bytes]) -> None:
        """One read's text messages, in order (the reader's hand-over): chunks of streamed turns
        written to their clients (each turn's chunks of this read in one write), the rest routed."""
        self._seen(self.runner_id)
        sinks = self._sinks
        decode = _frame_decoder.decode
        dirty: dict[int, TurnSink] | None = None
        for text in texts:
            try:
                frame = decode(text)
            except msgspec.DecodeError:
                await self._general(text)
                continue
            rid = frame.requestId
            if rid.__class__ is str:
                sink = sinks.get(rid)
                if sink is not None:
                    if frame.type == _CHUNK:
                        sink.chunk(frame.chunk, text)
                        if dirty is None:
                            dirty = {id(sink): sink}
                        else:
                            dirty[id(sink)] = sink
                    else:
                        sink.frame(frame)
                    continue
                send_ch = self._requests.get(rid)
                if send_ch is not None:
                    item = (text.decode(), time.perf_counter())
                    try:
                        try:
                            send_ch.send_nowait(item)
                        except trio.WouldBlock:
                            await send_ch.send(item)  # that request reads slowly: push back
                        continue
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        if self._requests.get(rid) is send_ch:
                            del self._requests[rid]
            elif rid is None and frame.type == protocol.END:
                self.runner_ended = True  # known before the close that follows it
                self._channels.runner_ended.add(self.job_id)
            await self._general(text)
        if dirty is not None:
            for sink in dirty.values():
                sink.flush_batch()

    async def _general(self, text: bytes) -> None:
        try:
            self._general_send.send_nowait((text.decode(), time.perf_counter()))
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("channel %s: recv() not read, dropping inbound frames", self.job_id)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _seen(self, runner_id: str) -> None:
        self._channels.board.seen(runner_id)

    async def serve(self) -> None:
        """Read the WebSocket until it closes (or ``close()`` is asked for)."""
        try:
            if self._ws is not None:
                self.end_code = await self._ws.run(self.on_texts)
        finally:
            self._finish()
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

    def accept(self, job_id: str, runner_id: str, ws: ServerWebSocket) -> ServerChannel:
        """A new channel for the job (its handshake accepted); an older one is closed."""
        ch = ServerChannel(job_id, runner_id, ws, self)
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
        await self.board.withdraw(job_id, reason)

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
