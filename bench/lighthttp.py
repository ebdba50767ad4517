"""A minimal HTTP/1.1 client for ``bench.fleet``'s fake runners: keep-alive connections, a JSON
body, a ``Content-Length`` answer; and a push stream read for the events it names.

httpx costs the bench's process about a millisecond of CPU a request: with 1,000 fake runners
polling every 10 s (and their push streams), the bench, not the hub, was what ran out of CPU, and
its runners missed the offers the hub made them. This client does only what the fleet asks of the
runner API, at a small fraction of that.
"""

from __future__ import annotations

import json
from typing import Any

import trio

HEAD_END = b"\r\n\r\n"
MAX_HEAD = 65536


class Reply:
    """An answer: its status and its body."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class LightHttp:
    """Requests to one host, over keep-alive connections kept idle between them."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[trio.SocketStream, bytearray]] = []

    async def request(self, method: str, path: str, token: str, body: Any = None) -> Reply:
        """One request (``body``: JSON, or None); once more on a fresh connection when a kept
        one turns out closed."""
        data = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        ).encode()
        for attempt in range(2):
            reused = bool(self._idle) and attempt == 0
            stream, buf = self._idle.pop() if reused else (await self._open(), bytearray())
            try:
                await stream.send_all(head + data)
                status, answer, keep = await _answer(stream, buf)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, EOFError):
                await stream.aclose()
                if reused:  # the hub closed it idle: the others kept are as old
                    await self.aclose()
                    continue
                raise EOFError(f"{method} {path}: no answer") from None
            if keep:
                self._idle.append((stream, buf))
            else:
                await stream.aclose()
            return Reply(status, answer)
        raise AssertionError("unreachable")

    async def _open(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.host, self.port)

    async def events(self, path: str, token: str) -> trio.SocketStream:
        """A push stream opened (its answer's head read): the caller reads its bytes."""
        stream = await self._open()
        head = (
            f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {token}\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()
        await stream.send_all(head)
        return stream

    async def aclose(self) -> None:
        for stream, _ in self._idle:
            await stream.aclose()
        self._idle.clear()


async def _answer(stream: trio.SocketStream, buf: bytearray) -> tuple[int, bytes, bool]:
    """The status, body and whether the connection stays open, of one answer read from
    ``stream`` (``buf``: what was read past the previous one)."""
    while (end := buf.find(HEAD_END)) < 0:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError("the connection closed before an answer")
        buf += chunk
        if len(buf) > MAX_HEAD:
            raise EOFError("an answer's head too long")
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    del buf[: end + 4]
    status = int(lines[0].split(" ", 2)[1])
    length, keep = 0, True
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "connection" and value.strip().lower() == "close":
            keep = False
    while len(buf) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError("the connection closed mid-answer")
        buf += chunk
    body = bytes(buf[:length])
    del buf[:length]
    return status, body, keep
