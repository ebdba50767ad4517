"""A loopback TCP load balancer for tests, as HAProxy in front of the hub's replicas does it: each
client connection goes to the next backend in turn, and to the one after when a backend refuses
the connection (``option redispatch``); a backend's end (or reset) ends its client's connection.

``active(backend, front_door=True)`` counts the connections open to a backend now (those whose
request line is a ``/v1/`` one: front-door turns); ``changed`` is set at every change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import trio

PEEK = 16  # bytes of a request read to tell a front-door turn (``POST /v1/``)


@dataclass(eq=False)
class Balancer:
    backends: list[int]  # ports on 127.0.0.1
    port: int = 0
    changed: trio.Event = field(default_factory=trio.Event)
    _next: int = 0
    _open: dict[int, list[bool]] = field(default_factory=dict)  # port -> [front door?] open

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def active(self, backend: int, front_door: bool = True) -> int:
        return sum(1 for kind in self._open.get(backend, []) if kind or not front_door)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def _connect(self) -> tuple[int, trio.SocketStream] | None:
        start = self._next  # this connection's own rotation: others may start meanwhile
        self._next += 1
        for n in range(len(self.backends)):
            port = self.backends[(start + n) % len(self.backends)]
            try:
                return port, await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                continue  # refused: the next backend (redispatch)
        return None

    async def handle(self, client: trio.SocketStream) -> None:
        try:
            first = await client.receive_some(PEEK)
        except trio.BrokenResourceError:
            first = b""
        found = await self._connect() if first else None
        if found is None:
            await client.aclose()
            return
        port, upstream = found
        kind = first.startswith(b"POST /v1/")
        kinds = self._open.setdefault(port, [])
        kinds.append(kind)
        self._notify()
        try:
            async with client, upstream:
                await upstream.send_all(first)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_pipe, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(_pipe, upstream, client, nursery.cancel_scope)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            kinds.remove(kind)
            self._notify()


async def _pipe(source: trio.SocketStream, sink: trio.SocketStream, done: trio.CancelScope) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    done.cancel()  # either end gone: the other is closed (the client sees its replica's end)


@asynccontextmanager
async def balancer(backends: list[int]) -> AsyncIterator[Balancer]:
    """A balancer over ``backends`` (ports on loopback), listening on a free port of its own."""
    found = Balancer(list(backends))
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, found.handle, 0, host="127.0.0.1"))
        found.port = listeners[0].socket.getsockname()[1]
        yield found
        nursery.cancel_scope.cancel()
