"""Connected sockets on trio's public lowlevel API: reads and writes tried first, TLS over MemoryBIO.

trio's high-level streams cost a checkpoint, a conflict check and a lock hand-off per operation;
on the relay's hot path that is most of the CPU a chunk costs (see the design notes). Here a
read or a write is first tried on the non-blocking socket, and only an empty socket (or a full
send buffer) waits, with ``trio.lowlevel.wait_readable``/``wait_writable``: a wait is a
checkpoint, so cancellation stays sound. TLS runs over ``ssl.MemoryBIO``/``SSLObject`` on the
same path.

One task reads and one task flushes at a time (trio refuses two waiters in one direction).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

import trio

RECV_SIZE = 65536
# what a socket operation raises once the connection is gone (reset, closed under us, TLS broken)
NET_ERRORS = (OSError, ssl.SSLError, trio.ClosedResourceError, trio.BrokenResourceError)
_wait_readable = trio.lowlevel.wait_readable
_wait_writable = trio.lowlevel.wait_writable


class Transport:
    """One connected non-blocking socket.

    ``write`` sends at once what the socket takes and keeps the rest, in order, for ``flush``;
    ``recv_nowait`` returns what has arrived (everything buffered, so waiting for readability
    afterwards is safe), ``b""`` at the end of the stream, or None when nothing has.
    """

    __slots__ = ("sock", "unsent", "closed", "recv")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.unsent = bytearray()  # bytes a write could not send yet
        self.closed = False
        # ``recv(n)``: what has arrived, ``b""`` at the end, ``BlockingIOError`` when nothing
        # has; everything buffered is returned, so waiting for readability after it is safe.
        # For a plain socket it is the socket's own method: no Python layer on the hot path.
        self.recv: Callable[[int], bytes] = sock.recv

    @property
    def secure(self) -> bool:
        return False

    # -- reading -------------------------------------------------------------------------

    def recv_nowait(self) -> bytes | None:
        """``recv``, with None when nothing has arrived."""
        try:
            return self.recv(RECV_SIZE)
        except BlockingIOError:
            return None

    async def wait_readable(self) -> None:
        await _wait_readable(self.sock)

    async def receive(self) -> bytes:
        """The next bytes that arrive (``b""`` at the end of the stream)."""
        while True:
            data = self.recv_nowait()
            if data is not None:
                return data
            await _wait_readable(self.sock)

    # -- writing -------------------------------------------------------------------------

    def write(self, data: bytes | bytearray) -> bool:
        """Send ``data`` after anything still unsent; True when nothing is left for ``flush``."""
        if self.unsent:
            self.unsent += data
            return False
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return True
        self.unsent += memoryview(data)[sent:]
        return False

    async def flush(self) -> None:
        """Wait until everything written has been sent."""
        buf = self.unsent
        sock = self.sock
        while buf:
            if self.closed:  # closed under a writer that waited its turn: not a descriptor of -1
                raise trio.ClosedResourceError("the connection was closed")
            await _wait_writable(sock)
            try:
                sent = sock.send(buf)
            except BlockingIOError:
                continue
            del buf[:sent]

    async def send_all(self, data: bytes | bytearray) -> None:
        if not self.write(data):
            await self.flush()

    # -- state ---------------------------------------------------------------------------

    def alive_when_idle(self) -> bool:
        """For a kept-alive connection: nothing arrived and the peer has not closed it."""
        if self.closed:
            return False
        try:
            return not self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; bytes: unexpected
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        """Close now; a task waiting on this socket gets ``trio.ClosedResourceError``."""
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()


class TLSTransport(Transport):
    """A ``Transport`` speaking TLS through ``ssl.SSLObject`` over two memory BIOs."""

    __slots__ = ("tls", "_incoming", "_outgoing")

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext, server_hostname: str | None
    ) -> None:
        super().__init__(sock)
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        # no host name: the server side of the connection (the hub's listener)
        self.tls = context.wrap_bio(
            self._incoming,
            self._outgoing,
            server_side=server_hostname is None,
            server_hostname=server_hostname,
        )
        self.recv = self._recv_tls

    @property
    def secure(self) -> bool:
        return True

    async def handshake(self) -> None:
        """The TLS handshake; ``ssl.SSLError`` (a refused certificate...) or ``OSError`` on failure."""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
            await self._send_encrypted()
            data = await _receive_raw(self.sock)
            if not data:
                raise ConnectionResetError(
                    "the peer closed the connection during the TLS handshake"
                )
            self._incoming.write(data)
        await self._send_encrypted()

    async def _send_encrypted(self) -> None:
        out = self._outgoing.read()
        if out and not Transport.write(self, out):
            await self.flush()

    def _recv_tls(self, size: int) -> bytes:
        data = self._read_tls(size)
        if data is None:
            raise BlockingIOError
        return data

    def _read_tls(self, size: int) -> bytes | None:
        tls = self.tls
        incoming = self._incoming
        parts: list[bytes] = []
        while True:
            try:
                parts.append(tls.read(size))
            except ssl.SSLWantReadError:
                pass  # a record is incomplete: read the socket
            except ssl.SSLZeroReturnError:  # close_notify: the end of the stream
                self._answer()
                return b"".join(parts)
            else:
                if incoming.pending or tls.pending():
                    continue  # more is buffered: return it too, so that waiting is safe after
                break
            if parts:
                break
            try:
                raw = self.sock.recv(size)
            except BlockingIOError:
                self._answer()
                return None
            if not raw:  # closed without close_notify: the end of the stream all the same
                self._answer()
                return b""
            incoming.write(raw)
        self._answer()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _answer(self) -> None:
        """Send what reading produced (a post-handshake message's answer), if anything."""
        if self._outgoing.pending:
            Transport.write(self, self._outgoing.read())

    def write(self, data: bytes | bytearray) -> bool:
        self.tls.write(data)  # a renegotiation (TLS 1.2) raises ssl.SSLError: the caller drops us
        return Transport.write(self, self._outgoing.read())


async def connect(
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> Transport:
    """A TCP connection (trio's happy eyeballs, TCP_NODELAY), TLS on top when ``ssl_context``."""
    stream = await trio.open_tcp_stream(host, port)
    sock = take_socket(stream)
    if ssl_context is None:
        return Transport(sock)
    return await start_tls(Transport(sock), ssl_context, server_hostname or host)


async def start_tls(
    plain: Transport, ssl_context: ssl.SSLContext, server_hostname: str
) -> TLSTransport:
    """TLS over an open plain transport (a proxy tunnel, a fresh connection)."""
    transport = TLSTransport(plain.sock, ssl_context, server_hostname)
    try:
        await transport.handshake()
    except BaseException:
        transport.close()
        raise
    return transport


async def _receive_raw(sock: socket.socket) -> bytes:
    while True:
        try:
            return sock.recv(RECV_SIZE)
        except BlockingIOError:
            pass  # waited for outside the handler (which would keep the exception alive)
        await _wait_readable(sock)


def take_socket(stream: trio.SocketStream) -> socket.socket:
    """The stdlib socket under a connected trio ``SocketStream`` (its fd moves over)."""
    trio_sock = stream.socket
    family, type_, proto = trio_sock.family, trio_sock.type, trio_sock.proto
    return socket.socket(family, type_, proto, fileno=trio_sock.detach())
