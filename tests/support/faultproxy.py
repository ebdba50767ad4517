"""A faulty Server for the tests: a loopback HTTP proxy in front of a hub that injects faults per
runner route, counts requests, and can stop reading the Chat Channels (the hub ships none of it).

Faults (``FaultProxy.faults[route]``, each consumed by one request on that route):

- an HTTP status: answered by the proxy (``{"error": "injected"}``); on the channel route the
  WebSocket handshake is refused with it;
- ``RESET``: the client's TCP connection is closed abortively (RST, SO_LINGER 0), no answer;
- ``LOST``: the request goes to the hub, which acts on it; its answer is dropped and the client's
  connection reset instead;
- ``Hold(s)``: the request is held unanswered for ``s`` seconds or until the client gives up, never
  sent to the hub, then the connection is reset (a hung Server, a lost request);
- ``Delay(s)``: the whole request is read, held ``s`` seconds, then sent to the hub; its answer goes
  back if the client still waits.

``pause_channels()``: the proxy stops reading what runners send on their open channels (a Server
that stops reading): frames pile up in the TCP buffers until the runner's sends block.
``resume_channels()`` reads again. The proxy's hub side keeps sending.
"""

from __future__ import annotations

import collections
import re
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import h11
import trio

RESET = "reset"
LOST = "lost"
ROUTES = ("register", "poll", "claim", "status", "progress", "events", "channel")


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold the request unanswered for ``seconds`` (or until the client gives up), then reset."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Delay:
    """Send the request on to the hub ``seconds`` late."""

    seconds: float


Fault = int | str | Hold | Delay


@dataclass(frozen=True, slots=True)
class Hit:
    """One request to a runner route: when (trio clock), which route, which fault it met."""

    at: float
    route: str
    fault: Fault | None


_BASE = r"^/api/owners/[^/]+/projects/[^/]+/"
_ROUTE_PATTERNS = [
    ("register", re.compile(_BASE + r"runners(/register)?$")),
    ("poll", re.compile(_BASE + r"runners/jobs$")),
    ("claim", re.compile(_BASE + r"runners/generate-jitconfig$")),
    ("status", re.compile(_BASE + r"runs/[^/]+/jobs/[^/]+$")),
    ("progress", re.compile(_BASE + r"runs/[^/]+/jobs/[^/]+/progress$")),
    ("events", re.compile(_BASE + r"runners/events$")),
    ("channel", re.compile(r"^/api/lives/chat/channel/ws$")),
]


def route_of(target: bytes) -> str | None:
    """The runner route a request target belongs to, or None."""
    path = target.split(b"?", 1)[0].decode("latin-1")
    for name, pattern in _ROUTE_PATTERNS:
        if pattern.match(path):
            return name
    return None


class _Closed(Exception):
    """The client's side of the connection is gone (or was reset by us)."""


def _reset(stream: trio.SocketStream) -> None:
    """Close ``stream`` abortively: an RST, not a FIN."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    stream.socket.close()


class FaultProxy:
    """The proxy; ``url`` is what runners use as their Server."""

    def __init__(self, target_url: str) -> None:
        host_port = target_url.split("//", 1)[1].rstrip("/")
        host, _, port = host_port.rpartition(":")
        self.target = (host, int(port))
        self.faults: dict[str, list[Fault]] = {route: [] for route in ROUTES}
        self.hits: list[Hit] = []
        self.hit_counts: collections.Counter[str] = collections.Counter()
        self._hit = trio.Event()
        self._reading = trio.Event()
        self._reading.set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_hits(self, route: str, n: int) -> list[Hit]:
        """Wait until ``n`` requests reached ``route``; returns that route's hits."""
        while self.hit_counts[route] < n:
            await self._hit.wait()
        return [h for h in self.hits if h.route == route]

    def pause_channels(self) -> None:
        """Stop reading what runners send on channels (open ones and new ones)."""
        if self._reading.is_set():
            self._reading = trio.Event()

    def resume_channels(self) -> None:
        self._reading.set()

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._connection, listeners)

    # -- one client connection ---------------------------------------------------------

    async def _connection(self, client: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        upstream: tuple[trio.SocketStream, h11.Connection] | None = None
        try:
            while True:
                request = await _next(client, conn)
                if not isinstance(request, h11.Request):
                    return
                body = b""
                while True:
                    event = await _next(client, conn)
                    if isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                route = route_of(request.target)
                fault = self._take(route)
                if isinstance(fault, int):
                    await self._answer(client, conn, fault)
                elif fault == RESET:
                    _reset(client)
                    return
                elif isinstance(fault, Hold):
                    with trio.move_on_after(fault.seconds):
                        while await client.receive_some(65536):
                            pass
                    _reset(client)
                    return
                else:
                    if isinstance(fault, Delay):
                        await trio.sleep(fault.seconds)
                    if upstream is None:
                        stream = await trio.open_tcp_stream(*self.target)
                        upstream = (stream, h11.Connection(h11.CLIENT))
                    done = await self._forward(client, conn, upstream, request, body, fault == LOST)
                    if done:
                        return
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
                if upstream is not None:
                    if upstream[1].our_state is h11.DONE and upstream[1].their_state is h11.DONE:
                        upstream[1].start_next_cycle()
                    else:
                        await upstream[0].aclose()
                        upstream = None
        except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            if upstream is not None:
                await upstream[0].aclose()
            if client.socket.fileno() != -1:
                await client.aclose()

    def _take(self, route: str | None) -> Fault | None:
        if route is None:
            return None
        queued = self.faults[route]
        fault = queued.pop(0) if queued else None
        self.hits.append(Hit(trio.current_time(), route, fault))
        self.hit_counts[route] += 1
        self._hit.set()
        self._hit = trio.Event()
        return fault

    async def _answer(self, client: trio.SocketStream, conn: h11.Connection, status: int) -> None:
        body = b'{"error": "injected"}'
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        await client.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
        await client.send_all(conn.send(h11.Data(data=body)))
        await client.send_all(conn.send(h11.EndOfMessage()))

    async def _forward(
        self,
        client: trio.SocketStream,
        conn: h11.Connection,
        upstream: tuple[trio.SocketStream, h11.Connection],
        request: h11.Request,
        body: bytes,
        lose: bool,
    ) -> bool:
        """Send the request to the hub and its answer back (``lose``: reset instead); True when
        the connection is over (reset, or switched to a WebSocket that has ended)."""
        stream, up = upstream
        out = up.send(
            h11.Request(method=request.method, target=request.target, headers=request.headers)
        )
        if body:
            out += up.send(h11.Data(data=body))
        out += up.send(h11.EndOfMessage())
        await stream.send_all(out)
        gone = False
        switched: h11.InformationalResponse | None = None
        async with trio.open_nursery() as nursery:

            async def until_client_leaves() -> None:
                # the client leaving ends a long answer (the events stream); bytes it sends
                # meanwhile (its next request) stay queued in ``conn``
                nonlocal gone
                try:
                    while data := await client.receive_some(65536):
                        conn.receive_data(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                gone = True
                nursery.cancel_scope.cancel()

            if not lose:
                nursery.start_soon(until_client_leaves)
            try:
                while True:
                    event = await _next(stream, up)
                    if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                        switched = event
                        break
                    if isinstance(event, h11.ConnectionClosed):
                        gone = True
                        break
                    if isinstance(event, h11.EndOfMessage):
                        break
                    if not lose:
                        await client.send_all(conn.send(event))
            except (_Closed, trio.BrokenResourceError, trio.ClosedResourceError):
                gone = True
            nursery.cancel_scope.cancel()
        if gone:
            raise _Closed()
        if switched is None and not lose:
            await client.send_all(conn.send(h11.EndOfMessage()))
        if switched is not None:
            await client.send_all(conn.send(switched))
            await self._pipe(client, conn, stream, up)
            return True
        if lose:
            _reset(client)
            return True
        return False

    async def _pipe(
        self,
        client: trio.SocketStream,
        conn: h11.Connection,
        stream: trio.SocketStream,
        up: h11.Connection,
    ) -> None:
        """Relay a switched (WebSocket) connection byte for byte, until either side ends."""
        from_client, _ = conn.trailing_data
        from_hub, _ = up.trailing_data
        if from_hub:
            await client.send_all(from_hub)

        async def runner_to_hub() -> None:
            if from_client:
                await stream.send_all(from_client)
            while True:
                await self._reading.wait()
                data = await client.receive_some(65536)
                if not data:
                    return
                await stream.send_all(data)

        async def hub_to_runner() -> None:
            while data := await stream.receive_some(65536):
                await client.send_all(data)

        async with trio.open_nursery() as nursery:

            async def one_way(pump: Any) -> None:
                try:
                    await pump()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(one_way, runner_to_hub)
            nursery.start_soon(one_way, hub_to_runner)


async def _next(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    """The next h11 event on ``conn``, reading from ``stream`` as needed."""
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        try:
            data = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise _Closed() from None
        conn.receive_data(data)


@asynccontextmanager
async def fault_proxy(target_url: str) -> AsyncIterator[FaultProxy]:
    """A ``FaultProxy`` in front of ``target_url`` for the body of the block."""
    proxy = FaultProxy(target_url)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        yield proxy
        nursery.cancel_scope.cancel()


class RequestLog:
    """A test-only wrapper of the hub's handler: every request (method, path) it was given."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, str]] = []

    async def http(self, req: Any) -> None:
        self.requests.append((req.scope["method"], req.scope["path"]))
        await self.app.http(req)

    async def websocket(self, req: Any) -> None:
        self.requests.append((req.scope["method"], req.scope["path"]))
        await self.app.websocket(req)
