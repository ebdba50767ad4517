"""The trio floor with one poller: every backend socket read by one task, as the runner reads.

The same relay as ``bench/floor.py`` (each request POSTed over a kept-alive connection, the
backend's bytes written to the session socket unchanged, one write per read), but the backend
sockets of the streams in flight sit in one level-triggered epoll set of our own, registered
once per stream, and one task waits (``trio.lowlevel.wait_readable``) on that set's descriptor
and relays every ready socket in the order the kernel reports them. A decode-step burst of N
streams is then one task wake-up instead of N (each with an epoll re-registration), and the
event written first is relayed first (trio's own batch order is reversed half the time).
``gateway/runner/poller.py`` is the runner's version of the same idea. Linux only.
"""

from __future__ import annotations

import select
import socket
import sys
from typing import Any

import trio

from bench.floor import Floor, Out, connect, main

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

    def __init__(self, floor: PollerFloor, sock: socket.socket, out: Out) -> None:
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


class PollerFloor(Floor):
    """``bench.floor.Floor`` with each stream relayed by the poller (``Stream.follow``)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.poller = Poller()

    def start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.poller.run)

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


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]), PollerFloor)
