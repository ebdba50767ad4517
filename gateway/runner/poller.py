"""One task reads every streaming turn's backend socket: a decode-step burst is one wake-up.

A batched model server (vLLM, SGLang, Ollama with parallel slots, llama.cpp with several
slots) writes one event for every running sequence per decode step, so N backend sockets
become readable together. With a task per turn waiting on its own socket, trio wakes N
tasks for that burst (a re-registration with its epoll and a task switch each) and runs
them in its batch order, which it reverses half the time: the event written first can be
relayed last. Here the sockets of the turns that are streaming sit in one epoll set of our
own (level-triggered, registered once per turn), that set's descriptor is what trio waits
on, and one task relays the ready sockets in the order the kernel reports them: each turn's
``pump`` reads its socket and writes its frames before the next turn's socket is read.

A stream alone (``alone``: one turn between ``enter`` and ``leave``) waits on its own socket
instead: the poller's own epoll round would cost it a syscall per read, and there is no burst
to share.

A turn comes back to its own task (``follow`` returns) when its response ends, when the
channel has no room for more frames, or when its read failed (the error is raised there):
everything that waits happens in the turn's own task, under its own cancel scopes.

Linux only (``select.epoll``); elsewhere ``Poller.open`` gives None and each turn waits on
its own socket.
"""

from __future__ import annotations

import select
from typing import Protocol

import trio

END = 3  # what ``pump`` found: the response ended (or the read failed)
ROOM = 2  # the channel has too much waiting: wait for room, then pump again
MORE = 1  # the read filled the buffer: more may be there already
IDLE = 0  # the socket is empty: wait until it is readable


class Pumped(Protocol):
    """A streaming turn as the poller sees it (``gateway.runner.relay.Pump``)."""

    fd: int
    handback: trio.Event | None
    state: int
    error: Exception | None

    def pump(self) -> int: ...


class Poller:
    """The ready backend sockets of every streaming turn, relayed by one task (``run``)."""

    def __init__(self, epoll: select.epoll) -> None:
        self._epoll = epoll
        self._turns: dict[int, Pumped] = {}
        self._streaming = 0  # turns relaying a stream now (between enter and leave)
        self.alone = False  # exactly one is: it waits on its own socket (read, never written)

    @classmethod
    def open(cls) -> Poller | None:
        """A poller where the platform has epoll, else None."""
        if not hasattr(select, "epoll"):
            return None
        return cls(select.epoll())

    @property
    def following(self) -> int:
        return len(self._turns)

    def enter(self) -> None:
        """A turn's stream begins: it may be followed from now on (``leave`` when it ends)."""
        self._streaming += 1
        self.alone = self._streaming == 1

    def leave(self) -> None:
        self._streaming -= 1
        self.alone = self._streaming == 1

    async def run(self) -> None:
        """Relay ready sockets until cancelled; the epoll set is closed at the end."""
        fd = self._epoll.fileno()
        wait_readable = trio.lowlevel.wait_readable
        try:
            while True:
                await wait_readable(fd)  # one wake-up for every socket that became readable
                self._pump_ready()
        finally:
            for turn in list(self._turns.values()):
                self._release(turn)
            self._epoll.close()

    def _pump_ready(self) -> None:
        """Pump every ready turn once, in the order the kernel reports them."""
        turns = self._turns
        for ready, _events in self._epoll.poll(0):
            turn = turns.get(ready)
            if turn is None:
                continue
            try:
                state = turn.pump()
            except Exception as exc:  # the turn's own task raises it
                turn.error = exc
                state = END
            if state >= ROOM:
                self._release(turn)
                turn.state = state
                assert turn.handback is not None
                turn.handback.set()

    async def follow(self, turn: Pumped) -> int:
        """Relay ``turn`` from the poller's task until it comes back: ``END`` or ``ROOM``.
        Its read's error, if it failed, is raised here."""
        turn.handback = handback = trio.Event()
        turn.error = None
        self._turns[turn.fd] = turn
        try:
            self._epoll.register(turn.fd, select.EPOLLIN)
        except BaseException:
            del self._turns[turn.fd]
            raise
        try:
            await handback.wait()
        finally:
            if self._turns.get(turn.fd) is turn:  # cancelled while followed
                self._release(turn)
        error = turn.error
        if error is not None:
            turn.error = None
            raise error
        return turn.state

    def _release(self, turn: Pumped) -> None:
        del self._turns[turn.fd]
        try:
            self._epoll.unregister(turn.fd)
        except (OSError, ValueError):  # the socket was closed already: the kernel dropped it
            pass
