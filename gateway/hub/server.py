"""The hub's HTTP/1.1 and WebSocket server: an ASGI app over trio, h11 and wsproto, with pings.

Why our own: ASGI shows the app no ping and no pong, so behind hypercorn the hub could not tell
a silent dead Chat Channel from an idle live one (its ``websocket_ping_interval`` never acts on
a missing pong, and its ``read_timeout`` would also cut a front-door client waiting through a
long generation). Here each accepted WebSocket gets a ping every ``ping_interval`` and is closed
(1011) when no frame at all arrives within ``ping_timeout`` of one; the app then sees
``websocket.disconnect``. HTTP responses are written the moment the app sends each body part,
and ``http.disconnect`` is delivered as soon as the client goes.
"""

from __future__ import annotations

import logging
import math
import ssl
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    Pong,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

from gateway.hub.counters import HubCounters
from gateway.hub.http import ASGIApp, Message

log = logging.getLogger("gateway.hub.server")

READ_SIZE = 65536
MAX_HEAD = 64 * 1024  # bytes: a request head larger than this is refused (431 by h11's rule)
MAX_BACKLOG = 256 * 1024  # bytes read ahead of what the app consumed before reading pauses
IDLE_TIMEOUT = 5.0  # s: a connection idle before (or between) requests is closed
CLOSE_TIMEOUT = 2.0  # s: how long a closing WebSocket waits for the peer's close frame
INBOX = 64  # WebSocket messages read ahead of the app before reading pauses
CLOSE_NO_PONG = 1011
CLOSE_ABNORMAL = 1006  # the TCP connection ended without a close frame (RFC 6455 §7.1.5)
_NET_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError)


@dataclass(frozen=True, slots=True)
class Keepalive:
    """A ping every ``interval`` s (0: none); closed when nothing arrives ``timeout`` s after one."""

    interval: float = 20.0
    timeout: float = 20.0


@dataclass(eq=False)
class _Peer:
    """One TCP (or TLS) connection: its stream, the read-ahead and what arrived when."""

    stream: trio.abc.Stream
    rx_at: float = field(default_factory=trio.current_time)  # trio clock of the last bytes
    eof: bool = False
    wake: trio.Event = field(default_factory=trio.Event)  # new bytes or EOF
    consumed: trio.Event = field(default_factory=trio.Event)  # the read-ahead was taken
    send_lock: trio.Lock = field(default_factory=trio.Lock)

    def woken(self) -> None:
        self.wake.set()
        self.wake = trio.Event()

    def taken(self) -> None:
        self.consumed.set()
        self.consumed = trio.Event()

    async def write(self, data: bytes) -> None:
        if data:
            async with self.send_lock:
                await self.stream.send_all(data)


class ClientGoneError(OSError):
    """A send to a client that is gone (the ASGI app sees it from ``send``; an OSError, as the
    ASGI spec asks of a send on a closed connection)."""


class _HTTP:
    """The HTTP/1.1 side of one connection: requests in turn (keep-alive), each through the app."""

    def __init__(self, server: Server, peer: _Peer, scope_base: dict[str, Any]) -> None:
        self.server = server
        self.peer = peer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.scope_base = scope_base
        self.ws: _WebSocket | None = None  # once upgraded, the reader feeds it instead

    def backlog(self) -> int:
        return len(self.conn.trailing_data[0])

    async def next_event(self) -> Any:
        """The next h11 event, reading as needed (the reader task feeds the bytes)."""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                if self.peer.eof:
                    self.conn.receive_data(b"")
                    continue
                wake = self.peer.wake
                self.peer.taken()
                await wake.wait()
                continue
            self.peer.taken()
            return event

    async def send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            await self.peer.write(data)

    async def serve(self) -> None:
        """Serve requests until the connection closes (or is upgraded to a WebSocket)."""
        while True:
            event: Any = None
            with trio.move_on_after(
                IDLE_TIMEOUT if self.conn.their_state is h11.IDLE else math.inf
            ):
                try:
                    event = await self.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._refuse(exc.error_status_hint, str(exc))
                    return
            if not isinstance(event, h11.Request):
                return  # idle past the timeout, or the client closed
            if _header(event.headers, b"upgrade").lower() == b"websocket":
                await self._websocket(event)
                return
            await self._request(event)
            if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                self.conn.start_next_cycle()
            else:
                return

    async def _refuse(self, status: int, why: str) -> None:
        body = why.encode()
        headers = [("content-type", "text/plain"), ("content-length", str(len(body)))]
        headers.append(("connection", "close"))
        try:
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self.send(h11.Response(status_code=status, headers=headers))
                await self.send(h11.Data(data=body))
                await self.send(h11.EndOfMessage())
        except (h11.LocalProtocolError, *_NET_ERRORS):
            pass

    def _scope(self, kind: str, request: h11.Request) -> dict[str, Any]:
        raw_path, _, query = bytes(request.target).partition(b"?")
        scope = dict(self.scope_base)
        scope.update(
            type=kind,
            http_version=request.http_version.decode(),
            method=request.method.decode(),
            path=urllib.parse.unquote(raw_path.decode("latin-1")),
            raw_path=raw_path,
            query_string=query,
            headers=[(k, v) for k, v in request.headers],
        )
        if kind == "websocket":
            scope["scheme"] = "wss" if scope["scheme"] == "https" else "ws"
            scope["subprotocols"] = []
        return scope

    async def _request(self, request: h11.Request) -> None:
        """One request through the app: body parts as they come, each response part at once."""
        gone = trio.Event()
        state = {"started": False, "ended": False, "body_done": False}

        async def receive() -> Message:
            if not state["body_done"]:
                if self.conn.they_are_waiting_for_100_continue:
                    await self.send(h11.InformationalResponse(status_code=100, headers=[]))
                event = await self.next_event()
                if isinstance(event, h11.Data):
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if isinstance(event, h11.EndOfMessage):
                    state["body_done"] = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                gone.set()
                return {"type": "http.disconnect"}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if gone.is_set():
                raise ClientGoneError("the client is gone")
            kind = message["type"]
            try:
                if kind == "http.response.start":
                    headers = list(message.get("headers", []))
                    state["started"] = True
                    await self.send(h11.Response(status_code=message["status"], headers=headers))
                elif kind == "http.response.body":
                    body = message.get("body", b"")
                    more = message.get("more_body", False)
                    data = self.conn.send(h11.Data(data=body)) if body else b""
                    if not more:
                        state["ended"] = True
                        data = (data or b"") + (self.conn.send(h11.EndOfMessage()) or b"")
                    if data:
                        await self.peer.write(data)
            except _NET_ERRORS as exc:
                gone.set()
                raise ClientGoneError(f"the client is gone: {exc!r}") from exc

        async def watch_eof() -> None:
            while not self.peer.eof:
                await self.peer.wake.wait()
            gone.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_eof)
            try:
                await self.server.app(self._scope("http", request), receive, send)
            except ClientGoneError:
                pass
            finally:
                nursery.cancel_scope.cancel()
        if gone.is_set():
            return
        try:
            if not state["started"]:
                await self._refuse(500, "the app sent no response")
            elif not state["ended"]:
                await self.send(h11.EndOfMessage())
            if self.conn.their_state is h11.SEND_BODY:  # the app did not read the whole body
                while not isinstance(
                    await self.next_event(), h11.EndOfMessage | h11.ConnectionClosed
                ):
                    pass
        except (h11.ProtocolError, *_NET_ERRORS):
            return

    async def _websocket(self, request: h11.Request) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        try:
            ws.initiate_upgrade_connection(list(request.headers), request.target)
            next(iter(ws.events()))  # the handshake's Request event
            while not isinstance(await self.next_event(), h11.EndOfMessage):
                pass
        except (RemoteProtocolError, h11.RemoteProtocolError) as exc:
            await self._refuse(400, f"bad WebSocket handshake: {exc}")
            return
        channel = _WebSocket(self, ws, self._scope("websocket", request))
        await channel.serve()


class _WebSocket:
    """One WebSocket through the app: messages both ways, pings, the close handshake."""

    def __init__(self, http: _HTTP, ws: WSConnection, scope: dict[str, Any]) -> None:
        self.http = http
        self.peer = http.peer
        self.ws = ws
        self.scope = scope
        self.connect_sent = False
        self.accepted = False
        self.settled = trio.Event()  # accepted, or the app is done
        self.close_sent = False
        self.close_code: int | None = None  # why it ended, as the app is told
        self.app_blocked = False  # the reader waits for the app to take a message
        self.unblocked_at = -math.inf  # trio clock when the app last took a message it held up
        self.inbox_send, self.inbox = trio.open_memory_channel[Message](INBOX)
        self.peer_closed = trio.Event()
        self._text: list[str] = []
        self._bytes: list[bytes] = []
        self._size = 0

    async def _emit(self, event: Event) -> None:
        async with self.peer.send_lock:
            await self.peer.stream.send_all(self.ws.send(event))

    async def receive(self) -> Message:
        if not self.connect_sent:
            self.connect_sent = True
            return {"type": "websocket.connect"}
        try:
            return await self.inbox.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return {"type": "websocket.disconnect", "code": self.close_code or CLOSE_ABNORMAL}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        try:
            if kind == "websocket.accept":
                headers = list(message.get("headers", []))
                await self._emit(AcceptConnection(extra_headers=headers))
                self.accepted = True
                self.http.ws = self
                leftover = self.http.conn.trailing_data[0]
                if leftover:
                    self.ws.receive_data(leftover)
                self.settled.set()
            elif kind == "websocket.send":
                if self.close_sent or self.ws.state is not ConnectionState.OPEN:
                    raise ClientGoneError("the WebSocket is closed")
                text = message.get("text")
                if text is not None:
                    await self._emit(TextMessage(data=text))
                else:
                    await self._emit(BytesMessage(data=message.get("bytes", b"")))
            elif kind == "websocket.close":
                if not self.accepted:  # refused before the accept: HTTP 403
                    self.close_sent = True
                    await self.http._refuse(403, "forbidden")
                    return
                await self.close(message.get("code", 1000), message.get("reason") or "")
            elif kind == "websocket.http.response.start":
                headers = list(message.get("headers", [])) + [(b"connection", b"close")]
                await self.http.send(h11.Response(status_code=message["status"], headers=headers))
            elif kind == "websocket.http.response.body":
                await self.http.send(h11.Data(data=message.get("body", b"")))
                if not message.get("more_body", False):
                    self.close_sent = True
                    await self.http.send(h11.EndOfMessage())
        except (h11.LocalProtocolError, *_NET_ERRORS) as exc:
            raise ClientGoneError(f"the WebSocket is gone: {exc!r}") from exc

    async def close(self, code: int, reason: str) -> None:
        """Send our close frame once (the peer's answer ends the connection)."""
        if self.close_sent or self.ws.state is not ConnectionState.OPEN:
            return
        self.close_sent = True
        if self.close_code is None:
            self.close_code = code
        await self._emit(CloseConnection(code=code, reason=reason or None))

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            app_done = trio.Event()

            async def run_app() -> None:
                try:
                    await self.http.server.app(self.scope, self.receive, self.send)
                except ClientGoneError:
                    pass
                finally:
                    app_done.set()
                    self.settled.set()

            nursery.start_soon(run_app)
            await self.settled.wait()
            if self.accepted:
                nursery.start_soon(self._read)
                keepalive = self.http.server.keepalive
                if keepalive.interval > 0:
                    nursery.start_soon(self._keepalive, keepalive, nursery)
            await app_done.wait()
            if self.accepted:
                try:
                    with trio.move_on_after(CLOSE_TIMEOUT):
                        await self.close(1000, "")
                        await self.peer_closed.wait()
                except (h11.LocalProtocolError, *_NET_ERRORS):
                    pass
            nursery.cancel_scope.cancel()

    async def _read(self) -> None:
        """Frames in: messages to the app (bounded), pings answered, the close handshake."""
        try:
            await self._deliver()
            while self.ws.state is not ConnectionState.CLOSED:
                await self.peer.wake.wait()
                await self._deliver()
                if self.peer.eof:
                    break
        except (h11.LocalProtocolError, *_NET_ERRORS):
            pass  # a pong or close answer to a socket that broke: the connection is over
        finally:
            self.peer_closed.set()
            self.inbox_send.close()

    async def _deliver(self) -> None:
        if self.peer.eof:
            self.ws.receive_data(None)
        for event in self.ws.events():
            if isinstance(event, TextMessage | BytesMessage):
                if isinstance(event, TextMessage):
                    self._text.append(event.data)
                else:
                    self._bytes.append(bytes(event.data))
                self._size += len(event.data)
                if self._size > self.http.server.max_message:
                    self._text, self._bytes, self._size = [], [], 0
                    self.close_code = 1009
                    self.inbox_send.close()  # the app sees the disconnect now; the rest is dropped
                    await self.close(1009, "message too big")
                    continue
                if self.close_code == 1009:
                    continue
                if not event.message_finished:
                    continue
                message: Message = {"type": "websocket.receive"}
                if isinstance(event, TextMessage):
                    message["text"] = self._text[0] if len(self._text) == 1 else "".join(self._text)
                    self._text = []
                else:
                    message["bytes"] = b"".join(self._bytes)
                    self._bytes = []
                self._size = 0
                try:
                    self.inbox_send.send_nowait(message)
                except trio.WouldBlock:
                    self.app_blocked = True
                    try:
                        await self.inbox_send.send(message)
                    finally:
                        self.app_blocked = False
                        self.unblocked_at = trio.current_time()
            elif isinstance(event, Ping):
                if self.ws.state is ConnectionState.OPEN:  # closing: the close answers it
                    await self._emit(event.response())
            elif isinstance(event, Pong):
                pass  # rx_at already says the path is alive
            elif isinstance(event, CloseConnection):
                if self.close_code is None:
                    self.close_code = event.code
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    await self._emit(event.response())
                self.peer_closed.set()
        self.peer.taken()

    async def _keepalive(self, keepalive: Keepalive, nursery: trio.Nursery) -> None:
        """A ping every interval; the connection closed (1011) when nothing came ``timeout``
        after one. A reader waiting for the app counts as alive (the app is slow, not the path)."""
        counters = self.http.server.counters
        next_ping = trio.current_time() + keepalive.interval
        unanswered: float | None = None  # trio clock of the oldest ping nothing came after
        pinging = False

        async def ping() -> None:
            nonlocal pinging
            pinging = True
            try:
                await self._emit(Ping(payload=b"alp"))
                counters.pings_sent += 1
            except (*_NET_ERRORS, h11.LocalProtocolError):
                pass
            finally:
                pinging = False

        while self.ws.state is ConnectionState.OPEN:
            due = (
                next_ping if unanswered is None else min(next_ping, unanswered + keepalive.timeout)
            )
            await trio.sleep_until(due)
            now = trio.current_time()
            heard = max(self.peer.rx_at, self.unblocked_at)
            if unanswered is not None and (heard > unanswered or self.app_blocked):
                unanswered = None
            if unanswered is not None and now >= unanswered + keepalive.timeout:
                await self._dead(keepalive.timeout)
                return
            if now >= next_ping:
                next_ping = now + keepalive.interval
                if not pinging and self.ws.state is ConnectionState.OPEN:
                    if unanswered is None:
                        unanswered = now
                    nursery.start_soon(ping)

    async def _dead(self, silent_for: float) -> None:
        counters = self.http.server.counters
        counters.pong_timeouts += 1
        self.close_code = CLOSE_NO_PONG
        reason = f"no pong within {silent_for:g} s"
        log.warning(
            "WebSocket %s: %s, closing it (pings sent %d, pong timeouts %d)",
            self.scope.get("path"),
            reason,
            counters.pings_sent,
            counters.pong_timeouts,
        )
        if not self.peer.send_lock.locked():
            with trio.move_on_after(CLOSE_TIMEOUT):
                try:
                    await self.close(CLOSE_NO_PONG, reason)
                except (*_NET_ERRORS, h11.LocalProtocolError):
                    pass
        await trio.aclose_forcefully(self.peer.stream)


class Server:
    """Serves one ASGI app on TCP (or TLS) listeners: HTTP/1.1 with keep-alive, and WebSockets
    with the ``keepalive`` pings; ``counters`` count pings sent and pong timeouts."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keepalive: Keepalive,
        counters: HubCounters,
        max_message: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.app = app
        self.keepalive = keepalive
        self.counters = counters
        self.max_message = max_message
        self.ssl_context = ssl_context

    async def serve(
        self, host: str, port: int, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen on ``host:port`` (0: a free port) until cancelled; ``started`` gets the URL."""
        tcp = await trio.open_tcp_listeners(port, host=host)
        bound = tcp[0].socket.getsockname()
        scheme = "https" if self.ssl_context is not None else "http"
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        listeners: list[trio.abc.Listener[Any]] = list(tcp)
        if self.ssl_context is not None:
            listeners = [trio.SSLListener(t, self.ssl_context, https_compatible=True) for t in tcp]
        task_status.started(f"{scheme}://{shown}:{bound[1]}")
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        peer = _Peer(stream)
        tls = isinstance(stream, trio.SSLStream)
        sock = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        scope_base: dict[str, Any] = {
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "scheme": "https" if tls else "http",
            "root_path": "",
            "client": _address(sock, "getpeername"),
            "server": _address(sock, "getsockname"),
            "extensions": {},
        }
        http = _HTTP(self, peer, scope_base)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, peer, http)
                try:
                    await http.serve()
                finally:
                    nursery.cancel_scope.cancel()
        except Exception:
            log.exception("unexpected error serving a connection")
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT) as scope:
                try:
                    await stream.aclose()
                except _NET_ERRORS:
                    pass
            if scope.cancelled_caught:
                await trio.aclose_forcefully(stream)


async def _pump(peer: _Peer, http: _HTTP) -> None:
    """Read the connection into h11 (or, once upgraded, wsproto), pausing while the app lags."""
    try:
        while True:
            while http.ws is None and http.backlog() > MAX_BACKLOG:
                await peer.consumed.wait()
            data = bytes(await peer.stream.receive_some(READ_SIZE))
            if not data:
                return
            peer.rx_at = trio.current_time()
            consumed = peer.consumed
            if http.ws is not None:
                http.ws.ws.receive_data(data)
            else:
                http.conn.receive_data(data)
            peer.woken()
            if http.ws is not None:
                await consumed.wait()  # the WebSocket reader took these frames
    except _NET_ERRORS:
        return
    finally:
        peer.eof = True
        peer.woken()


def _address(stream: trio.abc.Stream, which: str) -> tuple[str, int] | None:
    if not isinstance(stream, trio.SocketStream):
        return None
    try:
        addr = getattr(stream.socket, which)()
    except OSError:
        return None
    return (str(addr[0]), int(addr[1]))


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes:
    for key, value in headers:
        if key == name:
            return bytes(value)
    return b""


__all__ = ["CLOSE_ABNORMAL", "CLOSE_NO_PONG", "Keepalive", "Server"]
