"""The HTTP/1.1 and WebSocket server core: typed requests to a handler over our own sockets.

Why our own: the hub's serving path writes each chunk a runner sends straight to its client's
socket from the channel's reader, and a Chat Channel needs pings whose pongs are seen; an ASGI
server gives neither (a chunk crossed four representations and two task hops there). Here each
connection is one task over a non-blocking socket (``gateway.wire.netio``, writes tried at once),
h11 parses the HTTP/1.1 heads and bodies, and the WebSocket frames are our own
(``gateway.wire.wsframes``: validated as RFC 6455 asks, a violation fails that connection).

A handler gets ``http(Request)`` (``gateway.wire.http``: the head, ``body(limit)`` read on demand
so credentials are checked first, the ``Response``) and ``websocket(WebSocketRequest)`` (accept
it, or refuse it with an HTTP status). Every bound a network server needs is here: a head
deadline and size cap, a body deadline, keep-alive idle time, a cap on open connections
(refused with 503, one warning a minute), ``Content-Length`` with ``Transfer-Encoding`` refused
and closed, a lingering close so that an early answer reaches a client still sending.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import http
import logging
import math
import socket
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import h11
import trio

from gateway.wire.errors import ClientGone, HTTPError, error_envelope
from gateway.wire.http import Request, Response
from gateway.wire.netio import RECV_SIZE, TLSTransport, Transport, take_socket
from gateway.wire.wsframes import (
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    FrameReader,
    close_code_of,
    close_payload,
    server_frame,
    text_frame,
)

log = logging.getLogger("gateway.wire.server")

CLOSE_TIMEOUT = 2.0  # s: how long a closing WebSocket waits for the peer's close frame
LINGER = 2.0  # s: a connection closed with unread input is drained this long (lingering close)
LINGER_BYTES = 1 << 20  # bytes drained at most in that time
REFUSE_TIMEOUT = 1.0  # s: a connection refused at the cap gets this long to read its 503
MAX_REFUSING = 64  # connections refused with a 503 at once; past it they are closed at once
WARN_EVERY = 60.0  # s: at most one warning this often about refused connections / EMFILE
CLOSE_NO_PONG = 1011
CLOSE_ABNORMAL = 1006  # the TCP connection ended without a close frame (RFC 6455 §7.1.5)
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_NET_ERRORS = (OSError, ssl.SSLError, trio.ClosedResourceError, trio.BrokenResourceError)
_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True, slots=True)
class Keepalive:
    """A ping every ``interval`` s (0: none); closed when nothing arrives ``timeout`` s after one."""

    interval: float = 20.0
    timeout: float = 20.0


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds of every connection (the hub's settings of the same names)."""

    # s: a request head (and a TLS handshake) must arrive within this of the connection's start
    # or, kept alive, of the previous response's end
    head_timeout: float = 10.0
    body_timeout: float = 60.0  # s: a request body must arrive within, from the end of its head
    max_head: int = 64 * 1024  # bytes: a longer request head is refused (431)
    max_connections: int = 1024  # open connections; past it new ones get a 503 and are closed
    max_message: int = 16 * 1024 * 1024  # bytes: a larger WebSocket message fails it (1009)


class Counters(Protocol):
    """What the server counts (the hub's ``HubCounters`` has these among its own)."""

    pings_sent: int
    pong_timeouts: int
    ws_protocol_errors: int
    connections_refused: int


@dataclass
class ServerCounters:
    """The server's counters, for a user that keeps none of its own."""

    pings_sent: int = 0
    pong_timeouts: int = 0
    ws_protocol_errors: int = 0
    connections_refused: int = 0


class HTTPHandler(Protocol):
    """What a plain HTTP server serves: HTTP requests (a WebSocket handshake is answered 404)."""

    async def http(self, req: Request) -> None: ...


class Handler(HTTPHandler, Protocol):
    """What the server serves: HTTP requests and WebSocket handshakes."""

    async def websocket(self, req: WebSocketRequest) -> None: ...


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def _raw_response(status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> bytes:  # type: ignore[assignment]
    """A whole HTTP/1.1 response that closes the connection, built without h11."""
    phrase = http.HTTPStatus(status).phrase.encode()
    lines = [b"HTTP/1.1 %d %s" % (status, phrase)]
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *extra,
    ]
    lines += [k + b": " + v for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _error_body(status: int, message: str, code: str) -> bytes:
    return error_envelope(message, HTTPError(status, message).type, code)


class _Conn:
    """One accepted connection: HTTP/1.1 requests in turn (keep-alive), or one WebSocket."""

    def __init__(self, server: Server, transport: Transport, client: tuple[str, int] | None):
        self.server = server
        self.limits = server.limits
        self.transport = transport
        self.client = client
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.limits.max_head)
        self.eof = False
        self.body_deadline = math.inf
        self.upgraded = False

    # -- reading ---------------------------------------------------------------------------

    async def _fill(self) -> None:
        """Read what arrived into h11 (waiting for it); the end of the stream noted."""
        data = await self.transport.receive()
        if data:
            self.h11.receive_data(data)
        else:
            self.eof = True
            self.h11.receive_data(b"")

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                if self.eof:
                    return h11.ConnectionClosed()
                await self._fill()
                continue
            return event

    async def read_body(self, limit: int, resp: Response) -> bytes:
        """The request's whole body: HTTPError 413 past ``limit`` (from ``Content-Length`` before
        any of it is read), 408 past the body deadline, 400 for broken chunked framing;
        ClientGone when the client leaves mid-upload (one DEBUG line)."""
        h = self.h11
        if h.their_state is not h11.SEND_BODY:
            return b""
        declared = self._declared_length
        if declared is not None and declared > limit:
            raise _too_large(limit)
        if h.they_are_waiting_for_100_continue:
            resp.write_raw(h.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
        parts: list[bytes] = []
        size = 0
        with trio.move_on_at(self.body_deadline):
            try:
                while True:
                    event = await self.next_event()
                    if isinstance(event, h11.Data):
                        size += len(event.data)
                        if size > limit:
                            raise _too_large(limit)
                        parts.append(bytes(event.data))
                    elif isinstance(event, h11.EndOfMessage):
                        return b"".join(parts)
                    else:
                        break
            except h11.RemoteProtocolError as exc:
                if not self.eof:
                    raise HTTPError(
                        400, f"malformed request body: {exc}", "invalid_request"
                    ) from None
            except _NET_ERRORS as exc:
                log.debug("client %s left mid-upload: %r", self.client, exc)
                resp.gone = True
                raise ClientGone() from None
            log.debug("client %s left mid-upload (%d bytes read)", self.client, size)
            resp.gone = True
            raise ClientGone()
        raise HTTPError(
            408,
            f"request body not received within {self.limits.body_timeout:g} s",
            "request_timeout",
        )

    async def wait_disconnect(self) -> None:
        """Return once the client has gone (bytes it pipelines meanwhile are kept, bounded)."""
        while not self.eof:
            if len(self.h11.trailing_data[0]) > self.limits.max_head:
                await trio.sleep_forever()  # it floods while it waits: stop reading it
            try:
                data = await self.transport.receive()
            except _NET_ERRORS:
                data = b""
            if not data:
                self.eof = True
                return
            self.h11.receive_data(data)

    # -- serving ---------------------------------------------------------------------------

    async def serve(self) -> None:
        first = True
        while True:
            if not first and not self.h11.trailing_data[0]:
                with trio.move_on_after(self.limits.head_timeout) as idle:
                    try:
                        await self._fill()
                    except _NET_ERRORS:
                        return
                if idle.cancelled_caught:
                    return  # idle past the keep-alive time
            event: Any = None
            with trio.move_on_after(self.limits.head_timeout) as waited:
                try:
                    event = await self.next_event()
                except h11.RemoteProtocolError as exc:
                    status = exc.error_status_hint
                    await self.refuse(status, f"bad request: {exc}", "invalid_request")
                    return
                except _NET_ERRORS:
                    return
            if waited.cancelled_caught:
                if self.h11.trailing_data[0]:
                    why = f"request head not received within {self.limits.head_timeout:g} s"
                    await self.refuse(408, why, "request_timeout")
                return
            if not isinstance(event, h11.Request):
                return  # the client closed
            first = False
            headers = list(event.headers)
            size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in headers)
            if size > self.limits.max_head:  # h11 bounds a head only while it is incomplete
                await self.refuse(
                    431, f"request head over {self.limits.max_head} bytes", "head_too_large"
                )
                return
            if _header(headers, b"transfer-encoding") is not None:
                if _header(headers, b"content-length") is not None:
                    await self.refuse(
                        400,
                        "a request with both Content-Length and Transfer-Encoding is refused",
                        "invalid_request",
                    )
                    return
            upgrade = _header(headers, b"upgrade")
            if upgrade is not None and upgrade.lower() == b"websocket":
                await self._websocket(event, headers)
                return
            if not await self._request(event, headers):
                return
            if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                self.h11.start_next_cycle()
            else:
                return

    @property
    def _declared_length(self) -> int | None:
        raw = self._content_length
        return int(raw) if raw is not None and raw.isdigit() else None

    async def refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an error body and close (a malformed or timed-out request)."""
        log.debug("refusing client %s: %d %.200r", self.client, status, message)
        data = _raw_response(status, _error_body(status, message, code))
        with trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await self.transport.send_all(data)
            except _NET_ERRORS:
                pass

    def _scope(self, kind: str, event: h11.Request, headers: list[tuple[bytes, bytes]]) -> dict:
        raw_path, _, query = bytes(event.target).partition(b"?")
        return {
            "type": kind,
            "http_version": event.http_version.decode(),
            "method": event.method.decode(),
            "path": urllib.parse.unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "headers": headers,
            "client": self.client,
            "scheme": "https" if self.transport.secure else "http",
        }

    async def _request(self, event: h11.Request, headers: list[tuple[bytes, bytes]]) -> bool:
        """One request through the handler; True when the connection may serve another."""
        self._content_length = _header(headers, b"content-length")
        self.body_deadline = trio.current_time() + self.limits.body_timeout
        if self._declared_length == 0 or (
            self._content_length is None and _header(headers, b"transfer-encoding") is None
        ):
            event_after = self.h11.next_event()  # no body: its end is there already
            assert isinstance(event_after, h11.EndOfMessage), event_after
        resp = Response(self.h11, self.transport, event.http_version == b"1.0", event.method)
        req = Request(self, self._scope("http", event, headers), resp)
        try:
            await self.server.handler.http(req)
        except ClientGone:
            resp.gone = True
        if resp.gone:
            return False
        try:
            if not resp.started:
                await resp.error(HTTPError(500, "the server sent no response", "internal_error"))
            elif not resp.finished:
                resp.end_nowait()
            await resp.flush()
        except (ClientGone, h11.LocalProtocolError):
            return False
        if self.h11.their_state is not h11.DONE:
            return False  # its body was not read (refused first): the connection closes
        return not resp.close_after

    async def _websocket(self, event: h11.Request, headers: list[tuple[bytes, bytes]]) -> None:
        length = _header(headers, b"content-length")
        if (length is not None and length.strip() != b"0") or _header(
            headers, b"transfer-encoding"
        ) is not None:
            await self.refuse(400, "a WebSocket handshake carries no body", "invalid_request")
            return
        key = _header(headers, b"sec-websocket-key")
        version = _header(headers, b"sec-websocket-version")
        if event.method != b"GET" or not key or version != b"13":
            await self.refuse(
                400, "bad WebSocket handshake (GET, Sec-WebSocket-Key, version 13)", "bad_handshake"
            )
            return
        websocket = getattr(self.server.handler, "websocket", None)
        if websocket is None:  # a plain HTTP handler
            await self.refuse(404, "not found", "unknown_url")
            return
        req = WebSocketRequest(self, self._scope("websocket", event, headers), key)
        await websocket(req)
        if not req.answered:
            await self.refuse(404, "not found", "unknown_url")

    _content_length: bytes | None = None


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body exceeds {limit} bytes", "request_too_large")


class WebSocketRequest:
    """A WebSocket handshake as its handler sees it: ``scope`` (path, query, headers), then
    ``accept()`` (the 101 and the open ``ServerWebSocket``) or ``refuse(status)``."""

    def __init__(self, conn: _Conn, scope: dict[str, Any], key: bytes) -> None:
        self._conn = conn
        self.scope = scope
        self._key = key
        self.answered = False

    async def accept(self) -> ServerWebSocket:
        self.answered = True
        conn = self._conn
        digest = hashlib.sha1(self._key.strip() + _WS_GUID).digest()
        head = (
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + base64.b64encode(digest) + b"\r\n\r\n"
        )
        conn.upgraded = True
        leftover = bytes(conn.h11.trailing_data[0])
        ws = ServerWebSocket(conn.transport, leftover, conn.server, self.scope["path"])
        try:
            await conn.transport.send_all(head)
        except _NET_ERRORS as exc:
            raise ClientGone() from exc
        return ws

    async def refuse(
        self, status: int, message: str = "forbidden", code: str = "forbidden"
    ) -> None:
        self.answered = True
        await self._conn.refuse(status, message, code)


class ServerWebSocket:
    """One accepted WebSocket, the server's end: ``run`` reads it in the connection's own task
    (messages handed over a read's worth at a time), pings it, and says how it ended; text goes
    out with ``send_text`` (written at once, waiting only when the socket is full)."""

    def __init__(self, transport: Transport, leftover: bytes, server: Server, path: str) -> None:
        self.transport = transport
        self.server = server
        self.path = path
        self.reader = FrameReader(server.limits.max_message)
        self._leftover = leftover
        self.rx_at = trio.current_time()  # trio clock of the last bytes read
        self.close_sent = False
        self.close_code: int | None = None  # why it ended
        self.app_blocked = False  # the reader waits for a slow consumer of its messages
        self.unblocked_at = -math.inf
        self._flush_lock = trio.Lock()
        self._scope = trio.CancelScope()  # the reader's: its deadline set once we close
        self._nursery: trio.Nursery | None = None

    @property
    def open(self) -> bool:
        return not self.close_sent and not self.transport.closed

    def _write(self, data: bytes) -> bool:
        try:
            return self.transport.write(data)
        except _NET_ERRORS as exc:
            raise ClientGone(f"the WebSocket is gone: {exc!r}") from exc

    async def flush(self) -> None:
        async with self._flush_lock:
            try:
                await self.transport.flush()
            except _NET_ERRORS as exc:
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

    def _control_nowait(self, opcode: int, payload: bytes) -> None:
        """A control frame from the reader: written at once, the rest flushed by a task."""
        try:
            done = self._write(server_frame(opcode, payload))
        except ClientGone:
            return
        if not done and self._nursery is not None:
            self._nursery.start_soon(self._flush_quietly)

    async def _flush_quietly(self) -> None:
        try:
            await self.flush()
        except ClientGone:
            pass

    def close_nowait(self, code: int, reason: str = "") -> None:
        """Send our close frame once; the reader then waits ``CLOSE_TIMEOUT`` for the answer."""
        if self.close_sent or self.transport.closed:
            return
        self.close_sent = True
        if self.close_code is None:
            self.close_code = code
        self._control_nowait(OP_CLOSE, close_payload(code, reason))
        self._scope.deadline = min(self._scope.deadline, trio.current_time() + CLOSE_TIMEOUT)

    async def run(self, on_texts: Callable[[list[bytes]], Awaitable[None]]) -> int:
        """Read until the WebSocket ends; the close code it ended with (1006: no close frame)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                keepalive = self.server.keepalive
                if keepalive.interval > 0:
                    nursery.start_soon(self._keepalive, keepalive)
                try:
                    with self._scope:
                        await self._read(on_texts)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self.transport.close()
        return self.close_code if self.close_code is not None else CLOSE_ABNORMAL

    async def _read(self, on_texts: Callable[[list[bytes]], Awaitable[None]]) -> None:
        transport = self.transport
        recv = transport.recv
        feed = self.reader.feed
        data: bytes | None = self._leftover or None
        self._leftover = b""
        found = 0
        while True:
            if data is None:
                try:
                    data = recv(RECV_SIZE)
                except BlockingIOError:
                    found = 0
                    try:
                        await transport.wait_readable()
                    except _NET_ERRORS:
                        return
                    continue
                except _NET_ERRORS:
                    return
                if not data:
                    return  # the end of the stream
            self.rx_at = trio.current_time()
            texts: list[bytes] | None = None
            for op, payload in feed(data):
                if op == OP_TEXT:
                    if texts is None:
                        texts = [payload]
                    else:
                        texts.append(payload)
                elif op == OP_PING:
                    if not self.close_sent:
                        self._control_nowait(OP_PONG, payload)
                elif op == OP_CLOSE:
                    if texts is not None:
                        await self._hand(on_texts, texts)
                    code = close_code_of(payload)
                    if self.close_code is None:
                        self.close_code = code
                    if not self.close_sent:
                        self.close_sent = True
                        self._control_nowait(OP_CLOSE, payload[:2])
                    return
            if texts is not None:
                await self._hand(on_texts, texts)
            violation = self.reader.violation
            if violation is not None:
                code, reason = violation
                self.server.counters.ws_protocol_errors += 1
                log.info("WebSocket %s: %s: failing it with %d", self.path, reason, code)
                self.close_code = code
                self._close_frame_once(code, reason)
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
            self.unblocked_at = trio.current_time()

    async def _keepalive(self, keepalive: Keepalive) -> None:
        """A ping every interval; closed (1011) when nothing came ``timeout`` after one. A reader
        waiting for a slow consumer counts as alive (the consumer is slow, not the path)."""
        counters = self.server.counters
        next_ping = trio.current_time() + keepalive.interval
        unanswered: float | None = None  # trio clock of the oldest ping nothing came after
        while self.open:
            due = (
                next_ping if unanswered is None else min(next_ping, unanswered + keepalive.timeout)
            )
            await trio.sleep_until(due)
            now = trio.current_time()
            heard = max(self.rx_at, self.unblocked_at)
            if unanswered is not None and (heard > unanswered or self.app_blocked):
                unanswered = None
            if unanswered is not None and now >= unanswered + keepalive.timeout:
                self._dead(keepalive.timeout)
                return
            if now >= next_ping:
                next_ping = now + keepalive.interval
                if self.open:
                    if unanswered is None:
                        unanswered = now
                    self._control_nowait(OP_PING, b"alp")
                    counters.pings_sent += 1

    def _dead(self, silent_for: float) -> None:
        counters = self.server.counters
        counters.pong_timeouts += 1
        self.close_code = CLOSE_NO_PONG
        reason = f"no pong within {silent_for:g} s"
        log.warning(
            "WebSocket %s: %s, closing it (pings sent %d, pong timeouts %d)",
            self.path,
            reason,
            counters.pings_sent,
            counters.pong_timeouts,
        )
        self._close_frame_once(CLOSE_NO_PONG, reason)
        self._scope.cancel()

    def _close_frame_once(self, code: int, reason: str) -> None:
        """Our close frame, written at once if none went yet (the connection is being failed:
        nothing waits for it)."""
        if not self.close_sent:
            self.close_sent = True
            try:
                self._write(server_frame(OP_CLOSE, close_payload(code, reason)))
            except ClientGone:
                pass


class Server:
    """Serves a ``Handler`` on TCP (or TLS) listeners within ``limits``; WebSockets get the
    ``keepalive`` pings; ``counters`` count pings, pong timeouts, refusals."""

    def __init__(
        self,
        handler: HTTPHandler,
        *,
        keepalive: Keepalive | None = None,
        counters: Counters | None = None,
        limits: Limits | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.handler = handler
        self.keepalive = keepalive or Keepalive()
        self.counters: Counters = counters if counters is not None else ServerCounters()
        self.limits = limits or Limits()
        self.ssl_context = ssl_context
        self.open_connections = 0
        self._refusing = 0  # refused connections still being told so
        self._warned_at = -math.inf

    async def serve(
        self, host: str, port: int, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``host:port`` (0: a free port) until cancelled; ``started`` gets the URL."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        await self.serve_listeners(listeners, task_status)

    async def serve_listeners(
        self,
        listeners: list[trio.SocketListener],
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on ``listeners``, already bound (so that a busy port failed earlier), until
        cancelled; they are closed then. ``started`` gets the URL of the first."""
        bound = listeners[0].socket.getsockname()
        scheme = "https" if self.ssl_context is not None else "http"
        shown_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        try:
            async with trio.open_nursery() as nursery:
                for listener in listeners:
                    nursery.start_soon(self._accept, listener, nursery)
                task_status.started(f"{scheme}://{shown_host}:{bound[1]}")
        finally:
            for listener in listeners:
                listener.socket.close()

    def _warn(self, message: str, *args: Any) -> None:
        now = trio.current_time()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(message, *args)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_ERRNOS:
                    raise
                self.counters.connections_refused += 1
                self._warn(
                    "cannot accept connections: %s (open: %d)", exc.strerror, self.open_connections
                )
                await trio.sleep(0.1)
                continue
            sock = take_socket(stream)
            if self.open_connections >= self.limits.max_connections:
                self.counters.connections_refused += 1
                self._warn(
                    "%d connections open (max_connections): refusing new ones with 503 "
                    "(refused so far: %d)",
                    self.open_connections,
                    self.counters.connections_refused,
                )
                if self._refusing < MAX_REFUSING:
                    self._refusing += 1
                    nursery.start_soon(self._refuse_busy, sock)
                else:  # a flood: no 503 for these, just the close
                    sock.close()
                continue
            self.open_connections += 1
            nursery.start_soon(self._handle, sock)

    async def _refuse_busy(self, sock: socket.socket) -> None:
        """A connection past the cap: a 503 written at once, a moment for the client to read it."""
        sock.setblocking(False)
        try:
            sock.send(_BUSY)
            sock.shutdown(socket.SHUT_WR)
            with trio.move_on_after(REFUSE_TIMEOUT):
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    if not sock.recv(65536):
                        break
        except OSError:
            pass
        finally:
            self._refusing -= 1
            sock.close()

    async def _handle(self, sock: socket.socket) -> None:
        transport: Transport | None = None
        try:
            client = _address(sock)
            if self.ssl_context is not None:
                transport = TLSTransport(sock, self.ssl_context, None)
                with trio.move_on_after(self.limits.head_timeout) as waited:
                    try:
                        await transport.handshake()  # type: ignore[attr-defined]
                    except _NET_ERRORS as exc:
                        log.debug("TLS handshake with %s failed: %r", client, exc)
                        return
                if waited.cancelled_caught:
                    return
            else:
                transport = Transport(sock)
            conn = _Conn(self, transport, client)
            try:
                await conn.serve()
            except _NET_ERRORS as exc:
                log.debug("connection from %s ended: %r", client, exc)
            if not conn.upgraded and not conn.eof:
                await _linger(transport)
        except Exception:
            log.exception("unexpected error serving a connection")
        finally:
            self.open_connections -= 1
            if transport is not None:
                transport.close()
            else:
                sock.close()


async def _linger(transport: Transport) -> None:
    """Close our side, then drain what the client still sends for a moment (so that an answer
    given before its request was read reaches it, instead of a reset)."""
    with trio.move_on_after(LINGER):
        try:
            if transport.unsent:
                await transport.flush()
            transport.sock.shutdown(socket.SHUT_WR)
            drained = 0
            while drained < LINGER_BYTES:
                data = await transport.receive()
                if not data:
                    return
                drained += len(data)
        except _NET_ERRORS:
            return


_BUSY = _raw_response(
    503,
    _error_body(
        503, "the server has too many open connections; retry shortly", "too_many_connections"
    ),
    [(b"retry-after", b"1")],
)


def _address(sock: socket.socket) -> tuple[str, int] | None:
    try:
        addr = sock.getpeername()
    except OSError:
        return None
    return (str(addr[0]), int(addr[1]))


__all__ = [
    "CLOSE_ABNORMAL",
    "CLOSE_NO_PONG",
    "HTTPHandler",
    "Handler",
    "Keepalive",
    "Counters",
    "Limits",
    "Server",
    "ServerCounters",
    "ServerWebSocket",
    "WebSocketRequest",
]
