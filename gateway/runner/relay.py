"""One turn's answer relayed: each backend read's chunk payloads offered as frames at once.

``Relay.answer`` relays one backend answer to its turn's frames: a streamed one
(``text/event-stream``) read by read by a ``Pump``, a whole JSON one as one chunk; then the
done frame. ``Pump.pump`` is the whole per-read path and never waits: one ``recv`` of what has
arrived, one ``feed`` of it to its ``EventStream`` (no I/O there: the HTTP parse, the SSE
split, each payload checked, never re-encoded) and one offer of the chunk frames to the
channel, which writes them at once when no write is in progress (``WebSocket.offer``). The
runner's ``Poller`` calls it for every streaming turn whose socket is ready; ``Pump.run`` is
the turn's own side: it pumps what came with the head, hands the turn to the poller, and does
every wait (room in the channel, or readability where there is no poller) in the turn's task,
under its cancel scopes.

A turn whose channel negotiated a resume (docs/protocol.md §6) also keeps each read's frames,
by reference, in the channel's ``ResumeBuffer`` (one append per read, nothing per chunk), and
goes on when its channel drops: its outlet is then one that takes every frame and sends none,
until a redialled channel resumes it (``Pump.bind``). After a backend's fault, a turn continued
on another backend has its payloads stitched (``stitch``) before they are framed.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Protocol

import trio

from gateway.observe import Histogram
from gateway.runner.poller import END, IDLE, MORE, ROOM, Poller
from gateway.runner.turn import Turn
from gateway.wire import http1
from gateway.wire.netio import RECV_SIZE
from gateway.wire.stream import BadPayload, EventStream, ExchangeFailed, lost, payload_problem
from gateway.wire.wsclient import ChannelClosed

StitchPayloads = Callable[[list[bytes]], list[bytes]]  # a continuation's payloads as the turn's own

_CHECKPOINT_EVERY = 16  # reads in a row that filled the buffer before a checkpoint of our own
_DRAIN_AFTER_DONE = 2.0  # s: after [DONE], how long the rest of the response may take (reuse)
CONTINUE_KEEP_CHUNKS = 32768  # chunks a turn keeps for a continuation; past them, none


class Outlet(Protocol):
    """Where a channel's frames go (its ``WebSocket``). ``offer``/``offer_batch`` write one
    frame / several ready together without waiting (False: more than the buffer's worth is
    waiting, ``wait_room`` before the next); ``send`` writes one and waits for room."""

    def offer(self, message: bytes) -> bool: ...

    def offer_batch(self, messages: list[bytes]) -> bool: ...

    async def wait_room(self) -> None: ...

    async def send(self, message: bytes | str) -> None: ...


class Down:
    """The outlet of a channel that is down while its turns go on to be resumed: every frame
    taken (their ``ResumeBuffer`` keeps them), none sent, never a wait."""

    __slots__ = ()

    def offer(self, message: bytes) -> bool:
        return True

    def offer_batch(self, messages: list[bytes]) -> bool:
        return True

    async def wait_room(self) -> None:
        return

    async def send(self, message: bytes | str) -> None:
        return


DOWN = Down()


class Relay:
    """A channel's relay of its turns' answers: where the frames go (``out``), the poller
    that reads the streaming turns' sockets (None: each turn reads its own), and what is
    measured (time to first token, and backend read -> frames written)."""

    __slots__ = ("out", "poller", "ttft", "seconds", "now")

    def __init__(
        self, out: Outlet, poller: Poller | None, ttft: Histogram, seconds: Histogram
    ) -> None:
        self.out = out
        self.poller = poller
        self.ttft = ttft
        self.seconds = seconds
        self.now = trio.lowlevel.current_clock().current_time  # trio.current_time, bound

    async def answer(
        self, turn: Turn, response: http1.ClientResponse, stitch: StitchPayloads | None = None
    ) -> None:
        """Relay a 2xx answer whose head is in to ``turn``'s chunk frames, then its done
        frame. ``BadPayload`` or ``ExchangeFailed`` (the backend's fault) when it cannot; what was
        relayed is on ``turn`` (``chunks``, ``last_payload``) whatever happens. ``stitch``: the
        payloads are a continuation's, made the turn's own before they are framed."""
        if b"text/event-stream" not in (response.header(b"content-type") or b""):
            payload = (await response.read_body()).strip()
            problem = payload_problem(payload)
            if problem is not None:
                raise BadPayload(f"answered {problem}")
            turn.first_token = self.now()
            if turn.span is not None:
                turn.span.first_token()
            await self.last(turn, [payload], stitch)
            return
        # the decoder is the pump's and this call's, never the turn's: a turn that ended is
        # kept a while for a resume (``linger``), and with its decoder it kept the answer's
        # parser and buffers, most of what the collector walked under load
        stream = EventStream(response.parser)
        await Pump(turn, stream, response, self, stitch).run()
        if stream.done:  # the rest of the response is read (briefly), so the connection is reused
            if response.complete:  # it came with [DONE]: the usual case
                return
            with trio.move_on_after(_DRAIN_AFTER_DONE):
                try:
                    await response.discard_rest()
                except ExchangeFailed:
                    pass  # the turn is done; the connection is just not kept
            return
        await self.last(turn, stream.finish(), stitch)  # a last event without its blank line

    async def chunks(
        self, turn: Turn, payloads: list[bytes], stitch: StitchPayloads | None
    ) -> None:
        """Send chunk frames off the per-read path (a whole answer, a last event), each waiting
        for room: kept, stitched and counted as the pump does."""
        if stitch is not None:
            payloads = stitch(payloads)
        if turn.relayed is not None:
            turn.relayed.append(payloads)
        for payload in payloads:
            frame = turn.frames.chunk(payload)
            keep = turn.keep
            if keep is not None:
                keep.add(turn, frame)
            turn.chunks += 1
            turn.last_payload = payload
            await self._send(turn, frame)

    async def last(self, turn: Turn, payloads: list[bytes], stitch: StitchPayloads | None) -> None:
        """``chunks`` and then the done frame, all in one write (a whole answer's one chunk and
        its done frame cost one frame write and one ``send``, not two)."""
        if stitch is not None:
            payloads = stitch(payloads)
        if turn.relayed is not None:
            turn.relayed.append(payloads)
        template = turn.frames.template
        frames = [template % payload for payload in payloads]
        keep = turn.keep
        if keep is not None:
            for frame in frames:
                keep.add(turn, frame)
                turn.chunks += 1
        else:
            turn.chunks += len(frames)
        if payloads:
            turn.last_payload = payloads[-1]
        turn.end_frame = done = turn.frames.done
        frames.append(done)
        out = self.out
        try:
            if not out.offer_batch(frames):
                await out.wait_room()
        except ChannelClosed:
            if keep is None:
                raise
            keep.lost(out)  # kept: a redial may resume it

    async def end(self, turn: Turn, frame: bytes) -> None:
        """Send a turn's done or error frame (kept as its end frame when it keeps frames)."""
        turn.end_frame = frame
        await self._send(turn, frame)

    async def _send(self, turn: Turn, frame: bytes) -> None:
        keep = turn.keep
        out = self.out
        if keep is None:
            await out.send(frame)
            return
        try:
            await out.send(frame)
        except ChannelClosed:  # kept: a redial may resume it
            keep.lost(out)


class Pump:
    """One streaming turn as the poller (or its own task) pumps it: its backend socket read
    by read, each read's chunk frames offered at once."""

    __slots__ = (
        "fd",
        "handback",
        "state",
        "error",
        "_turn",
        "_stream",
        "_response",
        "_recv",
        "_template",
        "_out",
        "_offer",
        "_offer_batch",
        "_wait_room",
        "_keep",
        "_relayed",
        "_stitch",
        "_relay",
        "_observe",
        "_now",
        "_move_at",
    )

    def __init__(
        self,
        turn: Turn,
        stream: EventStream,
        response: http1.ClientResponse,
        relay: Relay,
        stitch: StitchPayloads | None = None,
    ) -> None:
        self.fd = response.fileno()
        self.handback: trio.Event | None = None  # set by the poller when it gives the turn back
        self.state = IDLE
        self.error: Exception | None = None
        self._turn = turn
        self._stream = stream
        self._response = response
        self._recv = response.recv
        self._template = turn.frames.template
        self.bind(relay.out)
        self._keep = turn.keep  # where its frames are kept for a resume (None: they are not)
        self._relayed = turn.relayed  # where its payloads are kept for a continuation
        self._stitch = stitch
        turn.pump = self
        self._relay = relay
        self._observe = relay.seconds.observe
        self._now = relay.now
        self._move_at = response.fresh_until()  # set as the request went: no move needed yet

    def pump(self, head: bool = False) -> int:
        """Relay what has arrived, without waiting: ``IDLE`` (the socket is empty), ``MORE``
        (the read filled the buffer), ``ROOM`` (wait for room first) or ``END`` (the end, or
        the turn was stopped: its task ends it, and no frame may follow). ``head``: relay the
        body bytes that came with the head; every other call reads the socket once."""
        turn = self._turn
        if turn.stopped is not None:  # an attribute: cancel_called would read the clock
            return END
        if head:
            data = None
        else:
            try:
                data = self._recv(RECV_SIZE)
            except BlockingIOError:
                return IDLE
            except (OSError, ssl.SSLError) as exc:
                raise lost(exc) from None
        read_at = self._now()
        if read_at >= self._move_at:  # one idle deadline, moved forward now and then
            self._move_at = self._response.keep_idle(read_at)
        stream = self._stream
        payloads = stream.feed(data)
        room = True
        last = False  # this read's frames went out with the done frame
        if payloads:
            if turn.first_token is None:
                self._first_token(read_at)
            if self._stitch is not None:  # a continuation after a backend's fault
                payloads = self._stitch(payloads)
            relayed = self._relayed
            if relayed is not None:  # kept (by reference) for a continuation, bounded
                relayed.append(payloads)
                if turn.chunks >= CONTINUE_KEEP_CHUNKS:
                    self._relayed = turn.relayed = None
            n = len(payloads)
            if stream.done:  # the last read: its frames and the done frame in one write
                self._last(payloads)
                last = True
            elif self._keep is not None:  # kept (by reference) for a resume
                room = self._kept(payloads)
            elif n == 1:  # written now, unless a write is in progress
                room = self._offer(self._template % payloads[0])
            elif n:  # ready together: one write
                template = self._template
                room = self._offer_batch([template % p for p in payloads])
            if n:
                turn.chunks += n
                turn.last_payload = payloads[-1]
            self._observe(self._now() - read_at)  # backend read -> frames written
        if stream.done:
            if not last:  # [DONE] came in a read of no chunk
                turn.end_frame = done = turn.frames.done
                self._offer_done(done)
            return END
        if stream.ended:
            return END
        if not room:
            return ROOM
        return MORE if data is not None and len(data) == RECV_SIZE else IDLE

    def _kept(self, payloads: list[bytes]) -> bool:
        """``pump``'s offer for a turn that keeps its frames: one entry in the resume buffer
        for the read, then the offer; a channel found closed here is not the turn's end."""
        keep = self._keep
        assert keep is not None
        template = self._template
        if len(payloads) == 1:
            frame = template % payloads[0]
            keep.add(self._turn, frame)
            try:
                return self._offer(frame)
            except ChannelClosed:
                keep.lost(self._out, unsent=1)
                return True
        frames = [template % p for p in payloads]
        keep.add_batch(self._turn, frames)
        try:
            return self._offer_batch(frames)
        except ChannelClosed:
            keep.lost(self._out, unsent=1)
            return True

    def _last(self, payloads: list[bytes]) -> None:
        """``pump``'s offer for the read that ends the stream: its chunk frames (kept, for a
        resume, as one entry) and the done frame, in one write."""
        turn = self._turn
        template = self._template
        frames = [template % p for p in payloads]
        keep = self._keep
        if keep is not None and frames:
            keep.add_batch(turn, frames)
            frames = [*frames]  # the entry kept is the chunk frames alone
        turn.end_frame = done = turn.frames.done
        frames.append(done)
        try:
            self._offer_batch(frames)
        except ChannelClosed:
            if keep is None:
                raise
            keep.lost(self._out, unsent=1)

    def _offer_done(self, done: bytes) -> None:
        if self._keep is None:
            self._offer(done)
            return
        try:
            self._offer(done)
        except ChannelClosed:
            self._keep.lost(self._out)

    def bind(self, out: Outlet) -> None:
        """Send through ``out`` from now on: the channel's socket, or ``DOWN`` while it is down."""
        self._out = out
        self._offer = out.offer
        self._offer_batch = out.offer_batch
        self._wait_room = out.wait_room

    def _first_token(self, read_at: float) -> None:
        turn = self._turn
        turn.first_token = read_at
        self._relay.ttft.observe(read_at - turn.arrived)
        if turn.span is not None:
            turn.span.first_token()

    async def run(self) -> None:
        """Relay until the response ends: in the poller's task while other turns stream too,
        else here (a lone stream saves the poller's extra epoll round per read). Waits for
        room in the channel when too much is waiting there."""
        poller = self._relay.poller
        streak = 0
        if poller is not None:
            poller.enter()
        try:
            state = self.pump(head=True)
            while True:
                if state == IDLE:
                    if poller is None or poller.alone:
                        await trio.lowlevel.wait_readable(self.fd)
                        streak = 0
                        state = self.pump()
                        continue
                    state = await poller.follow(self)
                if state == END:
                    stream = self._stream
                    if not (stream.done or stream.ended):  # stopped: its scope is cancelled,
                        await trio.lowlevel.checkpoint()  # this raises Cancelled
                    return  # whole (a stop that came after its done frame is too late)
                if state == ROOM:
                    await self._room()
                    streak = 0
                elif state == MORE:
                    streak += 1
                    if streak >= _CHECKPOINT_EVERY:  # reads that keep finding data: stay fair
                        await trio.lowlevel.checkpoint()
                        streak = 0
                state = self.pump()
        finally:
            if poller is not None:
                poller.leave()
            self._turn.pump = None

    async def _room(self) -> None:
        if self._keep is None:
            await self._wait_room()
            return
        out = self._out
        try:
            await self._wait_room()
        except ChannelClosed:  # kept: a redial may resume it
            self._keep.lost(out)
