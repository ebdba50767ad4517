"""One Chat Channel connection: a reader, a single writer, and one task per in-flight turn."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import msgspec
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from gateway import protocol
from gateway.backends import Backend, BackendError, BackendPool, BackendUnreachable
from gateway.observe import Counters, Histogram, Redactor
from gateway.sse import SSESplitter

log = logging.getLogger("gateway.channel")

SHUTTING_DOWN = "runner shutting down"
_validate_json = msgspec.json.Decoder(msgspec.Raw).decode
_DONE = b"[DONE]"
_ERROR_BODY_LIMIT = 512


@dataclass
class ChannelEnd:
    """How a channel connection ended: ``by`` is "server" (chat.end), "runner" (shutdown) or "drop"."""

    by: str
    reason: str


class Channel:
    """Serves one open Chat Channel WebSocket of one Chat Job until it ends or drops.

    Turns run concurrently, each in its own task; their frames reach the socket
    through one bounded outbox drained by a single writer, so a slow Server slows
    the backend reads and memory stays bounded.
    """

    def __init__(
        self,
        job_id: str,
        ws: WebSocketConnection,
        pool: BackendPool,
        *,
        shutdown: trio.Event,
        grace: float = 30.0,
        outbox_size: int = 64,
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
        self._outbox, self._outbox_recv = trio.open_memory_channel[str | bytes](outbox_size)
        self._turns: dict[str, trio.CancelScope] = {}
        self._cancel_reasons: dict[str, str] = {}
        self._started: dict[str, float] = {}  # request id -> when its frame arrived
        self._no_turns = trio.Event()
        self._no_turns.set()
        self._writer_done = trio.Event()
        self._draining = False
        self._end: ChannelEnd | None = None
        self._nursery: trio.Nursery | None = None
        self.turns_served = 0
        self.counters = counters if counters is not None else Counters()
        self.ttft = ttft if ttft is not None else Histogram()
        self.relay = relay if relay is not None else Histogram()
        self.frame_log = frame_log  # --verbose-frames: every frame, cut and redacted

    @property
    def in_flight(self) -> int:
        return len(self._turns)

    async def serve(self) -> ChannelEnd:
        """Serve frames until ``chat.end``, runner shutdown, or the connection drops."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._writer)
            nursery.start_soon(self._watch_shutdown)
            await self._reader()
            nursery.cancel_scope.cancel()
        assert self._end is not None
        return self._end

    def _finish(self, end: ChannelEnd) -> None:
        if self._end is None:
            self._end = end
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- the socket --------------------------------------------------------------------

    async def _writer(self) -> None:
        """The one task that writes to the socket. Whatever is queued when it wakes goes out
        together, as one socket write of ready-made text frames; it never waits for more."""
        outbox = self._outbox_recv
        take = outbox.receive_nowait
        ws = self.ws
        batched = _can_write_frames(ws)
        try:
            async with outbox:
                async for message in outbox:
                    batch = [message]
                    while len(batch) < _BATCH_LIMIT:
                        try:
                            batch.append(take())
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                    if self.frame_log is not None:
                        for item in batch:
                            log.info("job %s → %s", self.job_id, self.frame_log(item))
                    try:
                        if batched:
                            await _write_frames(
                                ws, protocol.ws_text_frames(batch, mask=ws.is_client)
                            )
                        else:
                            await _send_each(ws, batch)
                    except ConnectionClosed as exc:
                        reason = f"channel closed while sending ({_close_text(exc)})"
                        self._finish(ChannelEnd("drop", reason))
                        return
                    del batch, message  # an idle channel holds none of its last burst
        finally:
            self._writer_done.set()

    async def _reader(self) -> None:
        while self._end is None:
            try:
                message = await self.ws.get_message()
            except ConnectionClosed as exc:
                self._finish(ChannelEnd("drop", f"channel closed ({_close_text(exc)})"))
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
            self._cancel_turn(frame.requestId, protocol.CANCELLED)
        elif isinstance(frame, protocol.ModelsRequest):
            self._nursery.start_soon(self._answer_models, frame.requestId)
        elif isinstance(frame, protocol.End):
            reason = frame.reason or "ended by the Server"
            log.info("job %s: chat.end from the Server (%s)", self.job_id, reason)
            for request_id in list(self._turns):
                self._cancel_turn(request_id, "session ended")
            self._finish(ChannelEnd("server", reason))

    def _post(self, frame: str) -> None:
        """Queue a control frame without blocking the reader (a task waits if the outbox is full)."""
        try:
            self._outbox.send_nowait(frame)
        except trio.WouldBlock:
            assert self._nursery is not None
            self._nursery.start_soon(self._outbox.send, frame)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the channel is ending; there is no one to tell

    # -- shutdown ----------------------------------------------------------------------

    async def _watch_shutdown(self) -> None:
        await self.shutdown.wait()
        self._draining = True
        with trio.move_on_after(self.grace):
            await self._no_turns.wait()
        for request_id in list(self._turns):
            self._cancel_turn(request_id, SHUTTING_DOWN)
        await self._no_turns.wait()
        await self._outbox.send(protocol.end_frame(self.job_id, SHUTTING_DOWN))
        self._outbox.close()
        with trio.move_on_after(5):  # the writer flushes what is queued, chat.end last
            await self._writer_done.wait()
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
        self._started[request_id] = time.perf_counter()
        self._no_turns = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._turn, frame, scope)

    def _cancel_turn(self, request_id: str, reason: str) -> None:
        scope = self._turns.get(request_id)
        if scope is not None:
            self._cancel_reasons.setdefault(request_id, reason)
            scope.cancel()

    async def _turn(self, frame: protocol.CompletionRequest, scope: trio.CancelScope) -> None:
        request_id = frame.requestId
        try:
            error: str | None = None
            with scope:
                try:
                    error = await self._forward(frame)
                except protocol.FrameError as exc:  # a body that cannot take the turn's model
                    error = str(exc)
            if scope.cancelled_caught:
                error = self._cancel_reasons.get(request_id, protocol.CANCELLED)
            if error is None:
                self.counters.inc("turns_done")
            elif error in (protocol.CANCELLED, "session ended", SHUTTING_DOWN):
                self.counters.inc("turns_cancelled")
            else:
                self.counters.inc("turns_error")
            if error is not None:
                if error != protocol.CANCELLED and error != "session ended":
                    log.warning("job %s request %s: %s", self.job_id, request_id, error)
                if error != "session ended":
                    await self._outbox.send(protocol.error_frame(self.job_id, request_id, error))
            self.turns_served += 1
        finally:
            del self._turns[request_id]
            self._started.pop(request_id, None)
            self._cancel_reasons.pop(request_id, None)
            if not self._turns:
                self._no_turns.set()

    async def _forward(self, frame: protocol.CompletionRequest) -> str | None:
        """Route one turn, hold a slot on a backend serving its model, relay its chunks and
        done frame. An error string on failure. A backend that cannot be reached (nothing was
        sent) is probed at once, and the turn goes to the next backend serving the model."""
        request_id = frame.requestId
        try:
            route = await self.pool.route(frame.model, bytes(frame.body))
        except BackendError as exc:
            return str(exc)
        tried: list[Backend] = []
        while True:
            backend: Backend | None = None
            try:
                async with self.pool.turn(route, self.job_id, request_id, tried) as backend:
                    async with backend.stream(route.body) as response:
                        return await self._relay(request_id, backend.url, response)
            except BackendUnreachable as exc:
                assert backend is not None
                self.pool.suspect(backend)
                tried.append(backend)
                if len(tried) >= len(route.candidates):
                    return str(exc)
                log.warning(
                    "job %s request %s: %s; trying another backend", self.job_id, request_id, exc
                )
            except BackendError as exc:
                return str(exc)
            except httpx.TimeoutException:
                url = backend.url if backend is not None else "?"
                return f"backend {url} sent nothing for too long (idle timeout)"
            except httpx.HTTPError as exc:
                url = backend.url if backend is not None else "?"
                return f"backend {url} stream broke: {type(exc).__name__}"

    async def _relay(self, request_id: str, url: str, response: httpx.Response) -> str | None:
        """Relay one backend answer: every SSE event becomes a chunk frame queued the moment its
        read is split, then the done frame. Frames are queued without a scheduling point each
        (the read that brought them is one); a full outbox makes the relay wait (backpressure)."""
        outbox = self._outbox
        send, send_nowait = outbox.send, outbox.send_nowait
        if not response.is_success:
            text = await _read_limited(response, _ERROR_BODY_LIMIT)
            return f"backend returned {response.status_code}: {text}"
        prefix = protocol.chunk_prefix(self.job_id, request_id)
        if "text/event-stream" not in response.headers.get("content-type", ""):
            payload = (await response.aread()).strip()
            problem = _payload_problem(payload)
            if problem is not None:
                return f"backend {url} answered {problem}"
            await send(protocol.chunk_frame_bytes(prefix, payload))
            await send(protocol.done_frame(self.job_id, request_id))
            return None
        splitter = SSESplitter()
        feed = splitter.feed
        done = False
        chunks = 0
        first = True
        started = self._started.get(request_id, 0.0)
        clock = time.perf_counter
        observe_relay = self.relay.observe
        with trio.CancelScope() as drain:
            async for raw in response.aiter_raw():
                if done:
                    continue  # after [DONE], read to the end so the connection can be reused
                read_at = clock()
                if first:
                    first = False
                    self.ttft.observe(read_at - started)
                for payload in feed(raw):
                    if payload == _DONE:
                        await send(protocol.done_frame(self.job_id, request_id))
                        done = True
                        drain.deadline = trio.current_time() + 2
                        break
                    try:  # _payload_problem, inlined: this runs for every chunk
                        _validate_json(payload)
                    except msgspec.DecodeError:
                        return f"backend {url} sent a malformed SSE event"
                    if not payload.isascii() and not _is_utf8(payload):
                        return f"backend {url} sent an SSE event that is not UTF-8"
                    frame = prefix + payload + b"}"  # protocol.chunk_frame_bytes, inlined
                    try:
                        send_nowait(frame)
                    except (trio.WouldBlock, trio.BrokenResourceError):
                        await send(frame)  # waits for room; or, the writer gone, is cancelled
                    chunks += 1
                observe_relay(clock() - read_at)  # backend read -> frames queued for the socket
        self.counters.inc("chunks", chunks)
        if done:
            return None
        for payload in splitter.flush():
            if payload != _DONE:
                problem = _payload_problem(payload)
                if problem is not None:
                    return f"backend {url} sent an SSE event that is {problem}"
                await send(protocol.chunk_frame_bytes(prefix, payload))
        await send(protocol.done_frame(self.job_id, request_id))
        return None

    async def _answer_models(self, request_id: str) -> None:
        models = await self.pool.models()
        await self._outbox.send(protocol.models_frame(self.job_id, request_id, models))


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


_BATCH_LIMIT = 256  # frames in one socket write at most


def _can_write_frames(ws: WebSocketConnection) -> bool:
    """Can ``_write_frames`` reach this connection's stream? (trio-websocket internals, checked
    once per channel; without them the writer sends message by message through the public API)."""
    return all(
        hasattr(ws, name)
        for name in ("_stream", "_stream_lock", "_close_reason", "_abort_web_socket")
    )


async def _send_each(ws: WebSocketConnection, batch: Sequence[str | bytes]) -> None:
    """Without ``_write_frames``: one message at a time, through the public API."""
    for item in batch:
        await ws.send_message(item if isinstance(item, str) else item.decode())


async def _write_frames(ws: WebSocketConnection, data: bytes) -> None:
    """Write ready-made WebSocket frames in one go, as ``WebSocketConnection.send_message`` does
    for one message: under the connection's send lock, ``ConnectionClosed`` once it is closed."""
    if ws._close_reason:
        raise ConnectionClosed(ws._close_reason)
    lock = ws._stream_lock
    if lock.locked():  # the reader is answering a ping or a close: wait for it
        await lock.acquire()
        if ws._close_reason:  # closed while we waited
            lock.release()
            raise ConnectionClosed(ws._close_reason)
    else:
        lock.acquire_nowait()  # free: take it without a scheduling point (send_all has one)
    try:
        await ws._stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await ws._abort_web_socket()
        raise ConnectionClosed(ws._close_reason) from None
    finally:
        lock.release()


async def _read_limited(response: httpx.Response, limit: int) -> str:
    data = b""
    async for part in response.aiter_raw():
        data += part
        if len(data) > limit:
            return data[:limit].decode(errors="replace").strip() + "…"
    return data.decode(errors="replace").strip()


def _close_text(exc: ConnectionClosed) -> str:
    reason = exc.reason
    if reason is None:
        return "no close frame"
    if reason.code == 1009:
        return "a frame from the Server exceeded max_frame_size and was refused (code 1009)"
    text = f"code {reason.code}"
    return f"{text}: {reason.reason}" if reason.reason else text
