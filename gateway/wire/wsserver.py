"""The server's end of an accepted WebSocket: its socket I/O around a ``WebSocketConnection``.

``gateway.wire.wsconn`` decides (the close handshake, pongs, the keepalive clock, the bounds);
this module reads and writes. ``run`` reads in the connection's own task and hands each read's
text messages over at once (``on_texts``: the hub's channel reader writes a turn's chunks to its
client from there). Text goes out with ``send_text``, written at once, waiting only when the
socket is full. Control frames owed to the peer (a pong, our ping, our close) are written when
the socket has room, else by the one flusher task of the connection once it has: never a task
per frame, never more than one of each waiting.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from gateway.wire.errors import ClientGone
from gateway.wire.netio import NET_ERRORS, RECV_SIZE, Transport
from gateway.wire.sweeper import Sweeper
from gateway.wire.wsconn import (
    CLOSE_ABNORMAL,
    CLOSE_NO_PONG,
    Tick,
    WebSocketConnection,
    WsState,
)
from gateway.wire.wsframes import OP_TEXT, server_frame, text_frame

log = logging.getLogger("gateway.wire.server")

CLOSE_TIMEOUT = 2.0  # s: how long a closing WebSocket waits for the peer's close frame
_OPEN = WsState.OPEN
_CLOSED = WsState.CLOSED


class WebSocketCounters(Protocol):
    """What a server's WebSockets count (the hub's ``HubCounters`` has these among its own)."""

    pings_sent: int
    pong_timeouts: int
    ws_protocol_errors: int


class ServerWebSocket:
    """One accepted WebSocket, the server's end: ``run`` reads it in the connection's own task
    (messages handed over a read's worth at a time), pings it, and says how it ended; text goes
    out with ``send_text`` (written at once, waiting only when the socket is full)."""

    def __init__(
        self,
        transport: Transport,
        leftover: bytes,
        conn: WebSocketConnection,
        counters: WebSocketCounters,
        path: str,
        sweeper: Sweeper,
    ) -> None:
        self.transport = transport
        self.conn = conn
        self.counters = counters
        self.path = path
        self._leftover = leftover  # frames that came with the handshake
        self.app_blocked = False  # the reader waits for a slow consumer of its messages
        # told at each of the peer's pings, and at each keepalive wake while the peer was heard
        # from: the hub's channel makes it its runner's sign of life, in place of a heartbeat's
        self.on_alive: Callable[[], None] | None = None
        self._asleep: trio.CancelScope | None = None  # the keepalive's wait, while it waits
        self._sweeper = sweeper  # its deadline (the server's: not trio's heap, moved a ping)
        self._slot = -1  # where it is filed there
        self._flush_lock = trio.Lock()
        self._wake = trio.Event()  # the flusher has control frames to write once there is room
        self._scope = trio.CancelScope()  # the reader's: its deadline set once we close

    @property
    def open(self) -> bool:
        return self.conn.state is _OPEN and not self.transport.closed

    @property
    def close_code(self) -> int | None:
        """The code the WebSocket ended (or is ending) with; None while open."""
        return self.conn.close_code

    # -- writing ---------------------------------------------------------------------------

    def _write(self, data: bytes) -> bool:
        try:
            return self.transport.write(data)
        except NET_ERRORS as exc:
            raise ClientGone(f"the WebSocket is gone: {exc!r}") from exc

    async def flush(self) -> None:
        async with self._flush_lock:
            try:
                await self.transport.flush()
            except NET_ERRORS as exc:
                raise ClientGone(f"the WebSocket is gone: {exc!r}") from exc

    async def send_text(self, data: bytes) -> None:
        """One text message (UTF-8 bytes); ClientGone once the WebSocket is closing or gone."""
        if not self.open:
            raise ClientGone("the WebSocket is closed")
        if not self._write(text_frame(data)):
            await self.flush()

    async def send_message(self, opcode: int, payload: bytes) -> None:
        """One frame of ``opcode`` (binary, a control frame); ClientGone once closing or gone."""
        if not self.open:
            raise ClientGone("the WebSocket is closed")
        if not self._write(server_frame(opcode, payload)):
            await self.flush()

    def _send_controls(self) -> None:
        """Write the control frames owed now if the socket has room; else the flusher writes
        them once it has (meanwhile a newer pong replaces an older one: nothing piles up)."""
        transport = self.transport
        if transport.closed:
            return
        if transport.unsent:
            self._wake.set()
            return
        try:
            done = transport.write(self.conn.data_to_send())
        except NET_ERRORS:
            return  # the reader finds the socket gone
        if not done:
            self._wake.set()

    async def _flusher(self) -> None:
        """The connection's one flusher: when control frames wait for room, flush, write them."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self.flush()
            except ClientGone:
                return
            if self.conn.pending:
                self._send_controls()

    def close_nowait(self, code: int, reason: str = "") -> None:
        """Send our close frame once; the reader then waits ``CLOSE_TIMEOUT`` for the answer."""
        conn = self.conn
        if conn.state is not _OPEN or self.transport.closed:
            return
        conn.close(code, reason)
        self._send_controls()
        self._scope.deadline = min(self._scope.deadline, trio.current_time() + CLOSE_TIMEOUT)

    # -- reading ---------------------------------------------------------------------------

    async def run(self, on_texts: Callable[[list[bytes]], Awaitable[None]]) -> int:
        """Read until the WebSocket ends; the close code it ended with (1006: no close frame).
        A close frame still owed (an answer, a failure's) gets ``CLOSE_TIMEOUT`` to go."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._flusher)
                if self.conn.keepalive is not None:
                    nursery.start_soon(self._keepalive)
                try:
                    with self._scope:
                        await self._read(on_texts)
                finally:
                    nursery.cancel_scope.cancel()
            await self._finish()
        finally:
            self.transport.close()
        code = self.conn.close_code
        return code if code is not None else CLOSE_ABNORMAL

    async def _finish(self) -> None:
        """Write what is still owed (our close frame, its answer) and let it go, bounded."""
        transport = self.transport
        if transport.closed or not (self.conn.pending or transport.unsent):
            return
        with trio.move_on_after(CLOSE_TIMEOUT):
            async with self._flush_lock:
                try:
                    if self.conn.pending:
                        transport.write(self.conn.data_to_send())
                    await transport.flush()
                except NET_ERRORS:
                    pass

    async def _read(self, on_texts: Callable[[list[bytes]], Awaitable[None]]) -> None:
        transport = self.transport
        recv = transport.recv
        conn = self.conn
        receive = conn.receive
        data: bytes | None = self._leftover or None
        self._leftover = b""
        found = 0
        # the last read took all the socket had: wait for readability before the next, not a
        # read that finds nothing (a syscall and an exception per read of a turn's frames)
        drained = False
        while True:
            if data is None:
                try:
                    if drained:
                        drained, found = False, 0
                        await transport.wait_readable()
                    data = recv(RECV_SIZE)
                except BlockingIOError:
                    drained = True
                    continue
                except NET_ERRORS:
                    return
                if not data:
                    return  # the end of the stream
                drained = len(data) < RECV_SIZE
            messages = receive(data, trio.current_time())
            if conn.pending:  # a ping came (or a close): answered
                self._send_controls()
                self._pinged()
            if messages:
                texts = [payload for op, payload in messages if op == OP_TEXT]
                if texts:
                    await self._hand(on_texts, texts)
            if conn.state is _CLOSED:
                failure = conn.failure
                if failure is not None:
                    code, reason = failure
                    self.counters.ws_protocol_errors += 1
                    log.info("WebSocket %s: %s: failing it with %d", self.path, reason, code)
                return
            data = None
            found += 1
            if found >= 16:  # a reader that always finds data still lets others run
                found = 0
                await trio.lowlevel.checkpoint()

    async def _hand(
        self, on_texts: Callable[[list[bytes]], Awaitable[None]], texts: list[bytes]
    ) -> None:
        self.app_blocked = True
        try:
            await on_texts(texts)
        finally:
            self.app_blocked = False
            self.conn.heard(trio.current_time())

    # -- keeping alive ---------------------------------------------------------------------

    def _pinged(self) -> None:
        """The peer pinged: its sign of life, and our keepalive's wake moved to when it is due
        now (a peer that pings every interval is never pinged back, and our keepalive sleeps
        through: a timer that fires costs trio a cancellation, a deadline moved does not; moved
        on the server's sweeper, not trio's deadline heap)."""
        asleep = self._asleep
        if asleep is not None:
            self._slot = self._sweeper.move(asleep, self._slot, self.conn.next_tick())
        alive = self.on_alive
        if alive is not None:
            alive()

    async def _keepalive(self) -> None:
        """The keepalive clock's I/O: a ping when due (the peer silent for an interval); the
        peer's sign of life (``on_alive``) at each wake while it is heard from; the WebSocket
        failed (1011) when the peer stays silent. A reader waiting for a slow consumer counts as alive (the consumer
        is slow, not the path)."""
        conn = self.conn
        counters = self.counters
        sweeper = self._sweeper
        while True:
            with trio.CancelScope() as asleep:
                self._asleep = asleep
                self._slot = sweeper.file(asleep, conn.next_tick())
                try:
                    await trio.sleep_forever()
                finally:
                    sweeper.unfile(asleep, self._slot)
            self._asleep = None
            now = trio.current_time()
            blocked = self.app_blocked
            if blocked:
                conn.unread()
            tick = conn.tick(now)
            alive = self.on_alive  # at each wake (about once an interval): the peer's pings,
            if alive is not None and conn.keepalive is not None:  # pongs or messages lately
                if blocked or now - conn.heard_at <= conn.keepalive.quiet + conn.keepalive.timeout:
                    alive()
            if tick is Tick.PING:
                counters.pings_sent += 1
                self._send_controls()
            elif tick is Tick.DEAD:
                counters.pong_timeouts += 1
                reason = conn.silence()
                log.warning(
                    "WebSocket %s: %s, closing it (pings sent %d, pong timeouts %d)",
                    self.path,
                    reason,
                    counters.pings_sent,
                    counters.pong_timeouts,
                )
                conn.fail(CLOSE_NO_PONG, reason)
                self._send_controls()
                self._scope.cancel()
                return


__all__ = ["CLOSE_TIMEOUT", "ServerWebSocket", "WebSocketCounters"]
