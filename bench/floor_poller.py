"""The trio floor with one poller: every backend socket read by one task, as the runner reads.

The same relay as ``bench/floor.py`` (each request POSTed over a kept-alive connection, the
backend's bytes written to the session socket unchanged, one write per read), but the backend
sockets of the streams in flight sit in one level-triggered epoll set of our own, registered
once per stream, and one task waits (``trio.lowlevel.wait_readable``) on that set's descriptor
and relays every ready socket in the order the kernel reports them. A decode-step burst of N
streams is then one task wake-up instead of N (each with an epoll re-registration), and the
event written first is relayed first (trio's own batch order is reversed half the time).
``gateway/poller.py`` is the runner's version of the same idea. Linux only.
"""

from __future__ import annotations

import select
import socket
import sys
from typing import Any

import trio

from bench.common import reply_line, serve_commands
from bench.floor import Out, Reader, connect

_END = b"\r\n0\r\n\r\n"
_RECV = 65536
wait_readable = trio.lowlevel.wait_readable


class Poller:
    """The backend sockets of the streams in flight, relayed by one task (``run``)."""

    def __init__(self) -> None:
        self.ep = select.epoll()
        self.streams: dict[int, Any] = {}

    async def run(self) -> None:
        ep = self.ep
        streams = self.streams
        while True:
            await wait_readable(ep.fileno())
            for fd, _ in ep.poll(0):
                stream = streams.get(fd)
                if stream is not None:
                    stream.pump()


class Stream:
    """One stream followed by the poller: ``pump`` relays what has arrived, never waits."""

    def __init__(self, floor: Floor, sock: socket.socket, out: Out) -> None:
        self.floor = floor
        self.sock = sock
        self.out = out
        self.tail = b""
        self.back = trio.Event()  # set when the poller hands the stream back to its task
        self.ended: bool | None = None  # True: whole and kept; False: closed
        self.full = False  # a write left bytes for the stream's task to finish

    def pump(self) -> None:
        try:
            data = self.sock.recv(_RECV)
        except BlockingIOError:
            return
        if not data:
            self.ended = False
            self.hand_back()
            return
        out = self.out
        if out.waiting:  # a write is waiting for room: these bytes go with it, in order
            out.pending.append(data)
        else:
            try:
                sent = out.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                out.pending.append(data[sent:])
                out.waiting = True  # later bytes join it; the stream's task finishes it
                self.full = True
        self.floor.forwarded += len(data)
        self.tail = (self.tail + data[-7:])[-7:]
        if self.tail == _END:
            self.ended = True
        if self.ended is not None or self.full:
            self.hand_back()

    def hand_back(self) -> None:
        poller = self.floor.poller
        poller.ep.unregister(self.sock)
        del poller.streams[self.sock.fileno()]
        self.back.set()

    async def follow(self) -> None:
        """Relay from the poller's task until the stream ends; finish full writes here."""
        poller = self.floor.poller
        while self.ended is None:
            self.back = trio.Event()
            poller.streams[self.sock.fileno()] = self
            poller.ep.register(self.sock, select.EPOLLIN)
            try:
                await self.back.wait()
            finally:
                if poller.streams.get(self.sock.fileno()) is self:
                    self.hand_back()
            if self.full:
                self.full = False
                await self.out.flush()


class Floor:
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
        self.poller = Poller()

    async def forward(self, body: bytes, out: Out) -> None:
        self.active += 1
        sock = self.idle.pop() if self.idle else await connect(self.host, self.port)
        try:
            await Out(sock).write(self.head + b"%d\r\n\r\n" % len(body) + body)
            stream = Stream(self, sock, out)
            await stream.follow()
            if stream.ended:
                self.idle.append(sock)
            else:
                sock.close()
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


async def main(host: str, port: int) -> None:
    floor = Floor(host, port)
    reply_line({"ok": True})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(floor.poller.run)

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
