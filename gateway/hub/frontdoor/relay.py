"""One turn's relay: request frame down, replies up as SSE (bytes verbatim) or one completion.

A streamed turn's chunks never pass through its task: the channel's reader writes them to the
client's socket (``StreamSink``); the task only flushes what the socket did not take and ends
the turn. A non-streamed turn's replies come through a memory channel and are folded here."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from gateway.hub.channel import Frame, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.frontdoor.dialects import ChatStream, Translation
from gateway.hub.frontdoor.shapes import (
    SSE_HEADERS,
    upstream_error,
    whole_completion,
)
from gateway.hub.http import ClientGone, Headers, Response
from gateway.hub.turns import TurnRecord, choices_mark, has_usage, is_usage_only
from gateway.wire import protocol

log = logging.getLogger("gateway.hub.frontdoor")

CANCEL_SEND_TIMEOUT = 2.0  # s: bound on sending chat.completion.cancel during cleanup

Replies = trio.MemoryReceiveChannel[tuple[str, float]]


class Reply(msgspec.Struct):
    """A runner frame routed to one request; ``chunk`` stays raw bytes, never re-encoded."""

    type: str
    chunk: msgspec.Raw = msgspec.Raw(b"")
    error: Any = None
    models: Any = None
    reason: Any = None


reply_decoder = msgspec.json.Decoder(Reply)


async def next_reply(rx: Replies) -> Reply | None:
    """The next decodable frame for a request; None when the channel ended."""
    while True:
        try:
            text, _t_recv = await rx.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        try:
            return reply_decoder.decode(text)
        except msgspec.DecodeError:
            log.warning("ignoring an undecodable frame from the runner: %.200s", text)


def _error_text(reply: Reply | Frame) -> str:
    if isinstance(reply.error, str) and reply.error:
        return reply.error
    if reply.error is None:
        return "the runner reported an error"
    return msgspec.json.encode(reply.error).decode()


class TurnLost(Exception):
    """The channel ended before the turn sent its client anything but keepalive comments: the
    turn can still be served elsewhere (the same job redialled, or a new one)."""


@dataclass
class Turn:
    """One relayed request: which channel, which request id, and how it ended."""

    job_id: str
    rid: str
    ch: ServerChannel
    finished: bool = False  # done/error received: nothing to cancel
    lost: bool = False  # the channel ended under the turn


def request_frame(job_id: str, rid: str, body: str, traceparent: str | None = None) -> str:
    """The ``chat.completion.request`` frame around the client's body text (not re-encoded),
    with the turn's ``traceparent`` when it has one (docs/protocol.md §6)."""
    frame = protocol.RequestFrame(job_id, rid, msgspec.Raw(body), traceparent)
    return protocol.encode_frame(frame).decode()


async def send_cancel(turn: Turn) -> None:
    """``chat.completion.cancel`` for a turn nobody reads any more (shielded, bounded)."""
    frame = protocol.encode_frame(protocol.CancelFrame(turn.job_id, turn.rid)).decode()
    with trio.move_on_after(CANCEL_SEND_TIMEOUT) as scope:
        scope.shield = True
        try:
            await turn.ch.send(frame)
            log.info("sent chat.completion.cancel for request %s of job %s", turn.rid, turn.job_id)
        except Exception as exc:
            log.info("could not send chat.completion.cancel for request %s: %r", turn.rid, exc)


STREAMING, DONE, ERROR, LOST, GONE, OVERRUN = range(6)  # a StreamSink's states
_NOWHERE = 1 << 62  # past the end of any frame: ``startswith`` there is False


class StreamSink:
    """A streamed turn's way to its client, fed by the channel's reader (``TurnSink``).

    Each chunk becomes one SSE event around its raw bytes; a read's events for this turn go to
    the client's socket in one write, at once (the response head with the first). What the
    socket does not take stays in the connection's buffer, and the turn's own task flushes it
    (``relay_stream``): nothing the reader does waits for a client. A client that falls more
    than ``bound`` bytes behind ends its turn (``OVERRUN``), no other.
    """

    __slots__ = (
        "resp",
        "headers",
        "bound",
        "translation",
        "_encode",
        "pending",
        "state",
        "wake",
        "error",
        "sent_chunk",
        "record",
        "strip_usage",
        "_choices",
        "_choices_at",
        "last",
        "flushing",
    )

    def __init__(
        self,
        resp: Response,
        headers: Headers,
        bound: int,
        translation: Translation | None = None,
        record: TurnRecord | None = None,
        strip_usage: bool = False,
    ) -> None:
        self.resp = resp
        self.record = record  # the turn's accounting: its first token, its usage at the end
        self.strip_usage = strip_usage  # the hub asked for usage, the client did not
        # how this turn's frames open a non-empty choices, and where (``turns.choices_mark``):
        # a frame with these bytes there is no usage-only chunk (known after the first chunk)
        self._choices = b""
        self._choices_at = _NOWHERE
        self.last: Any = None  # the last chunk: where the usage is, read at the end
        self.translation: Translation = translation if translation is not None else ChatStream()
        self._encode = self.translation.chunk  # chat completions: one SSE event, bytes verbatim
        self.headers = headers
        self.bound = bound
        self.pending: list[bytes] = []
        self.state = STREAMING
        self.wake = trio.Event()  # the turn's task has something to do
        self.error: str | None = None
        self.sent_chunk = False
        self.flushing: trio.CancelScope | None = None  # the turn's task waiting for the socket

    def chunk(self, chunk: msgspec.Raw, frame: bytes = b"") -> None:
        if self.state == STREAMING and len(chunk):
            self.last = chunk
            if self.record is not None:
                self.record.chunks += 1
            if (
                self.strip_usage
                and not frame.startswith(self._choices, self._choices_at)
                and self._usage_only(frame or bytes(chunk))
            ):
                return  # the usage chunk the hub added: counted at the end, not this client's
            events = self._encode(chunk)
            if events:
                self.pending.append(events)

    def _usage_only(self, data: bytes) -> bool:
        """``chunk``'s test for a frame not laid out as the turn's last known one (its first,
        the usage chunk, a head that changed): where its choices open is kept for the next."""
        mark = choices_mark(data)
        if mark is not None:
            self._choices, self._choices_at = mark
            return False
        return is_usage_only(data)

    def flush_batch(self) -> None:
        pending = self.pending
        if pending:
            self.pending = []
            self._write(pending[0] if len(pending) == 1 else b"".join(pending))

    def _write(self, data: bytes, end: bool = False) -> None:
        resp = self.resp
        try:
            head = b"" if resp.started else resp.head(200, self.headers)
            done = resp.write_nowait(data, head, end)  # the head goes with the first chunk
        except ClientGone:
            self._to(GONE)
            return
        if not self.sent_chunk:
            self.sent_chunk = True
            if self.record is not None:
                self.record.first_token = trio.current_time()
        if not done:
            if resp.backlog > self.bound:
                self._to(OVERRUN)
            else:
                self.wake.set()  # the turn's task flushes the rest

    def _to(self, state: int) -> None:
        self.state = state
        self.wake.set()
        if self.flushing is not None and state in (OVERRUN, GONE):
            self.flushing.cancel()  # a flush to a client that does not read would never end

    def frame(self, frame: Frame) -> None:
        if self.state != STREAMING:
            return
        if frame.type == protocol.COMPLETION_DONE:
            if self.record is not None and self.last is not None and has_usage(self.last):
                self.record.take_usage(self.last)
            self.pending.append(self.translation.done())
            data = b"".join(self.pending)
            self.pending = []
            self.state = DONE
            self._write(data, end=True)  # the last chunks and the end, in one write
            self.wake.set()
        elif frame.type == protocol.COMPLETION_ERROR:
            self.error = _error_text(frame)
            if self.resp.started or self.pending:
                self.pending.append(self.translation.error(self.error, "upstream_error"))
                data = b"".join(self.pending)
                self.pending = []
                self.state = ERROR
                self._write(data, end=True)
            self._to(ERROR)

    def lost(self) -> None:
        if self.state == STREAMING:
            self.flush_batch()
            if self.state == STREAMING:
                self._to(LOST)


def stream_headers(rid: str) -> Headers:
    return [*SSE_HEADERS, (b"x-request-id", rid.encode())]


async def relay_stream(
    turn: Turn,
    sink: StreamSink,
    resp: Response,
    keepalive: float,
    first_within: float = math.inf,
    counters: HubCounters | None = None,
) -> None:
    """Serve a streamed turn from its task while the channel's reader writes its chunks
    (``StreamSink``): flush what the client's socket did not take, and end the turn as its sink
    says. Until the first chunk, a keepalive comment goes out after each quiet ``keepalive`` s
    while the channel is open (the hub's pings close a silent one); with pings off the wait for
    the first frame is bounded by ``first_within`` s. TurnLost when the channel ends (or stays
    silent that long) before the first chunk."""
    first_frame_by = trio.current_time() + first_within
    while True:
        sink.wake = trio.Event()
        state = sink.state
        if state == GONE:
            raise ClientGone()
        if state == OVERRUN:
            await _overrun(turn, resp, sink, counters)
            return
        if resp.backlog:
            with trio.CancelScope() as sink.flushing:  # cancelled if the client falls behind
                await resp.flush()
            sink.flushing = None
            continue
        if state == DONE:
            turn.finished = True
            return
        if state == ERROR:
            turn.finished = True
            message = sink.error or "the runner reported an error"
            log.info("runner error on job %s request %s: %s", turn.job_id, turn.rid, message)
            if not resp.started:
                raise upstream_error(message)
            if not resp.finished:  # only keepalive comments went out before it
                await resp.body(sink.translation.error(message, "upstream_error"), more=False)
            return
        if state == LOST:
            turn.lost = True
            if not sink.sent_chunk:
                raise TurnLost()
            message = "the chat channel to the runner was lost mid-turn"
            log.warning("%s (job %s, request %s)", message, turn.job_id, turn.rid)
            await resp.body(sink.translation.error(message, "channel_lost"), more=False)
            return
        if sink.sent_chunk:
            await sink.wake.wait()
            continue
        wait_until = first_frame_by
        if keepalive > 0:
            wait_until = min(wait_until, trio.current_time() + keepalive)
        with trio.move_on_at(wait_until) as wait:
            await sink.wake.wait()
        if not wait.cancelled_caught or sink.state != STREAMING:
            continue
        if trio.current_time() >= first_frame_by:
            turn.lost = True
            log.warning(
                "job %s: no frame for request %s within %g s: closing its channel",
                turn.job_id,
                turn.rid,
                first_within,
            )
            turn.ch.request_close(1011, f"no frame within {first_within:g} s")
            raise TurnLost()
        if not resp.started:  # nothing yet: keep the client (and proxies) patient
            resp.start_nowait(200, sink.headers)
        await resp.body(sink.translation.keepalive())


async def _overrun(
    turn: Turn, resp: Response, sink: StreamSink, counters: HubCounters | None
) -> None:
    """The client fell ``bound`` bytes behind: its turn ends (the runner is told by the caller's
    cancel), an error event is offered for a moment, and its connection closes."""
    if counters is not None:
        counters.turns_overrun += 1
    message = f"the client read too slowly: more than {sink.bound} bytes of the stream were waiting"
    log.warning("job %s request %s: %s; ending the turn", turn.job_id, turn.rid, message)
    with trio.move_on_after(CANCEL_SEND_TIMEOUT):
        try:
            await resp.body(sink.translation.error(message, "client_too_slow"), more=False)
        except ClientGone:
            pass
    resp.gone = True  # its connection closes


async def relay_whole(
    turn: Turn,
    rx: Replies,
    resp: Response,
    first_within: float = math.inf,
    fold: Callable[[list[bytes]], bytes] = whole_completion,
    record: TurnRecord | None = None,
) -> None:
    """Relay a non-streamed turn: every chunk gathered, then one ``chat.completion`` answer
    (the wait for the first frame bounded by ``first_within`` s, as in ``relay_stream``)."""
    chunks: list[bytes] = []
    first_frame_by = trio.current_time() + first_within
    while True:
        reply = None
        with trio.move_on_at(first_frame_by) as wait:
            reply = await next_reply(rx)
        if wait.cancelled_caught:
            turn.lost = True
            turn.ch.request_close(1011, f"no frame within {first_within:g} s")
            raise TurnLost()
        first_frame_by = math.inf
        if reply is None:
            turn.lost = True  # nothing was sent to the client yet: it can be served elsewhere
            raise TurnLost()
        if reply.type == protocol.COMPLETION_CHUNK and len(reply.chunk):
            chunks.append(bytes(reply.chunk))
        elif reply.type == protocol.COMPLETION_DONE:
            turn.finished = True
            break
        elif reply.type == protocol.COMPLETION_ERROR:
            turn.finished = True
            message = _error_text(reply)
            log.info("runner error on job %s request %s: %s", turn.job_id, turn.rid, message)
            raise upstream_error(message)
    if not chunks:
        raise upstream_error(
            "the runner finished the turn without a completion", "empty_completion"
        )
    if record is not None:
        for chunk in chunks[-1:]:
            if has_usage(chunk):
                record.take_usage(chunk)
        record.first_token = trio.current_time()
    await resp.whole(200, fold(chunks), [(b"x-request-id", turn.rid.encode())])
