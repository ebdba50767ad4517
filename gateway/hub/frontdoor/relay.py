"""One turn's relay: request frame down, replies up as SSE (bytes verbatim) or one completion."""

from __future__ import annotations

import logging
import math
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


async def relay_stream(
    turn: Turn, rx: Replies, resp: Response, keepalive: float, first_within: float = math.inf
) -> None:
    """Relay a streamed turn as SSE. Chunk frames already queued when one is read go out with
    it, as one body write (nothing waits for more); a done frame right behind them ends it.
    Until the first chunk, a keepalive comment goes out after each quiet ``keepalive`` s while
    the channel is open (the hub's pings close a silent one); with pings off the wait for the
    first frame is bounded by ``first_within`` s. TurnLost when the channel ends (or stays
    silent that long) before the first chunk."""
    headers = [*SSE_HEADERS, (b"x-request-id", turn.rid.encode())]
    first_chunk = False
    first_frame_by = trio.current_time() + first_within
    pending: Reply | None | object = _NOTHING  # a reply read ahead, to be handled next
    while True:
        if pending is not _NOTHING:
            reply, pending = pending, _NOTHING
        elif not first_chunk:
            wait_until = first_frame_by
            if keepalive > 0:
                wait_until = min(wait_until, trio.current_time() + keepalive)
            with trio.move_on_at(wait_until) as wait:
                reply = await next_reply(rx)
            if wait.cancelled_caught:
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
                if turn.ch.closed.is_set():
                    continue  # the channel is gone: the next read says so
                if not resp.started:  # nothing yet: keep the client (and proxies) patient
                    await resp.start(200, headers)
                await resp.body(KEEPALIVE)
                continue
            first_frame_by = math.inf
        else:
            reply = await next_reply(rx)
        if reply is None:
            turn.lost = True
            if not first_chunk:
                raise TurnLost()
            message = "the chat channel to the runner was lost mid-turn"
            log.warning("%s (job %s, request %s)", message, turn.job_id, turn.rid)
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


async def relay_whole(
    turn: Turn, rx: Replies, resp: Response, first_within: float = math.inf
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
    await resp.whole(200, whole_completion(chunks), [(b"x-request-id", turn.rid.encode())])
