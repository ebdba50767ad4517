"""One accepted connection of the server core: HTTP/1.1 requests in turn on h11, or one WebSocket.

h11 parses each request head and body and writes every response head, the 100 and the 101 (the
body's chunks of a streamed response are framed by ``gateway.wire.http.Response``: see there for
why). A request goes to the handler as a ``Request`` (``gateway.wire.http``) with the head
already checked: size, deadline, ``Content-Length`` with ``Transfer-Encoding`` refused. An
absolute-form request line (``GET http://host/path``) is routed by its path and its authority
stands for ``Host`` (RFC 9112 §3.2.2, §7.2); a ``HEAD`` is routed as its ``GET`` and the
response leaves the body out (RFC 9110 §9.3.2). An upgrade to WebSocket is checked
(``gateway.wire.wsconn``) and handed to the handler as a ``WebSocketRequest``: accepted, the
connection becomes a ``ServerWebSocket`` (``gateway.wire.wsserver``). A refusal is a whole
error response that closes the connection; the close lingers, so that an early answer reaches
a client still sending.
"""

from __future__ import annotations

import logging
import math
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Protocol

import h11
import trio

from gateway.wire.errors import ClientGone, HTTPError, error_envelope
from gateway.wire.http import REASONS, Request, Response
from gateway.wire.netio import NET_ERRORS, TLSTransport, Transport
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


class HTTPHandler(Protocol):
    """What a plain HTTP server serves: HTTP requests (a WebSocket handshake is answered 404)."""

    async def http(self, req: Request) -> None: ...


class Handler(HTTPHandler, Protocol):
    """What the server serves: HTTP requests and WebSocket handshakes."""

    async def websocket(self, req: WebSocketRequest) -> None: ...


class Serving(Protocol):
    """What a connection is served with (the listener, ``gateway.wire.server.Server``)."""

    @property
    def handler(self) -> HTTPHandler: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def keepalive(self) -> Keepalive: ...
    @property
    def counters(self) -> WebSocketCounters: ...


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def error_response(
    status: int,
    message: str,
    code: str,
    *,
    writer: h11.Connection | None = None,
    head_only: bool = False,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """A whole error response (the error envelope) that closes the connection, written by h11:
    by ``writer`` (the connection's) when it can still start a response, else by a fresh one.
    ``head_only``: the request was a HEAD (no body)."""
    body = error_envelope(message, HTTPError(status, message).type, code)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
        *(extra or []),
    ]
    if writer is None or writer.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        writer, head_only = h11.Connection(h11.SERVER), False
    reason = REASONS.get(status, b"")
    out = writer.send(h11.Response(status_code=status, headers=headers, reason=reason))
    if not head_only:
        out += writer.send(h11.Data(data=body)) or b""
    return (out or b"") + (writer.send(h11.EndOfMessage()) or b"")


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body exceeds {limit} bytes", "request_too_large")


def _target(target: bytes) -> tuple[bytes, bytes | None]:
    """A request target in origin form (path and query) and the authority an absolute-form one
    named (RFC 9112 §3.2.2: ``http://host:port/path?query``), or None."""
    if target[:1] == b"/":
        return target, None
    scheme, sep, rest = target.partition(b"://")
    if not sep or not scheme.isalpha():
        return target, None  # authority-form, asterisk-form: as they are
    end = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
    authority = rest[:end].rpartition(b"@")[2]  # userinfo dropped (RFC 9110 §4.2.4)
    path = rest[end:]
    return (path if path[:1] == b"/" else b"/" + path), authority


class HTTPConnection:
    """One accepted connection: HTTP/1.1 requests in turn (keep-alive), or one WebSocket."""

    def __init__(
        self, serving: Serving, transport: Transport, client: tuple[str, int] | None
    ) -> None:
        self.serving = serving
        self.limits = serving.limits
        self.transport = transport
        self.client = client
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head)
        self.eof = False
        self.body_deadline = math.inf
        self.upgraded = False
        self._method = b""  # the request being served
        self._content_length: bytes | None = None

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
            resp.write_raw(
                h.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))
                or b""
            )
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
            except NET_ERRORS as exc:
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
            except NET_ERRORS:
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
                    except NET_ERRORS:
                        return
                if idle.cancelled_caught:
                    return  # idle past the keep-alive time
            event: Any = None
            self._method = b""
            with trio.move_on_after(self.limits.head_timeout) as waited:
                try:
                    event = await self.next_event()
                except h11.RemoteProtocolError as exc:
                    status = exc.error_status_hint
                    await self.refuse(status, f"bad request: {exc}", "invalid_request")
                    return
                except NET_ERRORS:
                    return
            if waited.cancelled_caught:
                if self.h11.trailing_data[0]:
                    why = f"request head not received within {self.limits.head_timeout:g} s"
                    await self.refuse(408, why, "request_timeout")
                return
            if not isinstance(event, h11.Request):
                return  # the client closed
            first = False
            self._method = event.method
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
        data = error_response(
            status, message, code, writer=self.h11, head_only=self._method == b"HEAD"
        )
        with trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await self.transport.send_all(data)
            except NET_ERRORS:
                pass

    def _scope(self, kind: str, event: h11.Request, headers: list[tuple[bytes, bytes]]) -> dict:
        target, authority = _target(bytes(event.target))
        if authority is not None:  # the target's authority, not Host (RFC 9112 §3.2.2)
            headers = [(k, v) for k, v in headers if k != b"host"] + [(b"host", authority)]
        raw_path, _, query = target.partition(b"?")
        method = event.method
        return {
            "type": kind,
            "http_version": event.http_version.decode(),
            "method": "GET" if method == b"HEAD" else method.decode(),  # HEAD: its GET's route
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
            await self.serving.handler.http(req)
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
        key = upgrade_key(event.method, headers)
        if key is None:
            await self.refuse(
                400, "bad WebSocket handshake (GET, Sec-WebSocket-Key, version 13)", "bad_handshake"
            )
            return
        end = self.h11.next_event()  # no body: its end is there already
        assert isinstance(end, h11.EndOfMessage), end
        websocket = getattr(self.serving.handler, "websocket", None)
        if websocket is None:  # a plain HTTP handler
            await self.refuse(404, "not found", "unknown_url")
            return
        req = WebSocketRequest(self, self._scope("websocket", event, headers), key)
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
        head = conn.h11.send(
            h11.InformationalResponse(
                status_code=101, headers=accept_headers(self._key), reason=b"Switching Protocols"
            )
        )
        conn.upgraded = True
        leftover = bytes(conn.h11.trailing_data[0])
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
        )
        try:
            await conn.transport.send_all(head or b"")
        except NET_ERRORS as exc:
            raise ClientGone() from exc
        return ws

    async def refuse(
        self, status: int, message: str = "forbidden", code: str = "forbidden"
    ) -> None:
        self.answered = True
        await self._conn.refuse(status, message, code)


async def serve_connection(
    serving: Serving,
    sock: socket.socket,
    client: tuple[str, int] | None,
    ssl_context: ssl.SSLContext | None,
) -> None:
    """One accepted socket's whole life: the TLS handshake (within ``head_timeout``), its
    requests or its WebSocket, then a lingering close; the socket is closed after."""
    transport: Transport | None = None
    try:
        if ssl_context is not None:
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
        if not conn.upgraded and not conn.eof:
            await _linger(transport)
    finally:
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
        except NET_ERRORS:
            return
