"""One accepted connection of the server core: HTTP/1.1 requests in turn (httptools), or a WebSocket.

httptools (llhttp, in C) parses each head and body (``gateway.wire.httpparse``); the core writes
every response head itself (``gateway.wire.http.Response``). Not h11, which did both before:
~47 µs of Python a short request in process against ~2 µs here (bench/README.md, issue 29). A request goes to the handler as a ``Request`` (``gateway.wire.http``) with the head
already checked: size, deadline, ``Host``, ``Content-Length`` with ``Transfer-Encoding``
refused (llhttp refuses it, and every other framing it cannot read unambiguously: duplicate
lengths, a transfer coding but chunked, a malformed chunk). Requests pipelined behind one are
parsed ahead and served in order. An absolute-form request line (``GET http://host/path``) is
routed by its path and its authority stands for ``Host`` (RFC 9112 §3.2.2, §7.2); a ``HEAD`` is
routed as its ``GET`` and the response leaves the body out (RFC 9110 §9.3.2). An upgrade to
WebSocket is checked (``gateway.wire.wsconn``) and handed to the handler as a
``WebSocketRequest``: accepted, the connection becomes a ``ServerWebSocket``
(``gateway.wire.wsserver``). A refusal is a whole error response that closes the connection;
the close lingers, so that an early answer reaches a client still sending.
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

import httptools
import trio

from gateway.wire.errors import ClientGone, HTTPError, error_envelope
from gateway.wire.http import STATUS_LINES, Request, Response
from gateway.wire.httpparse import RequestHead, RequestParser, origin_form
from gateway.wire.netio import NET_ERRORS, RECV_SIZE, TLSTransport, Transport
from gateway.wire.park import Park
from gateway.wire.sweeper import Sweeper
from gateway.wire.wsconn import (
    Keepalive,
    WebSocketConnection,
    accept_headers,
    upgrade_key,
)
from gateway.wire.wsserver import CLOSE_TIMEOUT, ServerWebSocket, WebSocketCounters

log = logging.getLogger("gateway.wire.server")

LINGER = 2.0  # s: a connection closed with unread input is drained this long (lingering close)
LINGER_BYTES = 1 << 20  # bytes drained at most in that time
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
BAD_HANDSHAKE = "bad WebSocket handshake (GET, Connection: Upgrade, Sec-WebSocket-Key, version 13)"
MAX_CHUNK_LINE = 16 * 1024  # bytes: a chunked body's size line (with its extension), or trailers


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The bounds of every connection (the hub's settings of the same names)."""

    head_timeout: float = 10.0  # s: a head (and TLS) within this of the start, or of its 1st byte
    keepalive_timeout: float = 30.0  # s: a kept-alive connection's wait for its next request
    body_timeout: float = 60.0  # s: a request body must arrive within, from the end of its head
    max_head: int = 64 * 1024  # bytes: a longer request head is refused (431)
    max_connections: int = 1024  # open connections; past it new ones get a 503 and are closed
    max_message: int = 16 * 1024 * 1024  # bytes: a larger WebSocket message fails it (1009)


class HTTPHandler(Protocol):
    """What a plain HTTP server serves: HTTP requests (a WebSocket handshake is answered 404)."""

    async def http(self, req: Request) -> None: ...


class Handler(HTTPHandler, Protocol):
    """What the server serves: HTTP requests and WebSocket handshakes."""

    async def websocket(self, req: WebSocketRequest) -> None: ...


class ConnectionHost(Protocol):
    """What a connection is served with (the listener, ``gateway.wire.server.Server``)."""

    @property
    def handler(self) -> HTTPHandler: ...
    @property
    def limits(self) -> ConnectionLimits: ...
    @property
    def keepalive(self) -> Keepalive: ...
    @property
    def counters(self) -> WebSocketCounters: ...
    @property
    def sweeper(self) -> Sweeper: ...


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    head_only: bool = False,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """A whole error response (the error envelope) that closes the connection; ``head_only``:
    the request was a HEAD (no body)."""
    body = error_envelope(message, HTTPError(status, message).type, code)
    fields = b"".join(b"%b: %b\r\n" % field for field in extra or [])
    head = (
        b"%bcontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n%b\r\n"
        % (
            STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status,
            len(body),
            fields,
        )
    )
    return head if head_only else head + body


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body exceeds {limit} bytes", "request_too_large")


def _take_body(req: RequestHead, limit: int) -> bytes:
    """A complete request's body, handed over once (413 past ``limit``)."""
    body = req.body
    assert body is not None
    if len(body) > limit:
        raise _too_large(limit)
    req.body = b""
    return body


class HTTPConnection:
    """One accepted connection: HTTP/1.1 requests in turn (keep-alive), or one WebSocket.

    What is read is fed to its ``RequestParser``; the heads it parsed are served in order.
    ``body_pending`` and ``keep_alive`` are the request being served's (its ``Response`` reads
    them when it writes its head).
    """

    def __init__(
        self, serving: ConnectionHost, transport: Transport, client: tuple[str, int] | None
    ) -> None:
        self.serving = serving
        self.limits = serving.limits
        self.transport = transport
        self.client = client
        self.scheme = "https" if transport.secure else "http"
        self.eof = False
        self.body_deadline = math.inf
        self.upgraded = False
        self.keep_alive = True  # the request being served lets another follow it
        self._kept = False  # a request was served: the next waits ``keepalive_timeout``
        self._now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self._parser = RequestParser()
        self._req: RequestHead | None = None  # the request being served
        self._method = b""  # the request being served's (a refusal leaves out HEAD's body)
        self._unfed = b""  # bytes read while a response was on its way, parsed next
        self._head_bytes = 0  # bytes read while waiting for the next head
        # the last read took all the socket had: the next waits for readability first, not a
        # read that finds nothing (a syscall and an exception a request)
        self._drained = False
        self._waiting = trio.CancelScope()  # where heads are awaited (``serve``)

    @property
    def body_pending(self) -> bool:
        """The request being served has body bytes still to come."""
        req = self._req
        return req is not None and not req.complete

    def upgrade_rest(self) -> bytes:
        """After an upgrade's head: the bytes that came after it (the new protocol's)."""
        return self._parser.take_rest()

    def parser_done(self) -> None:
        """The connection has ended: its parser let go at once (``RequestParser.close``)."""
        self._parser.close()

    async def _fill(self) -> None:
        """Read what arrived and parse it (waiting for it); the end of the stream noted."""
        transport = self.transport
        if self._drained:
            await transport.wait_readable()
        data = await transport.receive()
        self._drained = len(data) < RECV_SIZE
        if data:
            self._head_bytes += len(data)
            self._parser.feed(data)
        else:
            self.eof = True

    async def read_body(self, limit: int, resp: Response) -> bytes:
        """The request's whole body: HTTPError 413 past ``limit`` (from ``Content-Length`` before
        any of it is read), 408 past the body deadline, 400 for broken chunked framing;
        ClientGone when the client leaves mid-upload (one DEBUG line)."""
        req = self._req
        assert req is not None
        if req.complete:  # it came with its head: the usual case
            return _take_body(req, limit)
        declared = self._declared_length
        if declared is not None and declared > limit:
            raise _too_large(limit)
        parser = self._parser
        parts = parser.body
        if req.expect and not parts:
            resp.write_raw(CONTINUE)  # the client waits for it before it sends the body
        size = -1
        framing = 0  # bytes read since the body last grew: a chunk line, its extension, trailers
        with trio.move_on_at(self.body_deadline):
            try:
                while not req.complete:
                    if parser.broken is not None:
                        raise HTTPError(
                            400, f"malformed request body: {parser.broken}", "invalid_request"
                        )
                    grown = sum(map(len, parts))
                    if grown > limit:
                        raise _too_large(limit)
                    if grown != size:
                        size, framing = grown, 0
                    elif framing > MAX_CHUNK_LINE:  # llhttp skips an extension to its end
                        raise HTTPError(
                            400,
                            f"a chunk's size line or trailers over {MAX_CHUNK_LINE} bytes",
                            "invalid_request",
                        )
                    if self.eof:
                        break
                    before = self._head_bytes
                    await self._fill()
                    framing += self._head_bytes - before
            except NET_ERRORS as exc:
                log.debug("client %s left mid-upload: %r", self.client, exc)
                resp.gone = True
                raise ClientGone() from None
            if req.complete:
                return _take_body(req, limit)
            log.debug(
                "client %s left mid-upload (%d bytes read)", self.client, sum(map(len, parts))
            )
            resp.gone = True
            raise ClientGone()
        raise HTTPError(
            408,
            f"request body not received within {self.limits.body_timeout:g} s",
            "request_timeout",
        )

    async def wait_disconnect(self, park: Park | None = None) -> bool:
        """True once the client has gone (bytes it pipelines meanwhile are kept, bounded); with
        ``park``, False once it is woken (``Park.cancel``)."""
        park = park or Park()  # (without one, a park nobody wakes: until the client leaves)
        while not self.eof:
            if len(self._unfed) > self.limits.max_head:  # it floods while it waits: not read
                return await park.wait(None)
            try:
                if self._drained and not await park.wait(self.transport.sock):
                    return False
                data = await self.transport.receive()
            except NET_ERRORS:
                data = b""
            self._drained = len(data) < RECV_SIZE
            if not data:
                self.eof = True
                return True
            self._unfed += data
        return True

    # -- serving ---------------------------------------------------------------------------

    async def _next_head(self) -> RequestHead | None:
        """The next request's head, within ``head_timeout`` (kept alive: ``keepalive_timeout``
        for its first byte), ``_waiting``'s deadline (``serve`` answers 408 past it); None
        when the connection is to end (the client closed it, or it was refused: answered)."""
        parser = self._parser
        heads = parser.heads
        if heads:
            return heads.popleft()
        self._head_bytes = 0
        limits = self.limits
        waiting = self._waiting
        sweeper = self.serving.sweeper  # the deadline: filed there, not trio's heap (4.6 µs)
        idle = self._kept and not self._unfed  # kept alive, nothing of the next one yet
        wait = max(limits.keepalive_timeout, limits.head_timeout) if idle else limits.head_timeout
        slot = sweeper.file(waiting, self._now() + wait)
        try:
            while not heads:
                if idle and self._head_bytes:  # its first bytes: the head's own deadline
                    idle = False
                    slot = sweeper.sooner(waiting, slot, self._now() + limits.head_timeout)
                if self._unfed:
                    data, self._unfed = self._unfed, b""
                    self._head_bytes += len(data)
                    parser.feed(data)
                    continue
                if parser.broken is not None:
                    await self._refuse_broken(parser.broken)
                    return None
                if self._head_bytes > limits.max_head:
                    await self._too_big()
                    return None
                if self.eof:
                    if self._head_begun():
                        await self.refuse(400, "bad request: closed mid-head", "invalid_request")
                    return None
                await self._fill()
        except NET_ERRORS:
            return None
        finally:
            sweeper.unfile(waiting, slot)
        msg = heads.popleft()
        if self._head_bytes > limits.max_head and msg.head_size() > limits.max_head:
            await self._too_big()  # the whole head came at once, over the bound
            return None
        return msg

    def _head_begun(self) -> bool:
        return self._head_bytes > 0 or self._parser.head_begun

    async def _too_big(self) -> None:
        await self.refuse(431, f"request head over {self.limits.max_head} bytes", "head_too_large")

    async def _refuse_broken(self, exc: httptools.HttpParserError) -> None:
        text = str(exc)
        if "Content-Length" in text and "Transfer-Encoding" in text:  # llhttp's words for it
            text = "a request with both Content-Length and Transfer-Encoding is refused"
        else:
            text = f"bad request: {text}"
        await self.refuse(400, text, "invalid_request")

    async def serve(self) -> None:
        """The connection's requests in turn, each head in time: one cancel scope for them all
        (``_waiting``, filed with the sweeper while a head is awaited), not one a request; a
        head that came as its deadline passed is served all the same, under a new scope."""
        msg: RequestHead | None = None
        while True:
            with trio.CancelScope() as waiting:
                self._waiting = waiting
                msg = await self._serve(msg)
            if waiting.cancelled_caught:  # no head within head_timeout
                if self._head_begun():
                    why = f"request head not received within {self.limits.head_timeout:g} s"
                    await self.refuse(408, why, "request_timeout")
                return
            if msg is None:
                return

    async def _serve(self, msg: RequestHead | None) -> RequestHead | None:
        """Requests in turn (``msg`` first when given) until the connection ends (None), or
        until a head came as the ``_waiting`` deadline passed (that head, for ``serve``)."""
        while True:
            if msg is None:
                self._method = b""
                msg = await self._next_head()
                if msg is None:
                    return None
                if self._waiting.cancel_called:
                    return msg
            self._method = msg.method
            if msg.version not in ("1.1", "1.0"):
                await self.refuse(505, f"HTTP/{msg.version} is not served", "invalid_request")
                return None
            if msg.hosts != 1 and (msg.hosts or msg.version == "1.1"):
                await self.refuse(
                    400, "bad request: one Host header is required", "invalid_request"
                )
                return None
            if msg.chunked and (msg.coding is None or msg.coding.strip().lower() != b"chunked"):
                # llhttp reads only the last coding (``identity`` then ``chunked`` as chunked):
                # a body framed two ways is refused, as h11 did
                await self.refuse(
                    501, "only one Transfer-Encoding, chunked, is served", "invalid_request"
                )
                return None
            upgrade = msg.upgrade
            if upgrade is not None and upgrade.lower() == b"websocket":
                await self._websocket(msg)
                return None
            if not await self._request(msg):
                return None
            self._kept = True
            msg = None

    @property
    def _declared_length(self) -> int | None:
        req = self._req
        raw = req.length if req is not None else None
        return int(raw) if raw is not None and raw.isdigit() else None

    async def refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an error body and close (a malformed or timed-out request)."""
        log.debug("refusing client %s: %d %.200r", self.client, status, message)
        data = error_response(status, message, code, head_only=self._method == b"HEAD")
        with trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await self.transport.send_all(data)
            except NET_ERRORS:
                pass

    def _scope(self, kind: str, msg: RequestHead) -> dict[str, Any]:
        target = msg.url
        headers = msg.headers
        if target[:1] != b"/":
            target, authority = origin_form(target)
            if authority is not None:  # the target's authority, not Host (RFC 9112 §3.2.2)
                headers = [(k, v) for k, v in headers if k != b"host"] + [(b"host", authority)]
        raw_path, _, query = target.partition(b"?")
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = unquote(path)
        method = msg.method
        return {
            "type": kind,
            "http_version": msg.version,
            "method": "GET" if method == b"HEAD" else method.decode(),  # HEAD: its GET's route
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": headers,
            "client": self.client,
            "scheme": self.scheme,
        }

    async def _request(self, msg: RequestHead) -> bool:
        """One request through the handler; True when the connection may serve another."""
        self._req = msg
        # HTTP/1.0 is answered and closed (as h11 did); so is a request after which llhttp
        # stopped (an upgrade not taken, CONNECT): what follows it is not HTTP
        self.keep_alive = keep_alive = msg.keep_alive and msg.version == "1.1" and not msg.switched
        self.body_deadline = self._now() + self.limits.body_timeout
        resp = Response(self, self.transport, msg.version == "1.0", msg.method)
        try:
            await self.serving.handler.http(Request(self, self._scope("http", msg), resp))
        except ClientGone:
            resp.gone = True
        if resp.gone:
            return False
        try:
            if not resp.started:
                await resp.error(HTTPError(500, "the server sent no response", "internal_error"))
            elif not resp.finished:
                resp.end_nowait()
            if resp.backlog:
                await resp.flush()
        except ClientGone:
            return False
        self._req = None
        if not msg.complete:
            return False  # its body was not read (refused first): the connection closes
        return keep_alive and not resp.close_after

    async def _websocket(self, msg: RequestHead) -> None:
        length = msg.length
        if (length is not None and length.strip() != b"0") or msg.chunked:
            await self.refuse(400, "a WebSocket handshake carries no body", "invalid_request")
            return
        key = upgrade_key(msg.method, msg.headers)
        if key is None or not msg.switched:
            await self.refuse(400, BAD_HANDSHAKE, "bad_handshake")
            return
        websocket = getattr(self.serving.handler, "websocket", None)
        if websocket is None:  # a plain HTTP handler
            await self.refuse(404, "not found", "unknown_url")
            return
        req = WebSocketRequest(self, self._scope("websocket", msg), key)
        await websocket(req)
        if not req.answered:
            await self.refuse(404, "not found", "unknown_url")


class WebSocketRequest:
    """A WebSocket handshake as its handler sees it: ``scope`` (path, query, headers), then
    ``accept()`` (the 101 and the open ``ServerWebSocket``) or ``refuse(status)``."""

    def __init__(self, conn: HTTPConnection, scope: dict[str, Any], key: bytes) -> None:
        self._conn = conn
        self.scope = scope
        self._key = key
        self.answered = False

    async def accept(self) -> ServerWebSocket:
        self.answered = True
        conn = self._conn
        serving = conn.serving
        fields = b"".join(b"%b: %b\r\n" % field for field in accept_headers(self._key))
        head = b"%b%b\r\n" % (STATUS_LINES[101], fields)
        conn.upgraded = True
        leftover = conn.upgrade_rest()
        ws = ServerWebSocket(
            conn.transport,
            leftover,
            WebSocketConnection(
                client=False,
                max_message=conn.limits.max_message,
                keepalive=serving.keepalive,
                now=trio.current_time(),
            ),
            serving.counters,
            self.scope["path"],
            serving.sweeper,
        )
        try:
            await conn.transport.send_all(head)
        except NET_ERRORS as exc:
            raise ClientGone() from exc
        return ws

    async def refuse(
        self, status: int, message: str = "forbidden", code: str = "forbidden"
    ) -> None:
        self.answered = True
        await self._conn.refuse(status, message, code)


async def serve_connection(
    serving: ConnectionHost,
    sock: socket.socket,
    client: tuple[str, int] | None,
    ssl_context: ssl.SSLContext | None,
) -> None:
    """One accepted socket's whole life: the TLS handshake (within ``head_timeout``), its
    requests or its WebSocket, then a lingering close; the socket is closed after."""
    transport: Transport | None = None
    try:
        if ssl_context is not None:
            with trio.move_on_after(serving.limits.head_timeout) as waited:
                if await _plain_http(sock):  # not a TLS record: one 400 that says so
                    transport = Transport(sock)
                    await transport.send_all(PLAIN_HTTP_ON_TLS)
                    await _linger(transport)
                    return
            if waited.cancelled_caught:
                return
            tls = transport = TLSTransport(sock, ssl_context, None)
            with trio.move_on_after(serving.limits.head_timeout) as waited:
                try:
                    await tls.handshake()
                except NET_ERRORS as exc:
                    log.debug("TLS handshake with %s failed: %r", client, exc)
                    return
            if waited.cancelled_caught:
                return
        else:
            transport = Transport(sock)
        conn = HTTPConnection(serving, transport, client)
        try:
            await conn.serve()
        except NET_ERRORS as exc:
            log.debug("connection from %s ended: %r", client, exc)
        finally:
            conn.parser_done()
        if not conn.upgraded and not conn.eof:
            await _linger(transport)
    finally:
        if transport is not None:
            transport.close()
        else:
            sock.close()


PLAIN_HTTP_ON_TLS = error_response(
    400,
    "this port speaks HTTPS: use https:// (plain HTTP was sent to a TLS port)",
    "plain_http_on_tls_port",
)
HTTP_METHOD_START = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")  # a TLS record starts 0x14-0x17


async def _plain_http(sock: socket.socket) -> bool:
    """Whether the first byte a client sends to the TLS port is that of an HTTP request line
    (a method's capital letter) rather than a TLS record; waits for it, reads nothing."""
    while True:
        try:
            first = sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            first = None  # waited for outside the handler (which would keep the error alive)
        except OSError:
            return False
        if first is not None:
            return bool(first) and first[0] in HTTP_METHOD_START
        await trio.lowlevel.wait_readable(sock)


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
        except NET_ERRORS:
            return
