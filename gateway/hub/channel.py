"""A runner's Chat Channel, the Server's end: every frame it reads goes to the sink its request
id names.

Each read's text messages are decoded once, where they are read, into the typed Structs of
``gateway.wire.protocol`` (a chunk's payload stays a ``msgspec.Raw``: never parsed, never
re-encoded). A chunk goes to its turn's ``Sink`` at once; after the read, each sink that got
chunks is told to ``flush`` (one write to its client per read). Done, error and models frames go
to the sink too; a frame for no open request goes to ``unrouted`` (a runner's ``chat.end`` is
noted there). Nothing is queued in between and no other task is woken per chunk.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import msgspec
import trio

from gateway.hub.board import Changes, JobBoard
from gateway.hub.counters import HubCounters
from gateway.wire import protocol
from gateway.wire.errors import ClientGone
from gateway.wire.protocol import (
    CONTINUE,
    EMBEDDINGS,
    LIVENESS,
    RESUME,
    ChunkFrame,
    DoneFrame,
    EndFrame,
    ErrorFrame,
    HelloFrame,
    ModelsFrame,
)
from gateway.wire.server import ServerWebSocket

log = logging.getLogger("gateway.hub")

CLOSE_REPLACED = 4000  # an old channel replaced by a new connection for the same job
CLOSE_OFFLINE = 1001  # the runner was declared offline
# ended with no close handshake, failed for a protocol violation, or silent past the ping timeout
DEAD_CODES = (1002, 1006, 1007, 1008, 1009, 1011)
# docs/protocol.md §6: what this Server's hello offers
EXTENSIONS = [RESUME, CONTINUE, EMBEDDINGS, LIVENESS]
CLOSE_WAIT = 5.0  # s: ``close`` waits this long for the reader to end

RunnerFrame = ChunkFrame | DoneFrame | ErrorFrame | ModelsFrame | EndFrame
Reply = DoneFrame | ErrorFrame | ModelsFrame  # what ends a request


class Sink(Protocol):
    """Where a channel's reader puts one request's frames, as they are read."""

    def chunk(self, chunk: msgspec.Raw, frame: bytes) -> None:
        """One chunk frame's payload, in order (``frame``: the whole frame, searchable without
        a copy)."""

    def flush(self) -> None:
        """Every chunk of the read at hand is in."""

    def reply(self, frame: Reply) -> None:
        """The frame that ends the request: done, error, or the models answer (after the
        request's chunks of the same read, not flushed yet: written with the end, in one go)."""

    def lost(self) -> bool:
        """The channel ended before the request's end; True when the request waits for the
        job's redialled channel to resume it (``Channels.accept`` names it in the hello)."""

    def resume_count(self) -> int | None:
        """How many chunk frames of the request arrived (what a resume names); None when it
        is not to be resumed (its client gone)."""

    def resumed(self) -> None:
        """The request goes on, on the job's redialled channel."""


class _Lenient(msgspec.Struct):
    """A runner frame that did not fit its type (a field of another type, ``jobId`` missing):
    read leniently, then made the typed frame it meant to be (``_lenient``)."""

    type: Any = None
    requestId: Any = None
    jobId: Any = None
    chunk: msgspec.Raw = msgspec.Raw(b"")
    error: Any = None
    models: Any = None
    reason: Any = None


_decode = msgspec.json.Decoder(RunnerFrame).decode
_decode_lenient = msgspec.json.Decoder(_Lenient).decode
_CHUNK = ChunkFrame


def model_ids(models: Any) -> list[str]:
    """The model ids of a ``chat.models.response`` (strings, or objects with an ``id``)."""
    out: list[str] = []
    for item in models if isinstance(models, list) else []:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("id"), str):
            out.append(item["id"])
    return out


def _lenient(text: bytes) -> RunnerFrame | None:
    """The typed frame a frame that failed strict decoding meant, or None (not JSON, an unknown
    type, no request id where one is needed)."""
    try:
        found = _decode_lenient(text)
    except (msgspec.DecodeError, RecursionError):
        return None
    kind, rid = found.type, found.requestId
    job = found.jobId if isinstance(found.jobId, str) else ""
    if kind == protocol.END:
        return EndFrame(job, found.reason if isinstance(found.reason, str) else "")
    if not isinstance(rid, str):
        return None
    if kind == protocol.COMPLETION_CHUNK:
        return ChunkFrame(job, rid, found.chunk)
    if kind == protocol.COMPLETION_DONE:
        return DoneFrame(job, rid)
    if kind == protocol.COMPLETION_ERROR:
        error = found.error
        if not isinstance(error, str) or not error:
            error = (
                "the runner reported an error"
                if error is None
                else msgspec.json.encode(error).decode(errors="replace")
            )
        return ErrorFrame(job, rid, error)
    if kind == protocol.MODELS_RESPONSE:
        return ModelsFrame(job, rid, model_ids(found.models))
    return None


class ServerChannel:
    """One accepted Chat Channel WebSocket: its reader (the connection's own task, ``serve``)
    hands each frame to the sink its request id names (``open``); ``send`` writes a frame."""

    local = True  # this replica's own (a RemoteChannel: another's, which answers only turns)

    def __init__(
        self, job_id: str, runner_id: str, ws: ServerWebSocket | None, channels: Channels
    ) -> None:
        self.job_id = job_id
        self.runner_id = runner_id
        self.closed = trio.Event()
        self._ws = ws
        self._channels = channels
        self._sinks: dict[str, Sink] = {}
        self._close_code: int | None = None
        self._terminated = trio.Event()
        self.end_code: int | None = None  # the close code the channel ended with
        self.runner_ended = False  # the runner sent chat.end on it
        self.hello = b""  # its first frame (``Channels.accept``): sent before any other
        # set while its hello is being made (a team's replica reads the store for it): other
        # frames wait for it, so that the hello is the first frame the runner reads
        self.held: trio.Event | None = None
        self.undecodable = 0  # frames that were not a runner frame (ignored)
        # frames for no open request (late ones, chat.end; undecodable ones as None), with the
        # frame's text; by default ``_note``d (a Server of its own, a test, may take them)
        self.unrouted: Callable[[RunnerFrame | None, bytes], None] = self._note

    def __repr__(self) -> str:
        state = "closed" if self.closed.is_set() else "open"
        return f"<ServerChannel job={self.job_id} runner={self.runner_id} {state}>"

    @property
    def requests(self) -> int:
        """Requests open on the channel now."""
        return len(self._sinks)

    @property
    def backlog(self) -> int:
        """Bytes written to the channel that its socket has not taken yet (a runner that reads
        slowly, or not at all)."""
        ws = self._ws
        return 0 if ws is None else len(ws.transport.unsent)

    async def send(self, frame: bytes) -> bool:
        """Send one frame (UTF-8 JSON text, ``protocol.encode_frame``'s); False when the channel
        is closed or broke under the send (it is ended then: a normal outcome, not an error)."""
        if self.held is not None:
            await self.held.wait()
        if self.closed.is_set() or self._ws is None:
            return False
        try:
            await self._ws.send_text(frame)
        except ClientGone as exc:
            log.debug("channel %s: send failed: %r", self.job_id, exc)
            # ended now, not once its reader notices: the turns that wait on it move on at once
            # (else a retry finds it still open and fails on it again)
            if self._close_code is None:
                self._close_code = 1006
            self._finish()
            return False
        return True

    def open(self, request_id: str, sink: Sink) -> None:
        """Hand the frames of ``request_id`` to ``sink`` as they are read (``lost`` at once on a
        closed channel)."""
        if request_id in self._sinks:
            raise ValueError(f"request {request_id!r} is already open on this channel")
        if self.closed.is_set():
            sink.lost()
        else:
            self._sinks[request_id] = sink

    def routes(self, request_id: str) -> bool:
        """Whether ``request_id`` is open here (its end not read yet)."""
        return request_id in self._sinks

    def close_request(self, request_id: str) -> None:
        """Stop routing ``request_id``; later frames of it are unrouted."""
        self._sinks.pop(request_id, None)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close the WebSocket and wait (bounded) for its reader to end (``code`` != 1000
        simulates a dropped channel)."""
        self.request_close(code, reason)
        with trio.move_on_after(CLOSE_WAIT):
            await self._terminated.wait()

    def request_close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close without waiting: the channel ends now, the close frame is written at once."""
        if self._close_code is None and not self._terminated.is_set():
            self._close_code = code
        if self._ws is not None:
            self._ws.close_nowait(code, reason or "")
        self._finish()

    # -- the reader ----------------------------------------------------------------------

    async def on_texts(self, texts: list[bytes]) -> None:
        """One read's text messages, in order: each decoded once and handed to its sink; each
        sink that got chunks flushed once, after the read."""
        self._channels.board.seen(self.runner_id)
        sinks = self._sinks
        dirty: dict[int, Sink] | None = None
        for text in texts:
            try:
                frame: Any = _decode(text)
            except msgspec.ValidationError:
                frame = _lenient(text)
            except (msgspec.DecodeError, RecursionError):
                frame = None
            if frame is None:
                self.unrouted(None, text)
                continue
            if frame.__class__ is _CHUNK:
                sink = sinks.get(frame.requestId)
                if sink is not None:
                    sink.chunk(frame.chunk, text)
                    if dirty is None:
                        dirty = {id(sink): sink}
                    else:
                        dirty[id(sink)] = sink
                    continue
            elif frame.__class__ is not EndFrame:
                sink = sinks.pop(frame.requestId, None)
                if sink is not None:
                    if dirty is not None:
                        dirty.pop(id(sink), None)  # its reply writes what it holds, with its end
                    sink.reply(frame)
                    continue
            self.unrouted(frame, text)
        if dirty is not None:
            for sink in dirty.values():
                sink.flush()

    def _note(self, frame: RunnerFrame | None, text: bytes = b"") -> None:
        """What happens to an unrouted frame by default: a runner's chat.end is noted (no
        redial will come), anything else was late (its request was closed) and is dropped."""
        if frame is None:
            self.undecodable += 1
            if self.undecodable == 1:
                log.info("channel %s: ignoring a frame that is not a runner frame", self.job_id)
        elif isinstance(frame, EndFrame):
            self.runner_ended = True
            self._channels.runner_ended.add(self.job_id)
            log.info("job %s: the runner ended the session (%s)", self.job_id, frame.reason)
            self._channels.changes.notify()

    def _finish(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        sinks = list(self._sinks.items())
        self._sinks.clear()
        for request_id, sink in sinks:
            if sink.lost():
                self._channels.suspend(self.job_id, request_id, sink)
        self._channels.gone(self)

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
        # job ids whose runner sent chat.end (no redial), until the job leaves the board
        self.runner_ended: set[str] = set()
        board.on_forget.append(self.runner_ended.discard)
        # when the hub read its jobs back at start, and those of them whose channel has not
        # come back since (their runners' redials are waited for a moment: ``Dispatcher``)
        self.restored_at: float | None = None
        self.awaited: set[str] = set()
        # requests whose channel dropped mid-answer, by job: resumed when the job's channel is
        # accepted again (the hello names each with its count), unless given up first
        self.suspended: dict[str, dict[str, Sink]] = {}
        # told of each channel accepted (the catalog asks it for its models)
        self.on_open: list[Callable[[ServerChannel], None]] = []
        # told of each channel of this hub gone, and of each request suspended (a replica
        # writes them down for the others); a job's channel another hub holds is found by the
        # board's coordination (``remote_channel``)
        self.on_gone: list[Callable[[ServerChannel], None]] = []
        self.on_suspend: list[Callable[[str, str, Sink], None]] = []
        self.coordination = board.coordination

    def get(self, job_id: str) -> ServerChannel | None:
        """The job's current open channel (on replicas, perhaps one another replica holds),
        or None."""
        ch = self._open.get(job_id)
        if ch is None:
            found: ServerChannel | None = self.coordination.remote_channel(job_id)
            return found
        return ch

    def local(self, job_id: str) -> ServerChannel | None:
        """The job's open channel on this hub, or None."""
        return self._open.get(job_id)

    def all(self) -> list[ServerChannel]:
        """Every open channel."""
        return list(self._open.values())

    def runners(self) -> set[str]:
        """Runner ids with an open channel."""
        return {ch.runner_id for ch in self._open.values()}

    def accept(self, job_id: str, runner_id: str, ws: ServerWebSocket | None) -> ServerChannel:
        """A new channel for the job (its handshake accepted); an older one is closed. Its
        ``hello`` is the first frame to send on it: the extensions, and the requests it
        resumes (those of a dropped channel of the job) with their counts."""
        ch = ServerChannel(job_id, runner_id, ws, self)
        if ws is not None:  # its pongs are its runner's sign of life: one signal per session
            ws.on_alive = partial(self.board.seen, runner_id)
        self.awaited.discard(job_id)
        old = self._open.get(job_id)
        moved: set[str] = set()
        if old is not None:  # its runner redialled, so it is dead to it (found before the hub's
            moved = set(old._sinks)  # keepalive did): its turns suspended now, resumed below
            old._finish()
            old.request_close(CLOSE_REPLACED, "replaced by a new connection")
        self._open[job_id] = ch
        counts: dict[str, int] = {}
        for rid, sink in self.suspended.pop(job_id, {}).items():
            count = sink.resume_count()
            if count is not None:
                counts[rid] = count
                ch.open(rid, sink)
                sink.resumed()
                if rid in moved:  # resumed before its turn saw it lost (else its turn counts it)
                    self.counters.turns_resumed += 1
        ch.hello = protocol.encode_frame(HelloFrame(job_id, EXTENSIONS, counts or None))
        self.changes.notify()
        for observe in self.on_open:
            observe(ch)
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
            for observe in self.on_gone:
                observe(ch)

    async def end_job(self, job_id: str, reason: str) -> None:
        """Send ``chat.end`` on the job's channel if one is open."""
        ch = self.get(job_id)
        if ch is not None:
            await ch.send(protocol.encode_frame(EndFrame(job_id, reason)))

    async def cancel_job(self, job_id: str, reason: str = "cancelled") -> None:
        """Withdraw a job: a queued one leaves the queue; an open one gets ``chat.end`` first."""
        job = self.board.jobs.get(job_id)
        if job is None or job.status == "completed":
            return
        if job.claimed_by is not None:
            job.cancel_reason = reason
            await self.end_job(job_id, reason)
        await self.board.withdraw(job_id, reason)

    def suspend(self, job_id: str, request_id: str, sink: Sink) -> None:
        """A request waits for the job's channel to be accepted again (``accept`` resumes it)."""
        self.suspended.setdefault(job_id, {})[request_id] = sink
        for observe in self.on_suspend:
            observe(job_id, request_id, sink)

    def unsuspend(self, job_id: str, request_id: str) -> bool:
        """It waits no more (given up, continued elsewhere); whether it was waiting."""
        waiting = self.suspended.get(job_id)
        if waiting is None or waiting.pop(request_id, None) is None:
            return False
        if not waiting:
            del self.suspended[job_id]
        return True

    def close_runner(self, runner_id: str, code: int, reason: str) -> None:
        """Close every open channel of a runner (declared offline)."""
        for ch in list(self._open.values()):
            if ch.runner_id == runner_id:
                ch.request_close(code, reason)

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
