"""A loopback TCP proxy whose path can die silently: frozen, or forgotten by a NAT when idle.

- ``freeze()``: every connection open at that moment stops carrying bytes in both directions and
  stays open (what a suspended laptop, a Wi-Fi hand-over or a rebooted middlebox looks like from
  either end); connections made afterwards pass. ``freeze_all()`` also freezes the new ones (the
  Server gone entirely, its traffic black-holed), until ``thaw_all()``.
- ``nat_idle = T``: a connection that carried no byte in either direction for ``T`` seconds is
  forgotten, as a NAT or CGNAT forgets an idle mapping: from then on its bytes are dropped, and
  neither end is told.

- ``cut_all()``: every connection open at that moment is reset at both ends (a router that drops
  its state and answers with RSTs): both ends see it broken at once.
- ``reap()``: the dead connections still held are closed and forgotten (once both ends have given
  them up: a bench of hundreds of faults must not keep every dead path open).

Nothing is ever closed by the proxy while a path is dead (until reaped): both ends see a live,
silent socket. The fault bench (``bench/faults.py``) uses this same proxy.
Counters (``connections``, ``frozen``, ``forgotten``, ``cut``) are there to wait on, with
``changed``.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio


@dataclass(eq=False)
class _Path:
    """One client connection and its upstream: alive until frozen or forgotten."""

    last_byte: float
    dead: bool = False
    streams: tuple[trio.SocketStream, ...] = ()  # its two sockets, once both are open
    scope: trio.CancelScope | None = None  # its pumps' (cancelled: both sockets closed)


@dataclass(eq=False)
class PathProxy:
    target_port: int
    target_host: str = "127.0.0.1"
    port: int = 0
    nat_idle: float | None = None
    connections: int = 0
    frozen: int = 0
    forgotten: int = 0
    cut: int = 0
    changed: trio.Event = field(default_factory=trio.Event)
    _paths: set[_Path] = field(default_factory=set)
    _freeze_new: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def freeze(self) -> int:
        """Kill every open path silently; returns how many were frozen."""
        count = 0
        for path in self._paths:
            if not path.dead:
                path.dead = True
                count += 1
        self.frozen += count
        self._notify()
        return count

    def cut_all(self) -> int:
        """Reset every open path at both ends (RST, no FIN); returns how many were cut."""
        count = 0
        for path in list(self._paths):
            if path.streams and not path.dead:
                path.dead = True
                for stream in path.streams:
                    _reset(stream)
                count += 1
        self.cut += count
        self._notify()
        return count

    def freeze_all(self) -> None:
        """Freeze the open paths and every new one, until :meth:`thaw_all`."""
        self._freeze_new = True
        self.freeze()

    def thaw_all(self) -> None:
        """New connections pass again (the frozen ones stay dead, as in life)."""
        self._freeze_new = False

    def reap(self) -> int:
        """Close the dead paths still held; returns how many."""
        count = 0
        for path in list(self._paths):
            if path.dead and path.scope is not None:
                path.scope.cancel()  # its two sockets are closed as its handler returns
                self._paths.discard(path)
                count += 1
        return count

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self.changed.wait()

    async def handle_connection(self, client: trio.SocketStream) -> None:
        path = _Path(last_byte=trio.current_time(), dead=self._freeze_new)
        self.connections += 1
        self._notify()
        self._paths.add(path)
        try:
            async with client, await trio.open_tcp_stream(self.target_host, self.target_port) as up:
                path.streams = (client, up)
                async with trio.open_nursery() as nursery:
                    path.scope = nursery.cancel_scope
                    nursery.start_soon(self._pump, client, up, path, nursery.cancel_scope)
                    nursery.start_soon(self._pump, up, client, path, nursery.cancel_scope)
                    if self.nat_idle is not None:
                        nursery.start_soon(self._forget_when_idle, path)
        except OSError:
            pass  # the target refused: the client sees its connection end
        finally:
            self._paths.discard(path)

    async def _pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        path: _Path,
        scope: trio.CancelScope,
    ) -> None:
        try:
            while True:
                data = await source.receive_some(65536)
                if not data:
                    break
                if path.dead:
                    continue  # dropped on the floor; neither end hears of it
                path.last_byte = trio.current_time()
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        if path.dead and path.streams and path.streams[0].socket.fileno() != -1:
            await trio.sleep_forever()  # a dead path never delivers the close either (until reaped)
        scope.cancel()

    async def _forget_when_idle(self, path: _Path) -> None:
        assert self.nat_idle is not None
        while not path.dead:
            idle_until = path.last_byte + self.nat_idle
            if trio.current_time() >= idle_until:
                path.dead = True
                self.forgotten += 1
                self._notify()
                return
            await trio.sleep_until(idle_until)


def _reset(stream: trio.SocketStream) -> None:
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    stream.socket.close()


@asynccontextmanager
async def path_proxy(
    target_port: int, *, nat_idle: float | None = None
) -> AsyncIterator[PathProxy]:
    """A :class:`PathProxy` on a free loopback port in front of ``127.0.0.1:target_port``."""
    proxy = PathProxy(target_port=target_port, nat_idle=nat_idle)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_tcp, proxy.handle_connection, 0, host="127.0.0.1")
        )
        proxy.port = listeners[0].socket.getsockname()[1]
        yield proxy
        nursery.cancel_scope.cancel()
