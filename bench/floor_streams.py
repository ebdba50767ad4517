"""The trio streams floor: the old floor (``trio.socket`` awaits, a lock hand-off per write), a row
kept to compare with the lowlevel floor (``bench/floor.py``), in a process of its own.

It dials the bench's floor sink like a runner dials its Chat Channel (``dial`` command: N
session sockets), takes requests on them (``<length>\\n<body>``, the request path only), POSTs
each body to the backend over a kept-alive connection and writes the backend's response bytes to
the session socket unchanged, as they come: no framing, no parsing, no SSE splitting. Streams of
one session share its socket (one write per backend read, under a lock, so reads never interleave
inside one write). The end of a response is seen on its last bytes (``0\\r\\n\\r\\n``).
"""

from __future__ import annotations

import sys
from typing import Any

import trio

from bench.common import reply_line, serve_commands

_END = b"\r\n0\r\n\r\n"
_RECV = 65536


class Floor:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            "content-type: application/json\r\naccept: text/event-stream\r\ncontent-length: "
        ).encode()
        self.idle: list[trio.socket.SocketType] = []
        self.active = 0
        self.forwarded = 0

    async def _connect(self) -> trio.socket.SocketType:
        if self.idle:
            return self.idle.pop()
        sock = _socket()
        await sock.connect((self.host, self.port))
        return sock

    async def forward(
        self, body: bytes, out: trio.socket.SocketType, lock: trio.StrictFIFOLock
    ) -> None:
        self.active += 1
        try:
            sock = await self._connect()
            await _send_all(sock, self.head + b"%d\r\n\r\n" % len(body) + body)
            recv = sock.recv
            tail = b""
            while True:
                data = await recv(_RECV)
                if not data:
                    sock.close()
                    return
                async with lock:
                    await _send_all(out, data)
                self.forwarded += len(data)
                tail = (tail + data[-7:])[-7:]
                if tail == _END:
                    self.idle.append(sock)
                    return
        finally:
            self.active -= 1

    async def session(self, out: trio.socket.SocketType) -> None:
        lock = trio.StrictFIFOLock()
        buf = b""
        async with trio.open_nursery() as nursery:
            while True:
                data = await out.recv(_RECV)
                if not data:
                    nursery.cancel_scope.cancel()
                    return
                buf += data
                while True:
                    head, sep, rest = buf.partition(b"\n")
                    if not sep or len(rest) < int(head):
                        break
                    size = int(head)
                    nursery.start_soon(self.forward, rest[:size], out, lock)
                    buf = rest[size:]


def _socket() -> trio.socket.SocketType:
    """A TCP socket that sends each write at once (no Nagle delay), as trio's own streams do."""
    sock = trio.socket.socket()
    sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
    return sock


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def main(host: str, port: int) -> None:
    floor = Floor(host, port)
    reply_line({"ok": True})
    async with trio.open_nursery() as nursery:

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["cmd"] == "dial":
                for _ in range(cmd["n"]):
                    sock = _socket()
                    await sock.connect((cmd["host"], cmd["port"]))
                    nursery.start_soon(floor.session, sock)
                return {"ok": True}
            if cmd["cmd"] == "status":
                return {"active": floor.active, "bytes": floor.forwarded}
            raise ValueError(f"unknown command {cmd['cmd']!r}")

        await serve_commands(handle)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
