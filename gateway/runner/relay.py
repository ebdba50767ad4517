"""One turn's streamed answer: each backend read becomes chunk frames, written as it is split.

``SSERelay.pump`` is the whole per-read path and never waits: one ``recv`` of what has
arrived, httptools' parse of it, the SSE split, a check of every payload (JSON, UTF-8; it
is never re-encoded) and the chunk frames offered to the channel, which writes them at once
when no write is in progress (``WebSocket.offer``). The runner's ``Poller`` calls it for
every streaming turn whose socket is ready; ``run`` is the turn's own side: it pumps what
came with the head, hands the turn to the poller, and does every wait (room in the channel,
or readability where there is no poller) in the turn's task, under its cancel scopes.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Container
from typing import TYPE_CHECKING

import httptools
import msgspec
import trio

from gateway.observe import Histogram
from gateway.runner.poller import END, IDLE, MORE, ROOM, Poller
from gateway.wire import http1
from gateway.wire.netio import RECV_SIZE
from gateway.wire.protocol import TurnFrames
from gateway.wire.sse import SSESplitter

if TYPE_CHECKING:  # imported only when tracing is on (Runner.run: gateway.ops.otel.Tracing.start)
    from gateway.ops.otel import TurnTrace

DONE = b"[DONE]"
_validate_json = msgspec.json.Decoder(msgspec.Raw).decode
_DEADLINE_SLACK = 16  # the idle deadline moves once 1/16 of the timeout has passed, not per read
_CHECKPOINT_EVERY = 16  # reads in a row that filled the buffer before a checkpoint of our own


class TurnFailed(Exception):
    """The turn cannot be served; the message is safe for a frame (no key)."""


class SSERelay:
    """The relay of one ``text/event-stream`` response to one turn's chunk frames.

    ``offer``/``offer_batch`` write one frame / several frames ready together, without
    waiting; False means the channel has more than its buffer waiting (``wait_room``)."""

    __slots__ = (
        "response",
        "fd",
        "handback",
        "state",
        "error",
        "chunks",
        "last_payload",
        "done",
        "cancelled",
        "_url",
        "_template",
        "_offer",
        "_offer_batch",
        "_done_frame",
        "_splitter",
        "_recv",
        "_parse",
        "_request_id",
        "_stopped",
        "_full",
        "_first",
        "_started",
        "_ttft",
        "_observe",
        "_now",
        "_span",
        "_move_at",
        "_step",
    )

    def __init__(
        self,
        response: http1.Response,
        *,
        url: str,
        frames: TurnFrames,
        offer: Callable[[bytes], bool],
        offer_batch: Callable[[list[bytes]], bool],
        request_id: str,
        stopped: Container[str],
        started: float,
        ttft: Histogram,
        relay: Histogram,
        span: TurnTrace | None = None,
    ) -> None:
        self.response = response
        transport = response.transport
        self.fd = transport.sock.fileno()
        self.handback: trio.Event | None = None  # set by the poller when it gives the turn back
        self.state = IDLE
        self.error: Exception | None = None
        self.chunks = 0
        self.last_payload = b""  # the last event relayed (the usage chunk, if any)
        self.done = False  # [DONE] came (and its done frame was offered)
        self.cancelled = False  # the channel cancelled the turn: nothing more is sent
        self._url = url
        self._template = frames.template
        self._done_frame = frames.done
        self._offer = offer
        self._offer_batch = offer_batch
        self._splitter = SSESplitter()
        self._recv = transport.recv
        self._parse = response.parser.feed_data
        self._request_id = request_id
        self._stopped = stopped  # the request ids of the turns the channel has cancelled
        self._full = False
        self._first = True
        self._started = started
        self._ttft = ttft
        self._observe = relay.observe
        self._now = trio.lowlevel.current_clock().current_time
        self._span = span
        self._step = response.idle_timeout / _DEADLINE_SLACK
        self._move_at = trio.current_time() + self._step

    def pump(self) -> int:
        """Relay what has arrived, without waiting: ``IDLE`` (the socket is empty), ``MORE``
        (the read filled the buffer), ``ROOM`` (wait for room first) or ``END`` (the end, or
        the channel cancelled the turn: its task ends it, and no frame may follow). The first
        call relays what came with the head; each later one reads the socket once."""
        if self._request_id in self._stopped:  # a dict lookup: cancel_called reads the clock
            self.cancelled = True
            return END
        response = self.response
        data = b""
        if response.body:  # what came with the head
            read_at = self._now()
        elif response.complete:
            return END
        else:
            try:
                try:
                    data = self._recv(RECV_SIZE)
                except BlockingIOError:
                    return IDLE
                read_at = self._now()
                if data:
                    self._parse(data)
                else:
                    response.end_of_stream()
            except httptools.HttpParserError as exc:
                raise http1.ProtocolError(f"sent a malformed HTTP response ({exc})") from None
            except (OSError, ssl.SSLError) as exc:
                raise http1.ConnectionLost(f"connection broke ({type(exc).__name__})") from None
            if read_at >= self._move_at:  # one idle deadline, moved forward now and then
                idle = response.idle
                if idle is not None:
                    idle.deadline = read_at + response.idle_timeout
                self._move_at = read_at + self._step
            if not response.body:  # a chunk's head, or the body's end
                if response.complete:
                    return END
                return MORE if len(data) == RECV_SIZE else IDLE
        pieces = response.body
        response.body = []
        if self._first:
            self._first = False
            self._ttft.observe(read_at - self._started)
            if self._span is not None:
                self._span.first_token()
        feed = self._splitter.feed
        template = self._template
        for raw in pieces:
            payloads = feed(raw)
            if not payloads:
                continue
            done = DONE in payloads
            if done:
                payloads = payloads[: payloads.index(DONE)]
            for payload in payloads:  # payload_problem, inlined: this runs per chunk
                try:
                    _validate_json(payload)
                except msgspec.DecodeError:
                    raise TurnFailed(f"backend {self._url} sent a malformed SSE event") from None
                if not payload.isascii() and not is_utf8(payload):
                    raise TurnFailed(f"backend {self._url} sent an SSE event that is not UTF-8")
            if len(payloads) == 1:  # written now, unless a write is in progress
                room = self._offer(template % payloads[0])  # TurnFrames.chunk
            elif payloads:  # ready together: one write
                room = self._offer_batch([template % p for p in payloads])
            else:
                room = True
            if payloads:
                self.chunks += len(payloads)
                self.last_payload = payloads[-1]
            if not room:
                self._full = True
            if done:
                self.done = True
                self._offer(self._done_frame)
                return END
        self._observe(self._now() - read_at)  # backend read -> frames written
        if response.complete:
            return END
        if self._full:
            self._full = False
            return ROOM
        return MORE if len(data) == RECV_SIZE else IDLE

    async def run(self, poller: Poller | None, wait_room: Callable[[], Awaitable[None]]) -> None:
        """Relay until the response ends: in the poller's task while other turns stream too,
        else here (a lone stream saves the poller's extra epoll round per read).
        ``wait_room`` is awaited when the channel has too much waiting."""
        streak = 0
        if poller is not None:
            poller.streaming += 1
        try:
            while True:
                state = self.pump()
                if state == IDLE:
                    if poller is None or poller.streaming == 1:
                        await trio.lowlevel.wait_readable(self.fd)
                        streak = 0
                        continue
                    state = await poller.follow(self)
                if state == END:
                    if self.cancelled:  # the turn's scope is cancelled: this raises Cancelled
                        await trio.lowlevel.checkpoint()
                    return
                if state == ROOM:
                    await wait_room()
                    streak = 0
                elif state == MORE:
                    streak += 1
                    if streak >= _CHECKPOINT_EVERY:  # reads that keep finding data: stay fair
                        await trio.lowlevel.checkpoint()
                        streak = 0
        finally:
            if poller is not None:
                poller.streaming -= 1

    def rest(self) -> list[bytes]:
        """At the end of the stream: the payload of a last event that had no blank line."""
        return [p for p in self._splitter.flush() if p != DONE]


def payload_problem(payload: bytes) -> str | None:
    """Why a payload cannot go into a frame unchanged, or None when it can."""
    try:
        _validate_json(payload)
    except msgspec.DecodeError:
        return "malformed (not JSON)"
    return None if is_utf8(payload) else "not UTF-8"


def is_utf8(data: bytes) -> bool:
    """A payload goes into a text frame: it must be UTF-8 (JSON validation does not check)."""
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
