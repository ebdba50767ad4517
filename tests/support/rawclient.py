"""Raw HTTP/1.1 and WebSocket clients on ``trio.open_tcp_stream``: every byte is the test's own,
so a test can send what no library would (a trickled head, a lying Content-Length, a crafted
frame) and read exactly what the server answers, and when it closes (tests only)."""

from __future__ import annotations

import json
import os
import struct
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

READ = 65536
WS_KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455's sample nonce: the accept value is fixed

# WebSocket opcodes (RFC 6455 §5.2)
CONT, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA

Header = tuple[str | bytes, str | bytes]


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


def head(method: str, target: str, headers: Sequence[Header] = (), *, host: str = "hub") -> bytes:
    """A request head: the request line, ``Host``, then ``headers`` as given (raw bytes allowed)."""
    lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: " + host.encode()]
    lines += [_b(k) + b": " + _b(v) for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def bearer(token: str) -> Header:
    return ("Authorization", f"Bearer {token}")


def request(
    method: str, target: str, headers: Sequence[Header] = (), body: bytes | Any = b""
) -> bytes:
    """A whole request with a Content-Length (``body`` not bytes: sent as JSON)."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
        headers = [("Content-Type", "application/json"), *headers]
    return head(method, target, [*headers, ("Content-Length", str(len(body)))]) + body


def upgrade_head(target: str, headers: Sequence[Header] = ()) -> bytes:
    """A WebSocket handshake (RFC 6455 §4.1) for ``target``, plus ``headers``."""
    return head(
        "GET",
        target,
        [
            ("Upgrade", "websocket"),
            ("Connection", "Upgrade"),
            ("Sec-WebSocket-Key", WS_KEY),
            ("Sec-WebSocket-Version", "13"),
            *headers,
        ],
    )


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]  # lower-case names; the last of a repeated one
    body: bytes = b""
    reason: bytes = b""  # the status line's reason phrase

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(eq=False)
class RawConn:
    """One TCP connection to the server, read into a buffer the parsers below consume."""

    stream: trio.SocketStream
    buf: bytearray = field(default_factory=bytearray)
    eof: bool = False  # the server closed (FIN) or reset the connection

    @classmethod
    async def open(cls, url: str) -> RawConn:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        return cls(await trio.open_tcp_stream(parts.hostname, parts.port))

    async def send(self, data: bytes) -> bool:
        """Send ``data``; False (nothing raised) when the server has closed the connection."""
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def trickle(self, data: bytes, every: float = 1.0) -> None:
        """Send ``data`` one byte at a time, ``every`` s apart, until sent or the server closes."""
        for n in range(len(data)):
            if not await self.send(data[n : n + 1]):
                return
            await trio.sleep(every)

    async def _fill(self) -> bool:
        """Read more into the buffer; False at the end of the connection (FIN or reset)."""
        if self.eof:
            return False
        try:
            data = await self.stream.receive_some(READ)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    async def _take(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if not await self._fill():
                return None
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def _line(self) -> bytes | None:
        while (end := self.buf.find(b"\r\n")) < 0:
            if not await self._fill():
                return None
        out = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return out

    async def head(self) -> Response | None:
        """The next response's status line and headers (None: closed before a whole head)."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if not await self._fill():
                return None
        raw = bytes(self.buf[:end])
        del self.buf[: end + 4]
        status_line, *lines = raw.split(b"\r\n")
        version, status, *reason = status_line.split(b" ", 2)
        assert version.startswith(b"HTTP/1."), status_line
        headers: dict[bytes, bytes] = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return Response(int(status), headers, reason=reason[0] if reason else b"")

    async def response(self) -> Response | None:
        """The next whole response (None: closed before a whole head); a body without a length
        is read to the end of the connection."""
        resp = await self.head()
        if resp is None:
            return None
        if resp.status in (101, 204, 304) or 100 <= resp.status < 200:
            return resp
        length = resp.headers.get(b"content-length")
        if length is not None:
            body = await self._take(int(length))
            assert body is not None, f"closed inside a {resp.status} body"
            resp.body = body
        elif b"chunked" in resp.headers.get(b"transfer-encoding", b"").lower():
            parts = []
            while (size_line := await self._line()) is not None:
                size = int(size_line.split(b";")[0], 16)
                part = await self._take(size + 2)
                assert part is not None, f"closed inside a {resp.status} body"
                if size == 0:
                    break
                parts.append(part[:-2])
            resp.body = b"".join(parts)
        else:
            while await self._fill():
                pass
            resp.body, self.buf = bytes(self.buf), bytearray()
        return resp

    async def closed(self) -> bytes:
        """Read to the end of the connection; what arrived meanwhile (b"": nothing more)."""
        while await self._fill():
            pass
        rest, self.buf = bytes(self.buf), bytearray()
        return rest

    async def aclose(self) -> None:
        await self.stream.aclose()

    # -- WebSocket --------------------------------------------------------------------

    async def frame(self) -> tuple[bool, int, bytes] | None:
        """The server's next frame (fin, opcode, payload); None at the end of the connection."""
        first = await self._take(2)
        if first is None:
            return None
        fin, opcode = bool(first[0] & 0x80), first[0] & 0x0F
        assert not first[1] & 0x80, "a server frame must not be masked"
        size = first[1] & 0x7F
        if size in (126, 127):
            extended = await self._take(2 if size == 126 else 8)
            if extended is None:
                return None
            size = int.from_bytes(extended, "big")
        payload = await self._take(size)
        if payload is None:
            return None
        return fin, opcode, payload

    async def close_frame(self) -> int | None:
        """Skip the server's frames up to its close frame: the close code (1005 when it has
        none); None when the connection ended without one."""
        while (got := await self.frame()) is not None:
            _fin, opcode, payload = got
            if opcode == CLOSE:
                return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        return None


def ws_frame(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    rsv1: bool = False,
    masked: bool = True,
    length: int | None = None,
) -> bytes:
    """One client frame as given (RFC 6455 §5.2), masked unless ``masked`` is False; ``length``
    states another payload length than the real one."""
    first = (0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode
    size = len(payload) if length is None else length
    mask_bit = 0x80 if masked else 0
    if size < 126:
        out = bytes([first, mask_bit | size])
    elif size < 1 << 16:
        out = bytes([first, mask_bit | 126]) + size.to_bytes(2, "big")
    else:
        out = bytes([first, mask_bit | 127]) + size.to_bytes(8, "big")
    if not masked:
        return out + payload
    key = os.urandom(4)
    return out + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def close_payload(code: int, reason: str = "") -> bytes:
    return struct.pack("!H", code) + reason.encode()
