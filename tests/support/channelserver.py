"""A Chat Channel's Server end for the runner's tests (wsproto over loopback): it sends the hello
of docs/protocol.md §6 (or none), sends frames, records every frame the runner sends on each
connection, and drops a connection the way a broken path does (a reset, no close frame).

A job points its channel here with ``channelUrl`` (``ChannelServer.url``); the runner's REST
calls go to a hub as usual. ``hello`` decides each new connection's first frame: by default the
hello with both extensions and, from the second connection on, ``resume`` naming every turn the
test still waits for (``open_turns``) with the number of its chunk frames received so far, on
every connection (what the hub will do). ``pongs``: answer the runner's pings.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

from gateway.wire import protocol

CHUNK = protocol.COMPLETION_CHUNK
LAST = (protocol.COMPLETION_DONE, protocol.COMPLETION_ERROR, protocol.MODELS_RESPONSE)


@dataclass(eq=False)
class Conn:
    """One channel connection the runner dialled."""

    server: ChannelServer
    stream: trio.SocketStream
    ws: WSConnection
    number: int  # 1 for the first connection, then 2, ...
    texts: list[str] = field(default_factory=list)  # every text message, in order
    closed: trio.Event = field(default_factory=trio.Event)
    dropped: bool = False

    async def send(self, frame: dict[str, Any] | bytes) -> None:
        text = frame.decode() if isinstance(frame, bytes) else json.dumps(frame)
        await self.stream.send_all(self.ws.send(TextMessage(data=text)))

    def drop(self) -> None:
        """Reset the connection (SO_LINGER 0): the runner sees it broken, with no close frame."""
        if self.dropped:
            return
        self.dropped = True
        try:
            self.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        except OSError:
            pass
        self.stream.socket.close()
        self.closed.set()

    async def read(self) -> None:
        parts: list[str] = []
        try:
            while True:
                data = await self.stream.receive_some(1 << 16)
                if not data:
                    return
                self.ws.receive_data(data)
                out = b""
                for event in self.ws.events():
                    if isinstance(event, TextMessage):
                        parts.append(event.data)
                        if event.message_finished:
                            self.texts.append("".join(parts))
                            parts = []
                            self.server.received(self, self.texts[-1])
                    elif isinstance(event, Ping) and self.server.pongs:
                        out += self.ws.send(event.response())
                    elif isinstance(event, CloseConnection):
                        out += self.ws.send(event.response())
                if out:
                    await self.stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        finally:
            self.closed.set()


def raw_chunk(text: str) -> bytes:
    """The ``chunk`` of a chunk frame as the runner wrote it: the backend's payload, verbatim."""
    head, sep, rest = text.partition(',"chunk":')
    assert sep and rest.endswith("}"), text
    return rest[:-1].encode()


class ChannelServer:
    """Accepts the runner's channel connections (``conns``, in order) and sorts what comes."""

    def __init__(
        self,
        hello: Callable[[ChannelServer, int, str], dict[str, Any] | None] | None = None,
        *,
        pongs: bool = True,
        refuse: bool = False,
    ) -> None:
        self.hello = hello if hello is not None else resume_hello
        self.pongs = pongs
        self.refuse = refuse  # answer every upgrade 503 (the Server is there, the channel not)
        self.port = 0
        self.conns: list[Conn] = []
        self.frames: dict[str, list[tuple[int, dict[str, Any], str]]] = {}  # by requestId
        self.open_turns: set[str] = set()  # turns a client still waits for (named on redial)
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/api/lives/chat/channel/ws"

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    async def conn(self, number: int) -> Conn:
        """The ``number``-th connection (1-based), once the runner dialled it."""
        await self.wait(lambda: len(self.conns) >= number)
        return self.conns[number - 1]

    # -- what came ------------------------------------------------------------------------

    def received(self, conn: Conn, text: str) -> None:
        frame = json.loads(text)
        request_id = frame.get("requestId")
        if isinstance(request_id, str):
            self.frames.setdefault(request_id, []).append((conn.number, frame, text))
            if frame["type"] in LAST:
                self.open_turns.discard(request_id)
        self._notify()

    def of(self, request_id: str) -> list[dict[str, Any]]:
        return [f for _, f, _ in self.frames.get(request_id, [])]

    def chunk_count(self, request_id: str) -> int:
        return sum(1 for f in self.of(request_id) if f["type"] == CHUNK)

    def chunks(self, request_id: str) -> list[bytes]:
        """Every chunk of the turn, as the client got them (raw, in order, all connections)."""
        return [raw_chunk(t) for _, f, t in self.frames.get(request_id, []) if f["type"] == CHUNK]

    def finished(self, request_id: str) -> bool:
        return any(f["type"] in LAST for f in self.of(request_id))

    async def until_chunks(self, request_id: str, n: int) -> None:
        await self.wait(lambda: self.chunk_count(request_id) >= n)

    async def until_finished(self, request_id: str) -> dict[str, Any]:
        await self.wait(lambda: self.finished(request_id))
        return next(f for f in self.of(request_id) if f["type"] in LAST)

    # -- serving --------------------------------------------------------------------------

    async def request(
        self, conn: Conn, job_id: str, request_id: str, body: dict[str, Any], **extra: Any
    ) -> None:
        """Send a turn on ``conn``; it counts as open (named on a redial) until it ends."""
        self.open_turns.add(request_id)
        frame = {"type": protocol.COMPLETION_REQUEST, "jobId": job_id, "requestId": request_id}
        await conn.send({**frame, "body": body, **extra})

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            listeners = await nursery.start(
                partial(trio.serve_tcp, self._accept, 0, host="127.0.0.1")
            )
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started(self)

    async def _accept(self, stream: trio.SocketStream) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        target = ""
        while not target:
            data = await stream.receive_some(1 << 16)
            if not data:
                return
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, Request):
                    target = event.target
        if self.refuse:
            await stream.send_all(ws.send(RejectConnection(status_code=503)))
            await stream.aclose()
            return
        await stream.send_all(ws.send(AcceptConnection()))
        conn = Conn(self, stream, ws, len(self.conns) + 1)
        job_id = target.split("jobId=", 1)[1].split("&", 1)[0]
        hello = self.hello(self, conn.number, job_id)
        if hello is not None:
            await conn.send(hello)
        self.conns.append(conn)
        self._notify()
        async with stream:
            await conn.read()
        self._notify()


def resume_hello(server: ChannelServer, number: int, job_id: str) -> dict[str, Any] | None:
    """The hub's hello: both extensions; on a redial, each open turn's chunk frames received."""
    frame: dict[str, Any] = {
        "type": protocol.HELLO,
        "jobId": job_id,
        "extensions": [protocol.RESUME, protocol.CONTINUE],
    }
    if number > 1:
        frame["resume"] = {r: server.chunk_count(r) for r in sorted(server.open_turns)}
    return frame


def no_hello(server: ChannelServer, number: int, job_id: str) -> dict[str, Any] | None:
    """A Server without the extensions: never a hello."""
    return None


@asynccontextmanager
async def channel_server(
    hello: Callable[[ChannelServer, int, str], dict[str, Any] | None] | None = None,
    **kwargs: Any,
) -> AsyncIterator[ChannelServer]:
    server = ChannelServer(hello, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        yield server
        nursery.cancel_scope.cancel()
