"""The backend hop's HTTP/1.1 client: requests over ``netio`` sockets, httptools parsing, keep-alive.

Every request to a backend goes through here: the per-turn chat-completions request (the hot
path), and its health checks, model listing and doctor's requests, on the same connections
and the same proxy and TLS rules. One ``Client`` per backend origin keeps a bounded stack of
idle connections. Here: connecting, pooling, sending, and reading a response's head (and a
short body whole); the parsing does no I/O (``gateway.wire.stream``), and a turn's streamed
body is read by the relay itself, read by read, so no layer sits between a socket read and
the SSE splitter.

The proxy is the one ``gateway.wire.proxy`` finds in the environment (``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``): an ``http://`` origin through a proxy is asked
in absolute form, an ``https://`` one through a ``CONNECT`` tunnel with TLS inside it.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import trio

from gateway import __version__
from gateway.wire.netio import Transport, connect, start_tls
from gateway.wire.proxy import Proxy, proxy_for
from gateway.wire.stream import ConnectionLost as ConnectionLost  # the errors, one hierarchy
from gateway.wire.stream import ExchangeFailed as ExchangeFailed
from gateway.wire.stream import ProtocolError as ProtocolError
from gateway.wire.stream import ResponseParser, lost

USER_AGENT = f"alp-gateway/{__version__}".encode()
_DEFAULT_PORTS = {"http": 80, "https": 443}
_IDLE_STEPS = 16  # the idle deadline moves once 1/16 of the timeout has passed, not per read


class ConnectFailed(ExchangeFailed):
    """No connection could be made (refused, unreachable, name, TLS, proxy): nothing was sent."""


# -- one response ------------------------------------------------------------------------


class ClientResponse:
    """One connection and the response being read on it: the socket here, the parsing in
    ``parser`` (``gateway.wire.stream.ResponseParser``, which does no I/O).

    ``read_head``/``read_body`` read it here; a reader of its own (the runner's relay, read by
    read) calls ``recv`` (what has arrived, ``b""`` at the end, ``BlockingIOError`` when
    nothing has), waits on ``fileno()`` and feeds the parser through an ``EventStream``.
    ``idle`` (set by the exchange's owner) is its idle deadline: ``keep_idle`` moves it.
    """

    __slots__ = ("transport", "parser", "recv", "idle", "idle_timeout")

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.parser = ResponseParser()
        # for a plain socket, the socket's own method: no Python layer on a relay's reads
        self.recv = transport.recv
        # the idle deadline of the exchange (set by its owner): moved forward as bytes arrive
        self.idle: trio.CancelScope | None = None
        self.idle_timeout = 0.0

    @property
    def status(self) -> int:
        return self.parser.status

    @property
    def complete(self) -> bool:
        return self.parser.complete

    def header(self, name: bytes) -> bytes | None:
        return self.parser.header(name)

    def fileno(self) -> int:
        return self.transport.sock.fileno()

    def keep_idle(self, now: float) -> float:
        """Bytes arrived at ``now``: the idle deadline moves to ``now`` + the idle timeout.
        Returns when it is next worth moving (a sixteenth of the timeout later), so a reader
        moves it now and then, not per read."""
        if self.idle is not None:
            self.idle.deadline = now + self.idle_timeout
        return now + self.idle_timeout / _IDLE_STEPS

    def fresh_until(self) -> float:
        """Until when the idle deadline needs no moving: a sixteenth of the timeout after it
        was last set (the exchange's start, at first), as ``keep_idle`` would have it."""
        idle = self.idle
        if idle is None:
            return 0.0
        timeout = self.idle_timeout
        return idle.deadline - timeout + timeout / _IDLE_STEPS

    def read_nowait(self) -> bool:
        """Parse what has arrived; False when nothing has.

        ``ConnectionLost`` when the connection ends before the message does."""
        try:
            data = self.transport.recv_nowait()
        except (OSError, ssl.SSLError) as exc:
            raise lost(exc) from None
        if data is None:
            return False
        self.parser.feed(data)
        return True

    async def read_more(self) -> None:
        """Wait for and parse the next bytes."""
        while not self.read_nowait():
            await self.transport.wait_readable()

    async def read_head(self) -> None:
        while not self.parser.head_done:
            await self.read_more()

    async def read_body(self, limit: int | None = None) -> bytes:
        """The rest of the body, or its first ``limit`` bytes and a bit (then the rest is left)."""
        parser = self.parser
        size = sum(map(len, parser.body))
        while not parser.complete and (limit is None or size <= limit):
            before = len(parser.body)
            await self.read_more()
            size += sum(map(len, parser.body[before:]))
        return parser.take_body()

    async def discard_rest(self) -> None:
        """Read the rest of the message and drop it, so the connection can be kept."""
        parser = self.parser
        parser.body.clear()
        while not parser.complete:
            await self.read_more()
            parser.body.clear()

    @property
    def reusable(self) -> bool:
        return self.parser.keep_alive and not self.transport.unsent

    def close(self) -> None:
        self.transport.close()


def _os_text(exc: BaseException) -> str:
    """A connect failure in a few words: the error's name and, when it has one, its reason."""
    reason = getattr(exc, "strerror", None) or str(exc)
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__


# -- one origin ----------------------------------------------------------------------------


class Client:
    """Requests to one origin over kept-alive connections, through the environment's proxy.

    Idle connections form a bounded stack (newest on top; ``max_idle`` at most, the oldest
    closed beyond that; one older than ``keepalive_expiry`` or closed by the peer is dropped
    when it comes up): O(1) per request whatever the number open.
    """

    def __init__(
        self,
        url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
        max_idle: int = 8,
        keepalive_expiry: float = 5.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or _DEFAULT_PORTS[parts.scheme]
        self.base_path = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.keepalive_expiry = keepalive_expiry
        self.ssl_context: ssl.SSLContext | None = None
        if self.scheme == "https":
            self.ssl_context = ssl_context or ssl.create_default_context()
        self.proxy = proxy_for(self.scheme, self.host, self.port, env)
        host = f"[{self.host}]" if ":" in self.host else self.host
        authority = host if parts.port is None else f"{host}:{self.port}"
        self._authority = authority.encode("ascii" if authority.isascii() else "idna")
        self._absolute = self.proxy is not None and self.scheme == "http"
        self._idle: deque[tuple[float, Transport]] = deque()

    def target(self, path: str, *, under_base: bool = True) -> bytes:
        """The request target for ``path`` under the base URL (``under_base=False``: under the
        origin), in absolute form to a proxy."""
        target = ((self.base_path if under_base else "") + path).encode()
        if self._absolute:
            return b"http://" + self._authority + target
        return target

    def prepare(
        self, method: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]]
    ) -> bytes:
        """The head of a request up to its ``content-length`` value, for ``send``: a request
        made on every turn has it built once."""
        lines = [method, b" ", target, b" HTTP/1.1\r\nhost: ", self._authority]
        for name, value in headers:
            lines += (b"\r\n", name, b": ", value)
        if self._absolute and self.proxy is not None and self.proxy.authorization:
            lines += (b"\r\nproxy-authorization: ", self.proxy.authorization)
        lines += (b"\r\nuser-agent: ", USER_AGENT, b"\r\ncontent-length: ")
        return b"".join(lines)

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> ClientResponse:
        """Send one request (the body as it is) and read the head of its response.

        ``ConnectFailed`` when no connection could be made (nothing was sent); ``ExchangeFailed``
        otherwise. A kept-alive connection that turns out closed is replaced once."""
        return await self.send(self.prepare(method, target, headers), body)

    async def send(self, head: bytes, body: bytes) -> ClientResponse:
        """``request`` with its head from ``prepare``."""
        message = b"%b%d\r\n\r\n%b" % (head, len(body), body)
        while True:
            transport = self._take_idle()
            reused = transport is not None
            if transport is None:
                transport = await self._connect()
            response = ClientResponse(transport)
            try:
                try:
                    if not transport.write(message):
                        await transport.flush()
                    await response.read_head()
                except (OSError, ssl.SSLError) as exc:
                    raise lost(exc) from None
            except ConnectionLost as exc:
                transport.close()
                if reused and not response.parser.started:
                    continue  # the peer had closed it while idle: a fresh connection
                raise ConnectionLost(str(exc) or "closed the connection before answering") from None
            except BaseException:
                transport.close()
                raise
            return response

    def release(self, response: ClientResponse) -> None:
        """Keep the connection for the next request when it can be, else close it."""
        if not response.reusable:
            response.close()
            return
        idle = self._idle
        if len(idle) >= self.max_idle:
            idle.popleft()[1].close()
        idle.append((trio.current_time(), response.transport))

    def _take_idle(self) -> Transport | None:
        idle = self._idle
        now = trio.current_time()
        while idle:
            since, transport = idle.pop()
            if now - since < self.keepalive_expiry and transport.alive_when_idle():
                return transport
            transport.close()
        return None

    async def _connect(self) -> Transport:
        proxy = self.proxy
        host, port = (proxy.host, proxy.port) if proxy is not None else (self.host, self.port)
        where = f"proxy {host}:{port}" if proxy is not None else ""
        try:
            with trio.fail_after(self.connect_timeout):
                transport = await connect(host, port)
                try:
                    if proxy is not None and self.scheme == "https":
                        await self._tunnel(transport, proxy)
                    if self.ssl_context is not None:
                        transport = await start_tls(transport, self.ssl_context, self.host)
                except BaseException:
                    transport.close()
                    raise
        except trio.TooSlowError:
            raise ConnectFailed(f"connect timeout{' via ' + where if where else ''}") from None
        except ssl.SSLCertVerificationError as exc:
            raise ConnectFailed(f"certificate refused ({exc.verify_message})") from None
        except (OSError, ssl.SSLError, ConnectionLost) as exc:
            text = str(exc) if isinstance(exc, ExchangeFailed) else _os_text(exc)
            raise ConnectFailed(f"{text}{' via ' + where if where else ''}") from None
        return transport

    async def _tunnel(self, transport: Transport, proxy: Proxy) -> None:
        authority = f"{self.host}:{self.port}".encode()
        head = b"CONNECT %b HTTP/1.1\r\nhost: %b\r\n" % (authority, authority)
        if proxy.authorization:
            head += b"proxy-authorization: " + proxy.authorization + b"\r\n"
        await transport.send_all(head + b"\r\n")
        response = ClientResponse(transport)
        await response.read_head()
        if response.status != 200:
            raise ConnectFailed(
                f"proxy {proxy.host}:{proxy.port} refused the tunnel ({response.status})"
            )
        if response.parser.body:  # the tunnel carries nothing before our TLS hello
            raise ConnectFailed(f"proxy {proxy.host}:{proxy.port} sent bytes into the tunnel")

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()
