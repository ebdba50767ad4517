"""The trio floor: the fastest trio relay loop there is, on trio's public lowlevel API.

It dials the bench's floor sink like a runner dials its Chat Channel (``dial`` command: N
session sockets), takes requests on them (``<length>\\n<body>``, the request path only), POSTs
each body to the backend over a kept-alive connection and writes the backend's response bytes to
the session socket unchanged, as they come: no framing, no parsing, no SSE splitting. The end of
a response is seen on its last bytes (``0\\r\\n\\r\\n``).

Every socket is a non-blocking stdlib socket: ``recv``/``send`` are tried first, and
``trio.lowlevel.wait_readable``/``wait_writable`` run only on ``BlockingIOError`` (as
``../shared/DESIGN.md``, "What trio costs per chunk", measures). A loop that finds data every
time checkpoints on its own every ``_CHECKPOINT`` reads, so it stays cancellable and fair.
Streams of one session share its socket: a write goes out at once when none is waiting for room;
bytes that come while one waits join it, so reads never interleave inside one write and no lock
is handed off. ``bench/floor_streams.py`` is the old floor (``trio.socket`` awaits and a lock),
kept as a row to compare.
"""

from __future__ import annotations

import errno
import socket
import sys
from typing import Any

import trio

from bench.common import reply_line, serve_commands

_END = b"\r\n0\r\n\r\n"
_RECV = 65536
_CHECKPOINT = 16  # reads in a row that found data before a checkpoint of our own
wait_readable = trio.lowlevel.wait_readable
wait_writable = trio.lowlevel.wait_writable


async def connect(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to ``host:port``, sending each write at once."""
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    err = sock.connect_ex((host, port))
    if err in (errno.EINPROGRESS, errno.EAGAIN):
        await wait_writable(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        sock.close()
        raise OSError(err, f"connect to {host}:{port}: {errno.errorcode.get(err, err)}")
    return sock


class Out:
    """A session socket written by many streams: one ``send`` per write when there is room."""

    __slots__ = ("sock", "pending", "waiting")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending: list[bytes] = []
        self.waiting = False

    async def write(self, data: bytes) -> None:
        if self.waiting:  # a write is waiting for room: these bytes go with it, in order
            self.pending.append(data)
            return
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        self.pending.append(data[sent:])
        self.waiting = True
        await self.flush()

    async def flush(self) -> None:
        """Send what is pending once there is room (``waiting`` is set meanwhile)."""
        try:
            while self.pending:
                await wait_writable(self.sock)
                data = b"".join(self.pending)
                self.pending.clear()
                try:
                    sent = self.sock.send(data)
                except BlockingIOError:
                    sent = 0
                if sent < len(data):
                    self.pending.insert(0, data[sent:])
        finally:
            self.waiting = False


class Reader:
    """Reads of one socket: ``recv`` first, a wait only when there is nothing yet."""

    __slots__ = ("sock", "streak")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.streak = 0

    async def recv(self) -> bytes:
        while True:
            try:
                data = self.sock.recv(_RECV)
            except BlockingIOError:
                self.streak = 0
                await wait_readable(self.sock)
                continue
            self.streak += 1
            if self.streak >= _CHECKPOINT:
                self.streak = 0
                await trio.lowlevel.checkpoint()
            return data


class Floor:
    """The floor process: session sockets dialled to the sink, a task per stream (``forward``)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            "content-type: application/json\r\naccept: text/event-stream\r\ncontent-length: "
        ).encode()
        self.idle: list[socket.socket] = []
        self.active = 0
        self.forwarded = 0

    def start(self, nursery: trio.Nursery) -> None:
        """Start the floor's own tasks, if it has any (this one has none)."""

    async def forward(self, body: bytes, out: Out) -> None:
        self.active += 1
        sock = self.idle.pop() if self.idle else await connect(self.host, self.port)
        try:
            await Out(sock).write(self.head + b"%d\r\n\r\n" % len(body) + body)
            recv = Reader(sock).recv
            write = out.write
            tail = b""
            while True:
                data = await recv()
                if not data:
                    sock.close()
                    return
                await write(data)
                self.forwarded += len(data)
                tail = (tail + data[-7:])[-7:]
                if tail == _END:
                    self.idle.append(sock)
                    return
        except BaseException:
            sock.close()
            raise
        finally:
            self.active -= 1

    async def session(self, sock: socket.socket) -> None:
        out = Out(sock)
        recv = Reader(sock).recv
        buf = b""
        async with trio.open_nursery() as nursery:
            while True:
                data = await recv()
                if not data:
                    nursery.cancel_scope.cancel()
                    return
                buf += data
                while True:
                    head, sep, rest = buf.partition(b"\n")
                    if not sep or len(rest) < int(head):
                        break
                    size = int(head)
                    nursery.start_soon(self.forward, rest[:size], out)
                    buf = rest[size:]


async def main(host: str, port: int, kind: type[Floor] = Floor) -> None:
    floor = kind(host, port)
    reply_line({"ok": True})
    async with trio.open_nursery() as nursery:
        floor.start(nursery)

        async def handle(cmd: dict[str, Any]) -> dict[str, Any]:
            if cmd["cmd"] == "dial":
                for _ in range(cmd["n"]):
                    nursery.start_soon(floor.session, await connect(cmd["host"], cmd["port"]))
                return {"ok": True}
            if cmd["cmd"] == "status":
                return {"active": floor.active, "bytes": floor.forwarded}
            raise ValueError(f"unknown command {cmd['cmd']!r}")

        await serve_commands(handle)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
