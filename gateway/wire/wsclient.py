"""The Chat Channel's WebSocket client: wsproto over a ``netio`` socket, frames written at once.

The runner is only ever a WebSocket client, so it owns that side: wsproto does the handshake
and builds the control frames (pong, close, ping); the Server's whole unfragmented text frames
(every turn's request) are decoded here and every other frame goes to wsproto whole. The text
frames of the hot path are built here (``wsframes.ClientFramer``) and written by the code that
has them (``offer``: a turn's task, or the runner's poller for it), at once, when no write is in
progress. A write the socket cannot take whole leaves the rest to the connection's own task
(``run``); frames that become ready meanwhile wait in a bounded list and go out together in its
next write, so a burst costs few syscalls and a slow Server slows the senders (``offer`` says
there is no room; they wait with ``wait_room``) instead of growing a queue.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import trio
from wsproto import ConnectionState, ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import ProtocolError as WSProtocolError

from gateway.wire import netio, wsframes
from gateway.wire.netio import Transport

log = logging.getLogger("gateway.wsclient")

WRITE_BUFFER = 1 << 16  # bytes of frames waiting behind a write in progress before senders wait
MESSAGE_TOO_BIG = 1009
_BROKEN = (OSError, ssl.SSLError, trio.ClosedResourceError)


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
            return "a frame from the Server exceeded max_frame_size and was refused (code 1009)"
        return f"code {self.code}: {self.reason}" if self.reason else f"code {self.code}"


class WebSocket:
    """One open client WebSocket. ``receive`` is called by one task; ``send`` by any;
    ``run`` must run (in the owner's nursery) for writes the socket could not take at once."""

    def __init__(
        self,
        transport: Transport,
        conn: WSConnection,
        *,
        max_message_size: int = 16 << 20,
        write_buffer: int = WRITE_BUFFER,
        ping_interval: float = 0.0,
        ping_timeout: float | None = None,
        on_ping: Callable[[str], None] | None = None,
    ) -> None:
        self.transport = transport
        self._conn = conn
        self.max_message_size = max_message_size
        self._limit = write_buffer
        framer = wsframes.ClientFramer()
        self._frame, self._frames = framer.frame, framer.frames
        self._inbox: deque[str | bytes] = deque()
        self._rx = bytearray()  # bytes of a frame not complete yet (see _take_frames)
        self._raw = True  # False once a frame too big to hold whole went to wsproto
        self._parts: list[str | bytes | bytearray] = []
        self._size = 0
        # writing: frames wait in _pending only while a write is in progress (_writing)
        self._writing = False
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._wake = trio.Event()  # the connection's task has a write to finish
        self._room = trio.Event()  # set when the frames waiting went into a write
        self._flushed = trio.Event()
        self._flushed.set()
        self._closed: ChannelClosed | None = None
        # keepalive
        self.ping_interval = ping_interval
        self.ping_timeout = ping_interval if ping_timeout is None else ping_timeout
        self.on_ping = on_ping  # told "sent", "timeout": the owner counts them
        self._heard_at = trio.current_time()

    @property
    def closed(self) -> ChannelClosed | None:
        """Why the connection is closed, or None while it is open."""
        return self._closed

    # -- sending -------------------------------------------------------------------------

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
        if self._closed is not None:
            raise ChannelClosed(self._closed.code, self._closed.reason)

    def _offer(self, data: bytes) -> bool:
        if self._closed is not None:
            raise ChannelClosed(self._closed.code, self._closed.reason)
        if self._writing:
            self._pending.append(data)
            self._pending_bytes += len(data)
            return self._pending_bytes <= self._limit
        try:
            if self.transport.write(data):
                return True
        except _BROKEN as exc:
            self._broke(exc)
            raise ChannelClosed(None, f"the connection broke ({type(exc).__name__})") from None
        self._writing = True
        self._flushed = trio.Event()
        self._wake.set()
        return True

    def _write(self, data: bytes) -> None:
        """Write now; what the socket does not take goes to the connection's task."""
        try:
            if self.transport.write(data):
                return
        except _BROKEN as exc:
            self._broke(exc)
            return
        self._writing = True
        self._flushed = trio.Event()
        self._wake.set()

    def _write_control(self, data: bytes) -> None:
        if not data:
            return
        if self._writing:
            self._pending.append(data)
        else:
            self._write(data)

    async def drain(self) -> None:
        """Wait until every frame sent so far is written to the socket."""
        await self._flushed.wait()

    async def run(self) -> None:
        """The connection's own task: finishes the writes the socket could not take at once,
        and pings every ``ping_interval`` s; until the connection ends."""
        interval = self.ping_interval
        ping_at = trio.current_time() + interval
        awaiting: float | None = None  # when the ping that has no answer yet was sent
        while self._closed is None:
            if interval > 0:
                wake_at = (
                    ping_at if awaiting is None else min(ping_at, awaiting + self.ping_timeout)
                )
                with trio.move_on_at(wake_at):
                    await self._wake.wait()
            else:
                await self._wake.wait()
            if self._wake.is_set():
                self._wake = trio.Event()
                await self._flush()
            if interval > 0 and self._closed is None:
                now = trio.current_time()
                if awaiting is not None and self._heard_at >= awaiting:
                    awaiting = None  # a pong, or any other frame, came
                if awaiting is not None and now >= awaiting + self.ping_timeout:
                    if self.on_ping is not None:
                        self.on_ping("timeout")
                    self.abort(
                        ChannelClosed(None, f"no answer to a ping within {self.ping_timeout:g} s")
                    )
                    return
                if now >= ping_at:
                    self._write_control(self._conn.send(Ping(b"alp")))
                    if self.on_ping is not None:
                        self.on_ping("sent")
                    if awaiting is None:
                        awaiting = now
                    ping_at = now + interval

    async def _flush(self) -> None:
        transport = self.transport
        try:
            while True:
                await transport.flush()
                if not self._pending:
                    break
                batch, self._pending = self._pending, []
                self._pending_bytes = 0
                room, self._room = self._room, trio.Event()
                room.set()
                transport.write(b"".join(batch))
        except _BROKEN as exc:
            self._broke(exc)
        finally:
            self._writing = False
            self._flushed.set()
            room, self._room = self._room, trio.Event()
            room.set()

    # -- receiving -----------------------------------------------------------------------

    async def receive(self) -> str | bytes:
        """The next message from the Server; ``ChannelClosed`` once the connection is closed.
        Pings are answered (RFC 6455 §5.5.2) and a close frame is answered and ends it."""
        transport = self.transport
        while True:
            if self._inbox:
                return self._inbox.popleft()
            if self._closed is not None:
                raise ChannelClosed(self._closed.code, self._closed.reason)
            try:
                data = transport.recv_nowait()
                if data is None:
                    await transport.wait_readable()
                    continue
            except _BROKEN as exc:
                self._broke(exc)
                continue
            if self.ping_interval > 0:
                self._heard_at = trio.current_time()
            if data and self._raw:
                self._take_frames(data)
                continue
            if self._rx:  # the end of the stream inside a frame: wsproto says what that is
                self._conn.receive_data(bytes(self._rx))
                self._rx.clear()
            self._conn.receive_data(data or None)
            self.on_events(self._conn.events())
            if not data and self._closed is None:
                self.abort(ChannelClosed(None, "no close frame"))

    def _take_frames(self, data: bytes) -> None:
        """Whole frames from what came: a complete, unfragmented, unmasked text frame (the hot
        path: every turn's request) goes to the inbox here, without wsproto's per-byte parsing;
        any other frame (control, fragment, binary, bad UTF-8, masked) goes to wsproto whole, so
        wsproto never holds part of a frame and the two never disagree about where one starts.
        A frame longer than ``max_message_size`` goes to wsproto as it comes (it refuses it), and
        so does everything after it."""
        rx = self._rx
        buf: bytes | bytearray = data
        if rx:  # a frame begun in an earlier read: grown in place, never copied whole again
            rx += data
            buf = rx
        conn = self._conn
        pos, end = 0, len(buf)
        while end - pos >= 2 and self._closed is None:
            b0, b1 = buf[pos], buf[pos + 1]
            size = b1 & 0x7F
            off = pos + 2
            if size == 126:
                if end - off < 2:
                    break
                size = int.from_bytes(buf[off : off + 2], "big")
                off += 2
            elif size == 127:
                if end - off < 8:
                    break
                size = int.from_bytes(buf[off : off + 8], "big")
                off += 8
            if b1 & 0x80:
                off += 4  # masked (a Server must not mask): wsproto refuses it
            if size > self.max_message_size:
                self._raw = False
                conn.receive_data(bytes(buf[pos:]))
                rx.clear()
                self.on_events(conn.events())
                return
            stop = off + size
            if stop > end:
                break
            if (
                b0 == 0x81
                and not b1 & 0x80
                and not self._parts
                and conn.state is ConnectionState.OPEN
            ):
                try:
                    self._inbox.append(buf[off:stop].decode())
                    pos = stop
                    continue
                except UnicodeDecodeError:
                    pass  # wsproto closes with 1007
            conn.receive_data(bytes(buf[pos:stop]))
            self.on_events(conn.events())
            pos = stop
        rest = end - pos if self._closed is None else 0  # a frame not complete yet
        if buf is rx:
            if rest:
                del rx[:pos]
            else:
                rx.clear()
        elif rest:
            rx += memoryview(buf)[pos:]

    def on_events(self, events: Iterable[Event]) -> None:
        """Handle what wsproto read: messages to the inbox, pings answered, a close answered."""
        for event in events:
            if isinstance(event, (TextMessage, BytesMessage)):
                self._parts.append(event.data)
                self._size += len(event.data)
                if self._size > self.max_message_size:
                    self._close(MESSAGE_TOO_BIG, "message too big")
                    return
                if event.message_finished:
                    parts, self._parts, self._size = self._parts, [], 0
                    if isinstance(event, TextMessage):
                        self._inbox.append("".join(p for p in parts if isinstance(p, str)))
                    else:
                        self._inbox.append(b"".join(p for p in parts if not isinstance(p, str)))
            elif isinstance(event, Ping):
                if self._conn.state is ConnectionState.OPEN:  # closing: the close answers it
                    self._write_control(self._conn.send(event.response()))
            elif isinstance(event, Pong):
                pass  # heard: that is all a pong says
            elif isinstance(event, CloseConnection):
                if self._conn.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
                    self._write_control(self._conn.send(event.response()))
                self._ended(ChannelClosed(event.code, event.reason or ""))
                return

    # -- ending --------------------------------------------------------------------------

    def _close(self, code: int, reason: str) -> None:
        """Start the closing handshake with ``code``; the connection counts as closed now."""
        if self._closed is None and self._conn.state is ConnectionState.OPEN:
            self._write_control(self._conn.send(CloseConnection(code, reason)))
        self._ended(ChannelClosed(code, reason))

    def _ended(self, reason: ChannelClosed) -> None:
        if self._closed is None:
            self._closed = reason
            self._wake.set()  # the connection's task sees it and ends
            room, self._room = self._room, trio.Event()
            room.set()

    def _broke(self, exc: BaseException) -> None:
        self.abort(ChannelClosed(None, f"the connection broke ({type(exc).__name__})"))

    def abort(self, reason: ChannelClosed) -> None:
        """Close the socket now, without a closing handshake."""
        self._ended(reason)
        self.transport.close()
        self._flushed.set()

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        """The closing handshake (bounded: 2 s), then the socket is closed."""
        try:
            if not self.transport.closed:
                with trio.move_on_after(2):
                    if self._closed is None:
                        self._close(code, reason)
                        await self._finish_writes()
                        await self._await_close_reply()
                    else:
                        await self._finish_writes()
        finally:
            self.transport.close()
            self._flushed.set()

    async def _finish_writes(self) -> None:
        if not self._writing:
            return
        self._wake = trio.Event()  # run() may be gone: finish here
        await self._flush()

    async def _await_close_reply(self) -> None:
        transport = self.transport
        try:
            while self._conn.state is not ConnectionState.CLOSED:
                data = await transport.receive()
                if not data:
                    return
                self._conn.receive_data(data)
                for _event in self._conn.events():
                    pass
        except _BROKEN:
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
    """The client's opening handshake (RFC 6455 §4.1) on a connected transport."""
    conn = WSConnection(ConnectionType.CLIENT)
    await transport.send_all(conn.send(Request(host=host, target=target)))
    received = b""
    while True:
        data = await transport.receive()
        if not data:
            raise HandshakeError("the Server closed the connection during the upgrade")
        received += data
        try:
            conn.receive_data(data)
            events = conn.events()
            for event in events:
                if isinstance(event, AcceptConnection):
                    ws = WebSocket(
                        transport,
                        conn,
                        max_message_size=max_message_size,
                        ping_interval=ping_interval,
                        ping_timeout=ping_timeout,
                        on_ping=on_ping,
                    )
                    # bytes after the answer's head are wsproto's (it may hold part of a
                    # frame): then it reads every frame of this connection
                    ws._raw = received.find(b"\r\n\r\n") + 4 == len(received)
                    ws.on_events(events)  # frames that came with the answer
                    return ws
                if isinstance(event, RejectConnection):
                    raise HandshakeError(
                        f"the Server refused the upgrade ({event.status_code})", event.status_code
                    )
        except WSProtocolError as exc:
            raise HandshakeError(f"bad upgrade answer: {exc}") from None
