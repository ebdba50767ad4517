"""One turn's relay: request frame down, replies up as SSE (bytes verbatim) or one completion."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from gateway import protocol
from gateway.hub.channel import ServerChannel
from gateway.hub.frontdoor.shapes import (
    DONE_EVENT,
    KEEPALIVE,
    SSE_HEADERS,
    channel_lost,
    sse_data,
    stream_error_event,
    upstream_error,
    whole_completion,
)
from gateway.hub.http import Response

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


_NOTHING = object()  # no reply queued right now


def _queued_reply(rx: Replies) -> Reply | None | object:
    """The next decodable reply if one is queued already: ``_NOTHING`` if none is, None if the
    channel has ended (never waits)."""
    while True:
        try:
            text, _t_recv = rx.receive_nowait()
        except trio.WouldBlock:
            return _NOTHING
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        try:
            return reply_decoder.decode(text)
        except msgspec.DecodeError:
            log.warning("ignoring an undecodable frame from the runner: %.200s", text)


def _error_text(reply: Reply) -> str:
    if isinstance(reply.error, str) and reply.error:
        return reply.error
    if reply.error is None:
        return "the runner reported an error"
    return msgspec.json.encode(reply.error).decode()


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
    fields = {"type": protocol.COMPLETION_REQUEST, "jobId": job_id, "requestId": rid}
    if traceparent is not None:
        fields["traceparent"] = traceparent
    return protocol.encode(fields)[:-1] + ',"body":' + body + "}"


async def send_cancel(turn: Turn) -> None:
    """``chat.completion.cancel`` for a turn nobody reads any more (shielded, bounded)."""
    frame = protocol.encode(
        {"type": protocol.COMPLETION_CANCEL, "jobId": turn.job_id, "requestId": turn.rid}
    )
    with trio.move_on_after(CANCEL_SEND_TIMEOUT) as scope:
        scope.shield = True
        try:
            await turn.ch.send(frame)
            log.info("sent chat.completion.cancel for request %s of job %s", turn.rid, turn.job_id)
        except Exception as exc:
            log.info("could not send chat.completion.cancel for request %s: %r", turn.rid, exc)


async def relay_stream(turn: Turn, rx: Replies, resp: Response, keepalive: float) -> None:
    """Relay a streamed turn as SSE. Chunk frames already queued when one is read go out with
    it, as one body write (nothing waits for more); a done frame right behind them ends it.
    Until the first chunk, a keepalive comment goes out after each quiet ``keepalive`` s."""
    headers = [*SSE_HEADERS, (b"x-request-id", turn.rid.encode())]
    first_chunk = False
    pending: Reply | None | object = _NOTHING  # a reply read ahead, to be handled next
    while True:
        if pending is not _NOTHING:
            reply, pending = pending, _NOTHING
        elif not first_chunk and keepalive > 0:
            with trio.move_on_after(keepalive) as wait:
                reply = await next_reply(rx)
            if wait.cancelled_caught:  # nothing yet: keep the client (and proxies) patient
                if not resp.started:
                    await resp.start(200, headers)
                await resp.body(KEEPALIVE)
                continue
        else:
            reply = await next_reply(rx)
        if reply is None:
            turn.lost = True
            message = "the chat channel to the runner was lost mid-turn"
            log.warning("%s (job %s, request %s)", message, turn.job_id, turn.rid)
            if not resp.started:
                raise channel_lost(message)
            await resp.body(stream_error_event(message, "channel_lost"), more=False)
            return
        assert isinstance(reply, Reply)
        if reply.type == protocol.COMPLETION_CHUNK:
            events: list[bytes] = []
            while True:
                if len(reply.chunk):
                    events.append(sse_data(reply.chunk))
                else:
                    log.warning("job %s: ignoring a chunk frame without a chunk", turn.job_id)
                pending = _queued_reply(rx)
                if pending is _NOTHING or pending is None:
                    break
                assert isinstance(pending, Reply)
                if pending.type != protocol.COMPLETION_CHUNK:
                    break
                reply, pending = pending, _NOTHING
            if not events:
                continue
            if not resp.started:
                await resp.start(200, headers)
            first_chunk = True
            if isinstance(pending, Reply) and pending.type == protocol.COMPLETION_DONE:
                turn.finished = True  # the last chunks and the end of the stream, in one write
                events.append(DONE_EVENT)
                await resp.body(b"".join(events), more=False)
                return
            await resp.body(events[0] if len(events) == 1 else b"".join(events))
        elif reply.type == protocol.COMPLETION_DONE:
            turn.finished = True
            if not resp.started:
                await resp.start(200, headers)
            await resp.body(DONE_EVENT, more=False)
            return
        elif reply.type == protocol.COMPLETION_ERROR:
            turn.finished = True
            message = _error_text(reply)
            log.info("runner error on job %s request %s: %s", turn.job_id, turn.rid, message)
            if not resp.started:
                raise upstream_error(message)
            await resp.body(stream_error_event(message, "upstream_error"), more=False)
            return


async def relay_whole(turn: Turn, rx: Replies, resp: Response) -> None:
    """Relay a non-streamed turn: every chunk gathered, then one ``chat.completion`` answer."""
    chunks: list[bytes] = []
    while True:
        reply = await next_reply(rx)
        if reply is None:
            turn.lost = True
            log.warning("chat channel lost mid-turn (job %s, request %s)", turn.job_id, turn.rid)
            raise channel_lost()
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
    await resp.whole(200, whole_completion(chunks), [(b"x-request-id", turn.rid.encode())])
