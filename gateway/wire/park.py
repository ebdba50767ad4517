"""A task parked until it is woken or its client's connection ends, with no cancel scope and no
cancellation per wake: a wake is one reschedule.

A front-door turn's task waits while the channel's reader writes its answer (``Turn.sleep``);
it must also see its client leave. Waiting for both with trio's ``wait_readable`` takes a cancel
scope per wait and a ``Cancelled`` raised through the wait to wake it (the costliest part of a
short turn's scaffolding). Here the parked task's socket is in an epoll of this module's own,
which one system task per trio run watches (``_Watch``): the peer's end (its FIN), a reset or an
error reschedules the parked task with True, ``Park.cancel`` with False. Bytes the client sends
meanwhile do not wake it: they wait in the socket, bounded by its buffer, for the connection's
next read. A socket stays in the epoll from its first park until it is closed (the kernel then
takes it out), so a turn's park costs no system call; one whose connection ends while no task is
parked on it is taken out when the watch sees it. A parked task is cancelled as any other.
Linux only (``select.epoll``); elsewhere a park with a socket is trio's ``wait_readable`` (bytes
wake it too) in a cancel scope that ``cancel`` cancels.
"""

from __future__ import annotations

import select
import socket

import outcome
import trio
from trio.lowlevel import Abort, RunVar, Task

_WATCH: RunVar[_Watch] = RunVar("gateway.wire.park")
_EPOLL = hasattr(select, "epoll")
# the peer's end, not its bytes (EPOLLHUP and EPOLLERR come whatever is asked)
_ENDED = getattr(select, "EPOLLRDHUP", 0x2000)


class _Watch:
    """The epoll of one trio run's parked sockets and the system task that watches it."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.parked: dict[int, Park] = {}
        # the sockets in the epoll by number (one closed since stays until its number is used
        # again: the kernel took it out; ``is`` tells the new socket from it)
        self.watched: dict[int, socket.socket] = {}
        trio.lowlevel.spawn_system_task(self._run, name="gateway.wire.park")

    async def _run(self) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(self.epoll.fileno())
                for fd, _events in self.epoll.poll(0):
                    park = self.parked.get(fd)
                    if park is not None:
                        park._release(True)
                    else:  # ended with no task parked on it: out until one is
                        self.watched.pop(fd, None)
                        _unregister(self.epoll, fd)
        finally:
            self.epoll.close()


def _unregister(epoll: select.epoll, fd: int) -> None:
    try:
        epoll.unregister(fd)
    except (OSError, ValueError):
        pass  # closed meanwhile: the kernel took it out of the epoll itself


def _watch() -> _Watch:
    try:
        return _WATCH.get()
    except LookupError:
        watch = _Watch()
        _WATCH.set(watch)
        return watch


class Park:
    """One wait of one task: ``wait`` parks it, ``cancel`` wakes it (named as a cancel scope's
    method: the turn wakes its task the same way whichever it waits in)."""

    __slots__ = ("_task", "_fd", "_watch", "_scope")

    def __init__(self) -> None:
        self._task: Task | None = None
        self._scope: trio.CancelScope | None = None  # where there is no epoll
        self._fd = -1
        self._watch: _Watch | None = None

    async def wait(self, sock: socket.socket | None) -> bool:
        """Park until ``cancel`` (False) or, with ``sock``, until its peer ends the connection
        (True: its end or an error to read; without epoll, its bytes too); Cancelled as any
        checkpoint."""
        if sock is not None and not _EPOLL:
            with trio.CancelScope() as self._scope:
                await trio.lowlevel.wait_readable(sock)
                return True
            return False
        self._task = trio.lowlevel.current_task()
        if sock is not None:
            watch = _watch()
            fd = sock.fileno()
            if watch.watched.get(fd) is not sock:  # its first park (or since it ended)
                try:
                    watch.epoll.register(fd, _ENDED)
                except FileExistsError:  # a socket's the kernel has not seen closed: now ours
                    watch.epoll.modify(fd, _ENDED)
                watch.watched[fd] = sock
            watch.parked[fd] = self
            self._fd, self._watch = fd, watch

        def abort(_: object) -> Abort:
            self._task = None
            self._unwatch()
            return Abort.SUCCEEDED

        woke: bool = await trio.lowlevel.wait_task_rescheduled(abort)
        return woke

    def cancel(self) -> None:
        """Wake the parked task (nothing when none is parked)."""
        if self._scope is not None:
            self._scope.cancel()
        self._release(False)

    def _release(self, readable: bool) -> None:
        task = self._task
        if task is None:
            return
        self._task = None
        self._unwatch()
        trio.lowlevel.reschedule(task, outcome.Value(readable))

    def _unwatch(self) -> None:
        watch = self._watch
        if watch is not None:
            if watch.parked.get(self._fd) is self:  # (not a later park's of the same number)
                del watch.parked[self._fd]
            self._fd, self._watch = -1, None
