"""The Chat Channel's WebSocket client: an h11 upgrade, then ``wsframes`` over a ``netio`` socket.

The runner is only ever a WebSocket client. The upgrade (RFC 6455 §4.1) is one HTTP/1.1
request and its answer, read with h11 (``handshake``); from then on every frame is read and
built by ``wsframes``, the codec the hub's server uses too. One open connection is three
parts, one job each:

- ``FrameWriter`` writes. The text frames of the hot path are written by the code that has
  them (``offer``: a turn's task, or the runner's poller for it), at once, when no write is in
  progress. A write the socket cannot take whole leaves the rest to the writer's task
  (``run``); frames that become ready meanwhile wait in a bounded list and go out together in
  its next write, so a burst costs few syscalls and a slow Server slows the senders (``offer``
  says there is no room; they wait with ``wait_room``) instead of growing a queue.
- ``Keepalive`` pings every interval and gives up on a connection that stays silent.
- ``WebSocket`` is the connection: it reads (``receive``: messages in order, pings answered,
  a close answered), starts the two tasks above (``run``), and closes (``aclose``, ``abort``).
"""

from __future__ import annotations

import base64
import hashlib
import os
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import h11
import trio

from gateway.wire import netio
from gateway.wire.netio import Transport
from gateway.wire.wsframes import (
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    ClientFramer,
    FrameReader,
    close_code_of,
    close_payload,
    close_reason_of,
)

WRITE_BUFFER = 1 << 16  # bytes of frames waiting behind a write in progress before senders wait
MESSAGE_TOO_BIG = 1009
_BROKEN = (OSError, ssl.SSLError, trio.ClosedResourceError)
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3


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


class FrameWriter:
    """Writes one connection's frames: at once when no write is in progress, else behind it,
    together, within ``limit`` bytes. ``send``, ``offer`` and ``control`` are called by any
    task; ``run`` (the writer's task) finishes the writes the socket could not take at once.
    A write that fails is told to ``broke``; once ``stop`` is called, sending raises the
    ``ChannelClosed`` it was given."""

    def __init__(
        self, transport: Transport, limit: int, broke: Callable[[BaseException], None]
    ) -> None:
        self.transport = transport
        self._limit = limit
        self._broke = broke
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
        except _BROKEN as exc:
            self._broke(exc)
            raise ChannelClosed(None, f"the connection broke ({type(exc).__name__})") from None
        self._writing = True
        self._flushed = trio.Event()
        self._wake.set()
        return True

    def control(self, opcode: int, payload: bytes = b"") -> None:
        """A control frame (ping, pong, close): written at once, or next; never refused."""
        data = self.framer.control(opcode, payload)
        if self._writing:
            self._pending.append(data)
            return
        try:
            if self.transport.write(data):
                return
        except _BROKEN as exc:
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


class Keepalive:
    """Pings every ``interval`` s (``ping``); when nothing at all was heard (``heard_at``, set
    by the reader) ``timeout`` s after a ping, the connection is given up (``dead``). The
    owner's ``on_ping`` is told "sent" and "timeout" (it counts them)."""

    def __init__(
        self,
        interval: float,
        timeout: float,
        ping: Callable[[], None],
        dead: Callable[[str], None],
        on_ping: Callable[[str], None] | None = None,
    ) -> None:
        self.interval = interval
        self.timeout = timeout
        self._ping = ping
        self._dead = dead
        self._on_ping = on_ping
        self.heard_at = trio.current_time()

    async def run(self) -> None:
        interval, timeout, on_ping = self.interval, self.timeout, self._on_ping
        ping_at = trio.current_time() + interval
        awaiting: float | None = None  # when the ping that has no answer yet was sent
        while True:
            await trio.sleep_until(
                ping_at if awaiting is None else min(ping_at, awaiting + timeout)
            )
            now = trio.current_time()
            if awaiting is not None and self.heard_at >= awaiting:
                awaiting = None  # a pong, or any other frame, came
            if awaiting is not None and now >= awaiting + timeout:
                if on_ping is not None:
                    on_ping("timeout")
                self._dead(f"no answer to a ping within {timeout:g} s")
                return
            if now >= ping_at:
                self._ping()
                if on_ping is not None:
                    on_ping("sent")
                if awaiting is None:
                    awaiting = now
                ping_at = now + interval


class WebSocket:
    """One open client WebSocket. ``receive`` is called by one task; ``send``, ``offer``,
    ``offer_batch``, ``wait_room`` and ``drain`` (the ``FrameWriter``'s own methods) by any;
    ``run`` must run (in the owner's nursery) for the writer's task and the keepalive."""

    def __init__(
        self,
        transport: Transport,
        *,
        max_message_size: int = 16 << 20,
        write_buffer: int = WRITE_BUFFER,
        ping_interval: float = 0.0,
        ping_timeout: float | None = None,
        on_ping: Callable[[str], None] | None = None,
    ) -> None:
        self.transport = transport
        self.reader = FrameReader(max_message_size, masked=False)  # a Server's frames
        self.writer = writer = FrameWriter(transport, write_buffer, self._broke)
        # the writer's methods, bound here: no call between the hot path and the writer
        self.send = writer.send
        self.offer = writer.offer
        self.offer_batch = writer.offer_batch
        self.wait_room = writer.wait_room
        self.drain = writer.drain
        self.keepalive: Keepalive | None = None
        if ping_interval > 0:
            self.keepalive = Keepalive(
                ping_interval,
                ping_interval if ping_timeout is None else ping_timeout,
                self._ping,
                self._dead,
                on_ping,
            )
        self._inbox: deque[str | bytes] = deque()
        self._close_sent = False

    @property
    def closed(self) -> ChannelClosed | None:
        """Why the connection is closed, or None while it is open."""
        return self.writer.closed

    async def run(self) -> None:
        """The connection's own tasks, until it ends: the writer's and the keepalive's."""
        if self.keepalive is None:
            await self.writer.run()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.keepalive.run)
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
            except _BROKEN as exc:
                self._broke(exc)
                continue
            if self.keepalive is not None:
                self.keepalive.heard_at = trio.current_time()
            if data:
                self.take(data)
            else:
                self.abort(ChannelClosed(None, "the Server closed the connection, no close frame"))

    def take(self, data: bytes) -> None:
        """Read what came: messages to the inbox, a ping answered, a close answered (the
        connection ends); a frame that breaks RFC 6455 closes it with the code it calls for."""
        inbox = self._inbox
        reader = self.reader
        for op, payload in reader.feed(data):
            if op == OP_TEXT:
                inbox.append(payload.decode())  # UTF-8 checked by the reader
            elif op == OP_BINARY:
                inbox.append(payload)
            elif op == OP_PING:
                if not self._close_sent:  # closing: our close answers it
                    self.writer.control(OP_PONG, payload)
            elif op == OP_CLOSE:
                if not self._close_sent:
                    self._close_sent = True
                    self.writer.control(OP_CLOSE, payload[:2])
                self._ended(ChannelClosed(close_code_of(payload), close_reason_of(payload)))
                return
        if reader.violation is not None:
            self._close(*reader.violation)

    # -- keeping alive -------------------------------------------------------------------

    def _ping(self) -> None:
        if self.writer.closed is None and not self._close_sent:
            self.writer.control(OP_PING, b"alp")

    def _dead(self, reason: str) -> None:
        self.abort(ChannelClosed(None, reason))

    # -- ending --------------------------------------------------------------------------

    def _close(self, code: int, reason: str) -> None:
        """Start the closing handshake with ``code``; the connection counts as closed now."""
        if self.writer.closed is None and not self._close_sent:
            self._close_sent = True
            self.writer.control(OP_CLOSE, close_payload(code, reason))
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
        reader = self.reader
        try:
            while reader.violation is None:
                data = await transport.receive()
                if not data:
                    return
                if any(op == OP_CLOSE for op, _ in reader.feed(data)):
                    return
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
    """The client's opening handshake (RFC 6455 §4.1) on a connected transport: h11 writes
    the request and reads the answer; a 101 that accepts our key opens the WebSocket."""
    key = base64.b64encode(os.urandom(16))
    conn = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="GET",
        target=target,
        headers=[
            (b"Host", host.encode()),
            (b"Upgrade", b"websocket"),
            (b"Connection", b"Upgrade"),
            (b"Sec-WebSocket-Key", key),
            (b"Sec-WebSocket-Version", b"13"),
        ],
    )
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
            problem = _upgrade_problem(event.headers, key)
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


def _upgrade_problem(headers: Iterable[tuple[bytes, bytes]], key: bytes) -> str | None:
    """What is wrong with a 101 answer to our upgrade (RFC 6455 §4.1, points 1-6), or None."""
    upgrade = connection = accept = b""
    for name, value in headers:
        if name == b"upgrade":
            upgrade = value
        elif name == b"connection":
            connection += b"," + value
        elif name == b"sec-websocket-accept":
            accept = value
        elif name in (b"sec-websocket-extensions", b"sec-websocket-protocol"):
            return f"{name.decode()} that was not asked for"
    if upgrade.lower() != b"websocket":
        return "no Upgrade: websocket"
    if b"upgrade" not in (token.strip() for token in connection.lower().split(b",")):
        return "no Connection: Upgrade"
    expected = base64.b64encode(hashlib.sha1(key + _WS_GUID).digest())
    if accept.strip() != expected:
        return "a Sec-WebSocket-Accept that does not match the key"
    return None
