"""One Chat Channel connection: a reader, and one task per in-flight turn writing its own frames."""

from __future__ import annotations

import enum
import logging
import ssl
from dataclasses import dataclass
from typing import Literal

import httptools
import msgspec
import trio

from gateway import http1, protocol
from gateway.backends import Backend, BackendError, BackendPool, BackendUnreachable
from gateway.netio import RECV_SIZE
from gateway.observe import Counters, Histogram, Redactor
from gateway.sse import SSESplitter
from gateway.wsclient import ChannelClosed, WebSocket

log = logging.getLogger("gateway.channel")

SHUTTING_DOWN = "runner shutting down"
_validate_json = msgspec.json.Decoder(msgspec.Raw).decode
_DONE = b"[DONE]"
_ERROR_BODY_LIMIT = 512
_DRAIN_AFTER_DONE = 2.0  # s: after [DONE], how long the rest of the response may take (reuse)
_DEADLINE_SLACK = 16  # the idle deadline moves once 1/16 of the timeout has passed, not per read
_CHECKPOINT_EVERY = 16  # reads in a row that found a full buffer before a checkpoint of our own


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


class TurnFailed(Exception):
    """The turn cannot be served; the message is safe for a frame (no key)."""


@dataclass
class ChannelEnd:
    """How a channel connection ended: by the Server (chat.end), the runner (shutdown) or a drop."""

    by: Literal["server", "runner", "drop"]
    reason: str


class Channel:
    """Serves one open Chat Channel WebSocket of one Chat Job until it ends or drops.

    Turns run concurrently, each in its own task, and each writes its own frames: at once
    when no write is in progress, else together with the others in the next write
    (``WebSocket.send``). A slow Server makes the turns wait for room, so the backend reads
    slow down too and memory stays bounded.
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
        self._end: ChannelEnd | None = None
        self._nursery: trio.Nursery | None = None
        self.turns_served = 0
        self.counters = counters if counters is not None else Counters()
        self.ttft = ttft if ttft is not None else Histogram()
        self.relay = relay if relay is not None else Histogram()
        self.frame_log = frame_log  # --verbose-frames: every frame, cut and redacted
        self._send = ws.send if frame_log is None else self._send_logged
        self._send_batch = ws.send_batch if frame_log is None else self._send_batch_logged

    @property
    def in_flight(self) -> int:
        return len(self._turns)

    async def serve(self) -> ChannelEnd:
        """Serve frames until ``chat.end``, runner shutdown, or the connection drops."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.ws.run)
            nursery.start_soon(self._watch_shutdown)
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

    async def _send_batch_logged(self, frames: list[bytes]) -> None:
        for frame in frames:
            log.info("job %s → %s", self.job_id, self.frame_log(frame))  # type: ignore[misc]
        await self.ws.send_batch(frames)

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
        self._draining = True
        with trio.move_on_after(self.grace):
            await self._no_turns.wait()
        for request_id in list(self._turns):
            self._cancel_turn(request_id, _SHUTDOWN_END)
        await self._no_turns.wait()
        await self._send_or_drop(protocol.end_frame(self.job_id, SHUTTING_DOWN))
        with trio.move_on_after(5):  # what is written so far reaches the socket, chat.end last
            await self.ws.drain()
        self._finish(ChannelEnd("runner", SHUTTING_DOWN))

    # -- turns -------------------------------------------------------------------------

    def _start_turn(self, frame: protocol.CompletionRequest) -> None:
        request_id = frame.requestId
        if self._draining:
            self._post(protocol.error_frame(self.job_id, request_id, SHUTTING_DOWN))
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
        self._no_turns = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._turn, frame, scope)

    def _cancel_turn(self, request_id: str, end: TurnEnd) -> None:
        scope = self._turns.get(request_id)
        if scope is not None:
            self._stopped.setdefault(request_id, end)
            scope.cancel()

    async def _turn(self, frame: protocol.CompletionRequest, scope: trio.CancelScope) -> None:
        request_id = frame.requestId
        try:
            end = _DONE_END
            try:
                with scope:
                    try:
                        await self._forward(frame)
                    except TurnFailed as exc:
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except protocol.FrameError as exc:  # a body that cannot take its model
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except ChannelClosed:
                        end = _SESSION_END
            except trio.Cancelled:  # the channel itself is ending: no one left to tell
                self._conclude_quietly(request_id, self._stopped.get(request_id, _SESSION_END))
                raise
            if scope.cancelled_caught:
                end = self._stopped.get(request_id, _CANCELLED_END)
            await self._conclude(request_id, end)
        finally:
            del self._turns[request_id]
            self._started.pop(request_id, None)
            self._stopped.pop(request_id, None)
            if not self._turns:
                self._no_turns.set()

    async def _conclude(self, request_id: str, end: TurnEnd) -> None:
        """Count, log and frame one turn's outcome: the one place that does."""
        self._conclude_quietly(request_id, end)
        if end.ending.framed:
            await self._send_or_drop(protocol.error_frame(self.job_id, request_id, end.message))

    def _conclude_quietly(self, request_id: str, end: TurnEnd) -> None:
        """Count and log one turn's outcome (``_conclude`` without the frame)."""
        ending = end.ending
        self.counters.inc(ending.counter)
        if ending.logged:
            log.warning("job %s request %s: %s", self.job_id, request_id, end.message)
        self.turns_served += 1

    async def _forward(self, frame: protocol.CompletionRequest) -> None:
        """Route one turn, hold a slot on a backend serving its model, relay its chunks and
        done frame; ``TurnFailed`` when it cannot. A backend that cannot be reached (nothing
        was sent) is probed at once, and the turn goes to the next backend serving the model."""
        request_id = frame.requestId
        try:
            route = await self.pool.route(frame.model, bytes(frame.body))
        except BackendError as exc:
            raise TurnFailed(str(exc)) from None
        tried: list[Backend] = []
        while True:
            backend: Backend | None = None
            try:
                async with self.pool.turn(route, self.job_id, request_id, tried) as backend:
                    async with backend.stream(route.body) as response:
                        await self._relay(request_id, backend.url, response)
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

    async def _relay(self, request_id: str, url: str, response: http1.Response) -> None:
        """Relay one backend answer: every SSE event becomes a chunk frame written the moment
        its read is split (``WebSocket.send``: no scheduling point while the socket takes it),
        then the done frame. The reads themselves are the turn's scheduling points."""
        send = self._send
        if not 200 <= response.status < 300:
            text = _truncated(await response.read_body(_ERROR_BODY_LIMIT), _ERROR_BODY_LIMIT)
            raise TurnFailed(f"backend returned {response.status}: {text}")
        prefix = protocol.chunk_prefix(self.job_id, request_id)
        if b"text/event-stream" not in (response.header(b"content-type") or b""):
            payload = (await response.read_body()).strip()
            problem = _payload_problem(payload)
            if problem is not None:
                raise TurnFailed(f"backend {url} answered {problem}")
            await send(prefix + payload + b"}")
            await send(protocol.done_frame(self.job_id, request_id))
            return
        splitter = SSESplitter()
        feed = splitter.feed
        send_batch = self._send_batch
        job_id = self.job_id
        chunks = 0
        first = True
        started = self._started.get(request_id, 0.0)
        now = trio.lowlevel.current_clock().current_time
        observe_relay = self.relay.observe
        transport = response.transport
        recv, sock = transport.recv, transport.sock
        wait_readable = trio.lowlevel.wait_readable
        parse = response.parser.feed_data
        idle = response.idle
        timeout = response.idle_timeout
        step = timeout / _DEADLINE_SLACK
        read_at = now()
        move_at = read_at + step
        drained = False
        streak = 0
        try:
            while True:
                pieces = response.body
                if pieces:
                    response.body = []
                    if first:
                        first = False
                        self.ttft.observe(read_at - started)
                    for raw in pieces:
                        payloads = feed(raw)
                        if not payloads:
                            continue
                        done = _DONE in payloads
                        if done:
                            payloads = payloads[: payloads.index(_DONE)]
                        for payload in payloads:  # _payload_problem, inlined: runs per chunk
                            try:
                                _validate_json(payload)
                            except msgspec.DecodeError:
                                raise TurnFailed(
                                    f"backend {url} sent a malformed SSE event"
                                ) from None
                            if not payload.isascii() and not _is_utf8(payload):
                                raise TurnFailed(
                                    f"backend {url} sent an SSE event that is not UTF-8"
                                )
                        if len(payloads) == 1:  # written now, unless a write is in progress
                            await send(prefix + payloads[0] + b"}")  # protocol.chunk_frame_bytes
                        elif payloads:  # ready together: one write
                            await send_batch([prefix + p + b"}" for p in payloads])
                        chunks += len(payloads)
                        if done:
                            await send(protocol.done_frame(job_id, request_id))
                            await _drain(response)
                            return
                    observe_relay(now() - read_at)  # backend read -> frames written
                if response.complete:
                    break
                if drained:  # the last read took all there was: wait, without a read to learn it
                    await wait_readable(sock)  # the turn's scheduling (and cancellation) point
                    streak = 0
                elif streak >= _CHECKPOINT_EVERY:  # reads that keep finding data: stay fair
                    await trio.lowlevel.checkpoint()
                    streak = 0
                try:  # Response.read_nowait, inlined
                    data = recv(RECV_SIZE)
                except BlockingIOError:
                    drained = True
                    continue
                drained = len(data) < RECV_SIZE
                streak += 1
                read_at = now()
                if data:
                    parse(data)
                else:
                    response.end_of_stream()
                if read_at >= move_at and idle is not None:  # one deadline, moved forward
                    idle.deadline = read_at + timeout
                    move_at = read_at + step
        except httptools.HttpParserError as exc:
            raise http1.ProtocolError(f"sent a malformed HTTP response ({exc})") from None
        except (OSError, ssl.SSLError) as exc:
            raise http1.ConnectionLost(f"connection broke ({type(exc).__name__})") from None
        finally:
            self.counters.inc("chunks", chunks)
        for payload in splitter.flush():
            if payload != _DONE:
                problem = _payload_problem(payload)
                if problem is not None:
                    raise TurnFailed(f"backend {url} sent an SSE event that is {problem}")
                await send(prefix + payload + b"}")
        await send(protocol.done_frame(job_id, request_id))

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


def _payload_problem(payload: bytes) -> str | None:
    """Why a payload cannot go into a frame unchanged, or None when it can."""
    try:
        _validate_json(payload)
    except msgspec.DecodeError:
        return "malformed (not JSON)"
    return None if _is_utf8(payload) else "not UTF-8"


def _is_utf8(data: bytes) -> bool:
    """A payload goes into a text frame: it must be UTF-8 (JSON validation does not check)."""
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
