"""The server core's listener: connections accepted within a cap, each served in its own task.

Why a server of our own: the hub's serving path writes each chunk a runner sends straight to its
client's socket from the channel's reader, and a Chat Channel needs pings whose pongs are seen;
an ASGI server gives neither (a chunk crossed four representations and two task hops there).
Here each connection is one task over a non-blocking socket (``gateway.wire.netio``, writes tried
at once): ``gateway.wire.httpconn`` serves its HTTP/1.1 requests (httptools parses them), or
its WebSocket (``gateway.wire.wsserver`` over ``gateway.wire.wsconn``, which does no I/O).

A handler gets ``http(Request)`` (``gateway.wire.http``: the head, ``body(limit)`` read on demand
so credentials are checked first, the ``Response``) and ``websocket(WebSocketRequest)`` (accept
it, or refuse it with an HTTP status). Every bound a network server needs is kept: a head
deadline and size cap, a body deadline, keep-alive idle time (``ConnectionLimits``, in the
connection; the head waits' deadlines swept by one task, ``gateway.wire.sweeper``);
here, a cap on open connections: past it a new one gets a 503 written at once and is closed (one
warning a minute), and past ``MAX_REFUSING`` refusals at once it is just closed; an accept that
fails for lack of descriptors gives up a spare one kept for this, accepts the waiting connection
with it and writes it the same 503 (never a silent timeout in the backlog); one that fails for
lack of memory waits a moment instead of spinning.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from gateway.wire.httpconn import (
    ConnectionLimits,
    Handler,
    HTTPHandler,
    WebSocketRequest,
    error_response,
    serve_connection,
)
from gateway.wire.netio import take_socket
from gateway.wire.sweeper import Sweeper, grain_for
from gateway.wire.wsconn import CLOSE_ABNORMAL, CLOSE_NO_PONG, Keepalive
from gateway.wire.wsserver import ServerWebSocket, WebSocketCounters

log = logging.getLogger("gateway.wire.server")

REFUSE_TIMEOUT = 1.0  # s: a connection refused at the cap gets this long to read its 503
MAX_REFUSING = 64  # connections refused with a 503 at once; past it they are closed at once
WARN_EVERY = 60.0  # s: at most one warning this often about refused connections / EMFILE
_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

_BUSY = error_response(
    503,
    "the server has too many open connections; retry shortly",
    "too_many_connections",
    extra=[(b"retry-after", b"1")],
)


class ServerCounts(WebSocketCounters, Protocol):
    """What the server counts (the hub's ``HubCounters`` has these among its own)."""

    connections_refused: int


@dataclass
class ServerCounters:
    """The server's counters, for a user that keeps none of its own."""

    pings_sent: int = 0
    pong_timeouts: int = 0
    ws_protocol_errors: int = 0
    connections_refused: int = 0


class Server:
    """Serves a ``Handler`` on TCP (or TLS) listeners within ``limits``; WebSockets get the
    ``keepalive`` pings; ``counters`` count pings, pong timeouts, refusals."""

    def __init__(
        self,
        handler: HTTPHandler,
        *,
        keepalive: Keepalive | None = None,
        counters: ServerCounts | None = None,
        limits: ConnectionLimits | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.handler = handler
        self.keepalive = keepalive or Keepalive()
        self.counters: ServerCounts = counters if counters is not None else ServerCounters()
        self.limits = limits or ConnectionLimits()
        self.ssl_context = ssl_context
        self.open_connections = 0
        self._refusing = 0  # refused connections still being told so
        # a descriptor kept in reserve: out of them, it is given up to accept and refuse one
        self._spare: int | None = None  # opened while serving
        self._warned_at = -math.inf
        # the connections' head deadlines and their WebSockets' keepalives (run while serving)
        limits, keepalive = self.limits, self.keepalive
        self.sweeper = Sweeper(
            grain_for(limits.head_timeout, keepalive.interval, keepalive.timeout)
        )

    async def serve(
        self, host: str, port: int, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``host:port`` (0: a free port) until cancelled; ``started`` gets the URL."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        await self.serve_listeners(listeners, task_status)

    async def serve_listeners(
        self,
        listeners: list[trio.SocketListener],
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on ``listeners``, already bound (so that a busy port failed earlier), until
        cancelled; they are closed then. ``started`` gets the URL of the first."""
        bound = listeners[0].socket.getsockname()
        scheme = "https" if self.ssl_context is not None else "http"
        shown_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self._spare = _spare()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.sweeper.run)
                for listener in listeners:
                    nursery.start_soon(self._accept, listener, nursery)
                task_status.started(f"{scheme}://{shown_host}:{bound[1]}")
        finally:
            for listener in listeners:
                listener.socket.close()
            if self._spare is not None:
                os.close(self._spare)
                self._spare = None

    def _warn(self, message: str, *args: Any) -> None:
        now = trio.current_time()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning(message, *args)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_ERRNOS:
                    raise
                self.counters.connections_refused += 1
                self._warn(
                    "cannot accept connections: %s (open: %d): refusing new ones with 503",
                    exc.strerror,
                    self.open_connections,
                )
                if not await self._refuse_spare(listener):
                    await trio.sleep(0.1)
                continue
            sock = take_socket(stream)
            if self.open_connections >= self.limits.max_connections:
                self.counters.connections_refused += 1
                self._warn(
                    "%d connections open (max_connections): refusing new ones with 503 "
                    "(refused so far: %d)",
                    self.open_connections,
                    self.counters.connections_refused,
                )
                if self._refusing < MAX_REFUSING:
                    self._refusing += 1
                    nursery.start_soon(self._refuse_busy, sock)
                else:  # a flood: no 503 for these, just the close
                    sock.close()
                continue
            self.open_connections += 1
            nursery.start_soon(self._handle, sock)

    async def _refuse_spare(self, listener: trio.SocketListener) -> bool:
        """Out of descriptors: the spare one given up for a moment, the waiting connection
        accepted with it, told 503 at once and closed (not left to time out in the backlog),
        the spare taken back. False when there was no spare to give."""
        if self._spare is None:
            self._spare = _spare()
            return False
        os.close(self._spare)
        self._spare = None
        try:
            with trio.move_on_after(REFUSE_TIMEOUT):
                sock = take_socket(await listener.accept())
                try:
                    sock.setblocking(False)
                    sock.send(_BUSY)
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                finally:
                    sock.close()
        except OSError:
            pass
        finally:
            self._spare = _spare()
        return True

    async def _refuse_busy(self, sock: socket.socket) -> None:
        """A connection past the cap: a 503 written at once, a moment for the client to read it."""
        sock.setblocking(False)
        try:
            sock.send(_BUSY)
            sock.shutdown(socket.SHUT_WR)
            with trio.move_on_after(REFUSE_TIMEOUT):
                while True:
                    await trio.lowlevel.wait_readable(sock)
                    if not sock.recv(65536):
                        break
        except OSError:
            pass
        finally:
            self._refusing -= 1
            sock.close()

    async def _handle(self, sock: socket.socket) -> None:
        try:
            await serve_connection(self, sock, _address(sock), self.ssl_context)
        except Exception:
            log.exception("unexpected error serving a connection")
        finally:
            self.open_connections -= 1


def _spare() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _address(sock: socket.socket) -> tuple[str, int] | None:
    try:
        addr = sock.getpeername()
    except OSError:
        return None
    return (str(addr[0]), int(addr[1]))


__all__ = [
    "CLOSE_ABNORMAL",
    "CLOSE_NO_PONG",
    "ServerCounts",
    "HTTPHandler",
    "Handler",
    "Keepalive",
    "ConnectionLimits",
    "Server",
    "ServerCounters",
    "ServerWebSocket",
    "WebSocketRequest",
]
