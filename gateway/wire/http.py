"""The HTTP request and response as the server core hands them to a handler (the error type and
shape they answer with live in :mod:`gateway.wire.errors`)."""

from __future__ import annotations

import http
import logging
import re
import socket
import struct
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from gateway.wire.errors import ClientGone, Headers, HTTPError
from gateway.wire.netio import NET_ERRORS, Transport

if TYPE_CHECKING:
    from gateway.wire.park import Park

log = logging.getLogger("gateway.wire")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

JSON_HEADER = (b"content-type", b"application/json")
_encoder = msgspec.json.Encoder()


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case, as the server core gives every name), or
    None."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


def bearer(scope: Scope) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None without one (or another scheme)."""
    raw = header(scope, b"authorization")
    if raw is None:
        return None
    scheme, _, token = raw.decode("latin-1").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Connection(Protocol):
    """What a request needs of the connection it came on (``gateway.wire.httpconn``)."""

    async def read_body(self, limit: int, resp: Response) -> bytes: ...

    async def wait_disconnect(self, park: Park | None = None) -> bool:
        """True once the client has gone; with ``park``, False once it is woken."""
        ...


class Exchange(Protocol):
    """What a response reads of the request it answers, when it writes its head (the
    connection's ``HTTPConnection``, kept current)."""

    @property
    def body_pending(self) -> bool:
        """Its body is not all read: no next request on this connection."""

    @property
    def keep_alive(self) -> bool:
        """It lets another request follow it (HTTP/1.1, no Connection: close)."""


# each status's reason phrase, and its status line (``HTTP/1.1 200 OK``)
REASONS = {status.value: status.phrase.encode() for status in http.HTTPStatus}
STATUS_LINES = {status: b"HTTP/1.1 %d %b\r\n" % (status, why) for status, why in REASONS.items()}
# response header fields as written: a token, ": ", a value without CR, LF or NUL (one line
# per field given: a value with CR LF in it would make two)
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+: [^\r\n\x00]*\r\n)*")
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


class Response:
    """One HTTP response on its way out, written straight to the client's socket.

    The ``*_nowait`` methods write at once what the socket takes and keep the rest for
    ``flush`` (they never wait: the channel's reader writes a turn's chunks with them); the
    others flush too. A failed write marks the response ``gone`` and raises ClientGone.

    The head is written here (``head``: the status line with its reason phrase, the fields
    given, the framing: ``transfer-encoding: chunked`` for a body of no ``content-length`` to
    an HTTP/1.1 client, ``connection: close`` when no request may follow), each field checked
    (no CR, LF or NUL: no header injection); so are the chunks of a streamed body, one chunk
    per write, with the bytes before them in the same copy. That is the hub's per-chunk path:
    ``h11.send(h11.Data(...))``, which did it before, cost its state machine there, 2.9× this
    ``write_nowait`` per chunk in process (4.24 against 1.44 µs, socket send included), 1.19×
    the hub's whole CPU per chunk end to end (lockstep, 8 paired rounds, every one worse:
    bench/README.md, December 2026).
    """

    __slots__ = (
        "_conn",
        "_transport",
        "_http10",
        "_head",
        "chunked",
        "started",
        "finished",
        "gone",
        "close_after",
    )

    def __init__(self, conn: Exchange, transport: Transport, http10: bool, method: bytes) -> None:
        self._conn = conn
        self._transport = transport
        self._http10 = http10
        self._head = method == b"HEAD"
        self.chunked = False
        self.started = False
        self.finished = False
        self.gone = False
        self.close_after = False  # the connection closes after this response

    @property
    def backlog(self) -> int:
        """Bytes written but not yet taken by the socket."""
        return len(self._transport.unsent)

    def write_raw(self, data: bytes) -> bool:
        """Bytes as they are; True when the socket took them all."""
        if self.gone:
            raise ClientGone()
        try:
            return self._transport.write(data)
        except NET_ERRORS as exc:
            self.gone = True
            raise ClientGone() from exc

    def start_nowait(self, status: int, headers: Headers) -> bool:
        return self.write_raw(self.head(status, headers))

    def head(self, status: int, headers: Headers) -> bytes:
        """The response head as bytes, for the caller to write (with the first part of the
        body, in one write); the response counts as started. ``ValueError`` for a field that
        is not a token and a value without CR, LF or NUL."""
        fields = b"".join([b"%b: %b\r\n" % field for field in headers])
        if _FIELDS.fullmatch(fields) is None or fields.count(b"\n") != len(headers):
            raise ValueError("a response header field is not a token and a value without CR/LF")
        lower = b"\n" + fields.lower()
        conn = self._conn
        if conn.body_pending or not conn.keep_alive:  # no next request on this connection
            fields += b"connection: close\r\n"
            self.close_after = True
        elif b"\nconnection:" in lower:  # the handler's own: close after it if it says so
            if b"close" in lower.split(b"\nconnection:", 1)[1].split(b"\r", 1)[0]:
                self.close_after = True
        if status >= 200 and status not in (204, 304) and b"\ncontent-length:" not in lower:
            if self._http10:  # no chunked coding for HTTP/1.0: the body ends with the connection
                if not self.close_after:
                    fields += b"connection: close\r\n"
                    self.close_after = True
            else:  # a HEAD's too (the framing its GET would have), its body left out
                fields += b"transfer-encoding: chunked\r\n"
                self.chunked = not self._head
        self.started = True
        return b"%b%b\r\n" % (STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status, fields)

    def write_nowait(self, data: bytes, before: bytes = b"", end: bool = False) -> bool:
        """A part of the body, in one write with ``before`` it (bytes as they are: the head)
        and, with ``end``, the end of the body after it."""
        if self._head:
            data = b""
        if data:
            if self.chunked:
                out = b"%b%x\r\n%b\r\n" % (before, len(data), data)
            else:
                out = before + data
        else:
            out = before
        if end:
            self.finished = True
            if self.chunked:
                out += b"0\r\n\r\n"
        return self.write_raw(out) if out else not self._transport.unsent

    def end_nowait(self) -> bool:
        """The end of the body."""
        return self.write_nowait(b"", end=True)

    async def flush(self) -> None:
        """Wait until the socket took everything written."""
        if self.gone:
            raise ClientGone()
        try:
            await self._transport.flush()
        except NET_ERRORS as exc:
            self.gone = True
            raise ClientGone() from exc

    def reset(self) -> None:
        """Abort the connection at once with a TCP reset (``SO_LINGER`` 0), whatever is unsent:
        a server that looks as if it crashed mid-response. The response is ``gone`` after."""
        self.gone = True
        transport = self._transport
        if transport.closed:
            return
        transport.unsent.clear()
        try:
            transport.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass
        transport.close()

    async def start(self, status: int, headers: Headers) -> None:
        self.start_nowait(status, headers)
        await self.flush()

    async def body(self, data: bytes, more: bool = True) -> None:
        self.write_nowait(data)
        if not more:
            self.end_nowait()
        await self.flush()

    async def whole(self, status: int, data: bytes, headers: Headers | None = None) -> None:
        """A complete response: ``data`` (JSON unless ``headers`` say otherwise) in one body."""
        if status == 204:
            head = self.head(status, headers or [])
            data = b""
        else:
            fields = [(b"content-length", b"%d" % len(data))]
            if headers:
                fields += headers
                for name, _ in headers:
                    if name.lower() == b"content-type":
                        break
                else:
                    fields.append(JSON_HEADER)
            else:
                fields.append(JSON_HEADER)
            head = self.head(status, fields)
        self.write_nowait(data, head, end=True)  # one write
        if self._transport.unsent:
            await self.flush()

    async def json(self, status: int, obj: Any, headers: Headers | None = None) -> None:
        await self.whole(status, _encoder.encode(obj), headers)

    async def error(self, err: HTTPError) -> None:
        await self.whole(err.status, err.body(), err.headers)


class Request:
    """One HTTP request as a route handler sees it: its head (``scope``: method, path,
    query_string, headers, client), its body read on demand (``body``: after the credentials
    are checked), the response on its way out, and the values the route's path captured."""

    __slots__ = ("params", "scope", "resp", "_conn")

    def __init__(self, conn: Connection, scope: Scope, resp: Response) -> None:
        self._conn = conn
        self.scope = scope
        self.resp = resp
        self.params: dict[str, str] = {}

    @property
    def connection(self) -> Connection:
        """The connection the request came on: the same object for every request on it."""
        return self._conn

    async def body(self, limit: int) -> bytes:
        """The whole body: HTTPError 413 past ``limit`` bytes (408 when too slow, 400 when its
        framing is broken), ClientGone when the client leaves mid-upload."""
        return await self._conn.read_body(limit, self.resp)

    async def receive(self) -> Message:
        """``{"type": "http.disconnect"}`` once the client has gone (after the body was read)."""
        await self._conn.wait_disconnect()
        return {"type": "http.disconnect"}
