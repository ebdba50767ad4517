"""The Chat Channel's WebSocket client: an h11 upgrade, then ``wsframes`` over a ``netio`` socket.

The runner is only ever a WebSocket client. The upgrade (RFC 6455 §4.1) is one HTTP/1.1
request and its answer, read with h11 (``handshake``); from then on the connection's state (the
close handshake, pings answered, the keepalive clock, the bounds of a message) is the I/O-free
``gateway.wire.wsconn.WebSocketConnection`` the hub's server uses too, and this module does its
I/O. One open connection is two parts, one job each:

- ``FrameWriter`` writes. The text frames of the hot path are written by the code that has
  them (``offer``: a turn's task, or the runner's poller for it), at once, when no write is in
  progress. A write the socket cannot take whole leaves the rest to the writer's task
  (``run``); frames that become ready meanwhile wait in a bounded list and go out together in
  its next write, so a burst costs few syscalls and a slow Server slows the senders (``offer``
  says there is no room; they wait with ``wait_room``) instead of growing a queue. The control
  frames the connection owes go out at once too, or after the write in progress.
- ``WebSocket`` is the connection: it reads (``receive``: messages in order), runs the writer's
  task and the keepalive clock (``run``), and closes (``aclose``, ``abort``).
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import h11
import trio

from gateway.wire import netio
from gateway.wire.netio import NET_ERRORS, Transport
from gateway.wire.wsconn import (
    Keepalive,
    Tick,
    WebSocketConnection,
    WsState,
    answer_problem,
    new_key,
    request_headers,
)
from gateway.wire.wsframes import MAX_FRAGMENTS, OP_TEXT, ClientFramer

WRITE_BUFFER = 1 << 16  # bytes of frames waiting behind a write in progress before senders wait
MESSAGE_TOO_BIG = 1009


class HandshakeError(Exception):
    """The WebSocket upgrade failed; ``status_code`` is the Server's answer when it refused."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ChannelClosed(Exception):
    """The connection is closed: ``code`` from the close frame (None: none came, it broke)."""

    def __init__(self, code: int | None, reason: str = "") -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason

    def __str__(self) -> str:
        if self.code is None:
            return self.reason or "no close frame"
        if self.code == MESSAGE_TOO_BIG:
            return (
                "a message from the Server exceeded max_frame_size or its fragment bound and "
                f"was refused (code 1009: {self.reason})"
            )
        return f"code {self.code}: {self.reason}" if self.reason else f"code {self.code}"


class FrameWriter:
    """Writes one connection's frames: at once when no write is in progress, else behind it,
    together, within ``limit`` bytes. ``send``, ``offer`` and ``controls`` are called by any
    task; ``run`` (the writer's task) finishes the writes the socket could not take at once.
    The control frames ``conn`` owes go out with them (``controls``: at once, or after the
    write in progress; meanwhile they wait in ``conn``, one of each at most). A write that
    fails is told to ``broke``; once ``stop`` is called, sending raises the ``ChannelClosed``
    it was given."""

    def __init__(
        self,
        transport: Transport,
        limit: int,
        broke: Callable[[BaseException], None],
        conn: WebSocketConnection,
    ) -> None:
        self.transport = transport
        self._limit = limit
        self._broke = broke
        self._conn = conn
        self.framer = framer = ClientFramer()
        self._frame, self._frames = framer.frame, framer.frames
        self.closed: ChannelClosed | None = None  # why the connection ended (stop)
        # frames wait in _pending only while a write is in progress (_writing)
        self._writing = False
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._wake = trio.Event()  # the writer's task has a write to finish
        self._room = trio.Event()  # set when the frames waiting went into a write
        self._flushed = trio.Event()
        self._flushed.set()

    async def send(self, message: bytes | str) -> None:
        """Send one text message (``bytes``: UTF-8 text, framed as it is).

        Written at once when no write is in progress: no scheduling point then. Otherwise it
        joins the next write, and waits for room when too much is already waiting."""
        data = self._frame(message if isinstance(message, bytes) else message.encode())
        if not self._offer(data):
            await self.wait_room()

    def offer(self, message: bytes) -> bool:
        """``send`` without waiting: the frame is written at once or joins the next write.
        False when more than the buffer's worth is waiting: wait (``wait_room``) before the
        next one. ``ChannelClosed`` once the connection is closed."""
        return self._offer(self._frame(message))

    def offer_batch(self, messages: list[bytes]) -> bool:
        """``offer`` for several messages ready together (one backend read's chunk frames):
        one write."""
        return self._offer(self._frames(messages))

    async def wait_room(self) -> None:
        """Wait until the frames waiting behind a write fit the buffer again."""
        if self._writing and self._pending_bytes > self._limit:
            await self._room.wait()
        if self.closed is not None:
            raise ChannelClosed(self.closed.code, self.closed.reason)

    def _offer(self, data: bytes) -> bool:
        if self.closed is not None:
            raise ChannelClosed(self.closed.code, self.closed.reason)
        if self._writing:
            self._pending.append(data)
            self._pending_bytes += len(data)
            return self._pending_bytes <= self._limit
        try:
            if self.transport.write(data):
                return True
        except NET_ERRORS as exc:
            self._broke(exc)
            raise ChannelClosed(None, f"the connection broke ({type(exc).__name__})") from None
        self._writing = True
        self._flushed = trio.Event()
        self._wake.set()
        return True

    def controls(self) -> None:
        """The control frames the connection owes (a pong, a ping, a close): written at once,
        or after the write in progress; never refused."""
        if self._writing or self.transport.closed:
            return  # the write in progress takes them when it is done
        try:
            if self.transport.write(self._conn.data_to_send()):
                return
        except NET_ERRORS as exc:
            self._broke(exc)
            return
        self._writing = True
        self._flushed = trio.Event()
        self._wake.set()

    async def drain(self) -> None:
        """Wait until every frame sent so far is written to the socket."""
        await self._flushed.wait()

    async def run(self) -> None:
        """The writer's task: finishes each write the socket could not take at once, until
        the connection ends (the writes begun by then are finished first)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._writing:
                await self._flush()
            if self.closed is not None:
                return

    async def finish(self) -> None:
        """Finish the write in progress here (the writer's task may be gone)."""
        if self._writing:
            self._wake = trio.Event()
            await self._flush()

    async def _flush(self) -> None:
        transport = self.transport
        conn = self._conn
        try:
            while True:
                await transport.flush()
                if not self._pending and not conn.pending:
                    break
                batch, self._pending = self._pending, []
                self._pending_bytes = 0
                room, self._room = self._room, trio.Event()
                room.set()
                if conn.pending:  # after the frames that waited: a close frame goes last
                    batch.append(conn.data_to_send())
                transport.write(b"".join(batch))
        except NET_ERRORS as exc:
            self._broke(exc)
        finally:
            self._writing = False
            self._flushed.set()
            room, self._room = self._room, trio.Event()
            room.set()

    def stop(self, reason: ChannelClosed) -> None:
        """The connection ended: no more sending; the writer's task ends, senders waiting for
        room are woken (and told)."""
        if self.closed is None:
            self.closed = reason
            self._wake.set()
            room, self._room = self._room, trio.Event()
            room.set()

    def socket_closed(self) -> None:
        """The socket is closed: nothing more will be written, nobody waits for it."""
        self._flushed.set()


class WebSocket:
    """One open client WebSocket. ``receive`` is called by one task; ``send``, ``offer``,
    ``offer_batch``, ``wait_room`` and ``drain`` (the ``FrameWriter``'s own methods) by any;
    ``run`` must run (in the owner's nursery) for the writer's task and the keepalive."""

    def __init__(
        self,
        transport: Transport,
        *,
        max_message_size: int = 16 << 20,
        max_fragments: int = MAX_FRAGMENTS,
        write_buffer: int = WRITE_BUFFER,
        ping_interval: float = 0.0,
        ping_timeout: float | None = None,
        on_ping: Callable[[str], None] | None = None,
    ) -> None:
        self.transport = transport
        keepalive = None
        if ping_interval > 0:
            timeout = ping_interval if ping_timeout is None else ping_timeout
            keepalive = Keepalive(ping_interval, timeout)
        self.conn = conn = WebSocketConnection(
            client=True,
            max_message=max_message_size,
            max_fragments=max_fragments,
            keepalive=keepalive,
            now=trio.current_time(),
        )
        self.writer = writer = FrameWriter(transport, write_buffer, self._broke, conn)
        # the writer's methods, bound here: no call between the hot path and the writer
        self.send = writer.send
        self.offer = writer.offer
        self.offer_batch = writer.offer_batch
        self.wait_room = writer.wait_room
        self.drain = writer.drain
        self._on_ping = on_ping
        self._inbox: deque[str | bytes] = deque()
        self._now = trio.lowlevel.current_clock().current_time  # trio.current_time, bound

    @property
    def closed(self) -> ChannelClosed | None:
        """Why the connection is closed, or None while it is open."""
        return self.writer.closed

    async def run(self) -> None:
        """The connection's own tasks, until it ends: the writer's and the keepalive's."""
        if self.conn.keepalive is None:
            await self.writer.run()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keepalive)
            await self.writer.run()
            nursery.cancel_scope.cancel()

    # -- reading -------------------------------------------------------------------------

    async def receive(self) -> str | bytes:
        """The next message from the Server (text: ``str``, binary: ``bytes``);
        ``ChannelClosed`` once the connection is closed. Pings are answered (RFC 6455 §5.5.2)
        and a close frame is answered and ends it."""
        transport = self.transport
        inbox = self._inbox
        while True:
            if inbox:
                return inbox.popleft()
            closed = self.writer.closed
            if closed is not None:
                raise ChannelClosed(closed.code, closed.reason)
            try:
                data = transport.recv_nowait()
                if data is None:
                    await transport.wait_readable()
                    continue
            except NET_ERRORS as exc:
                self._broke(exc)
                continue
            if data:
                self.take(data)
            else:
                self.abort(ChannelClosed(None, "the Server closed the connection, no close frame"))

    def take(self, data: bytes) -> None:
        """Read what came: messages to the inbox; what the connection owes for it (a pong, the
        answer to a close) written; a close, or a frame that breaks RFC 6455 (closed with the
        code it calls for), ends the connection."""
        conn = self.conn
        inbox = self._inbox
        for op, payload in conn.receive(data, self._now()):
            inbox.append(payload.decode() if op == OP_TEXT else payload)  # UTF-8 checked
        if conn.pending:
            self.writer.controls()
        if conn.state is not WsState.OPEN:
            self._ended(ChannelClosed(conn.close_code, conn.close_reason))

    # -- keeping alive -------------------------------------------------------------------

    async def _keepalive(self) -> None:
        """The keepalive clock's I/O: a ping when due; the connection given up (no closing
        handshake) when nothing at all came ``timeout`` s after one."""
        conn = self.conn
        on_ping = self._on_ping
        while True:
            await trio.sleep_until(conn.next_tick())
            tick = conn.tick(trio.current_time())
            if tick is Tick.PING:
                self.writer.controls()
                if on_ping is not None:
                    on_ping("sent")
            elif tick is Tick.DEAD:
                if on_ping is not None:
                    on_ping("timeout")
                self.abort(ChannelClosed(None, conn.silence()))
                return

    # -- ending --------------------------------------------------------------------------

    def _close(self, code: int, reason: str) -> None:
        """Start the closing handshake with ``code``; the connection counts as closed now."""
        conn = self.conn
        if self.writer.closed is None:
            conn.close(code, reason)
            if conn.pending:
                self.writer.controls()
        self._ended(ChannelClosed(code, reason))

    def _ended(self, reason: ChannelClosed) -> None:
        self.writer.stop(reason)  # the writer's task sees it and ends

    def _broke(self, exc: BaseException) -> None:
        self.abort(ChannelClosed(None, f"the connection broke ({type(exc).__name__})"))

    def abort(self, reason: ChannelClosed) -> None:
        """Close the socket now, without a closing handshake."""
        self._ended(reason)
        self.transport.close()
        self.writer.socket_closed()

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        """The closing handshake (bounded: 2 s), then the socket is closed."""
        try:
            if not self.transport.closed:
                with trio.move_on_after(2):
                    if self.writer.closed is None:
                        self._close(code, reason)
                        await self.writer.finish()
                        await self._await_close_reply()
                    else:
                        await self.writer.finish()
        finally:
            self.transport.close()
            self.writer.socket_closed()

    async def _await_close_reply(self) -> None:
        transport = self.transport
        conn = self.conn
        try:
            while conn.state is WsState.CLOSING:
                data = await transport.receive()
                if not data:
                    return
                conn.receive(data, trio.current_time())
        except NET_ERRORS:
            return


async def connect(
    url: str,
    *,
    ssl_context: ssl.SSLContext | None = None,
    max_message_size: int = 16 << 20,
    ping_interval: float = 0.0,
    ping_timeout: float | None = None,
    on_ping: Callable[[str], None] | None = None,
) -> WebSocket:
    """Dial ``ws://`` or ``wss://`` ``url`` and upgrade; the caller bounds it with a deadline.

    ``OSError`` (``ssl.SSLError`` included) when the connection fails, ``HandshakeError`` when
    the upgrade does (``status_code`` set when the Server refused it)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise HandshakeError(f"not a WebSocket URL: {parts.scheme}://{parts.hostname or ''}")
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    transport = await netio.connect(
        parts.hostname, port, ssl_context=ssl_context if secure else None
    )
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    try:
        return await handshake(
            transport,
            parts.netloc,
            target,
            max_message_size=max_message_size,
            ping_interval=ping_interval,
            ping_timeout=ping_timeout,
            on_ping=on_ping,
        )
    except BaseException:
        transport.close()
        raise


async def handshake(
    transport: Transport,
    host: str,
    target: str,
    *,
    max_message_size: int = 16 << 20,
    ping_interval: float = 0.0,
    ping_timeout: float | None = None,
    on_ping: Callable[[str], None] | None = None,
) -> WebSocket:
    """The client's opening handshake (RFC 6455 §4.1) on a connected transport: h11 writes
    the request and reads the answer; a 101 that accepts our key opens the WebSocket."""
    key = new_key()
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(method="GET", target=target, headers=request_headers(host, key))
    await transport.send_all(conn.send(request) + (conn.send(h11.EndOfMessage()) or b""))
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise HandshakeError(f"bad upgrade answer: {exc}") from None
        if event is h11.NEED_DATA:
            data = await transport.receive()
            if not data:
                raise HandshakeError("the Server closed the connection during the upgrade")
            conn.receive_data(data)
        elif isinstance(event, h11.InformationalResponse) and event.status_code == 101:
            problem = answer_problem(event.headers, key)
            if problem is not None:
                raise HandshakeError(f"bad upgrade answer: {problem}")
            ws = WebSocket(
                transport,
                max_message_size=max_message_size,
                ping_interval=ping_interval,
                ping_timeout=ping_timeout,
                on_ping=on_ping,
            )
            frames, _ = conn.trailing_data  # frames that came with the answer
            if frames:
                ws.take(frames)
            return ws
        elif isinstance(event, h11.Response):
            raise HandshakeError(
                f"the Server refused the upgrade ({event.status_code})", event.status_code
            )
        # another 1xx answer: the final one follows
