"""The bench's ends of every path, kept lean so that they are never what is measured.

- ``WsSink``: a minimal Chat Channel server (hand-made WebSocket: handshake, unmasking, one
  envelope decode per frame) standing in for the Server. Runners dial it when a job carries its
  ``channelUrl``.
- ``FloorSink``: takes the floor's session sockets and counts the SSE events in the raw bytes.
- ``SSEClient``: an HTTP/1.1 client over raw trio sockets (kept-alive) that reads an SSE stream
  and counts its events (the direct, end-to-end and LiteLLM paths).

Every read is stamped with ``time.perf_counter()`` the moment it returns, before any parsing.
A stream in latency mode also keeps ``(key, token index, received at)`` for each content token,
to be matched with the simulator's ``sent_at`` (same clock: CLOCK_MONOTONIC, across processes).
"""

from __future__ import annotations

import base64
import hashlib
import re
import ssl
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import trio

clock = time.perf_counter
_TOK = re.compile(rb'"content":"tok(\d+)')
_SIM_EVENT = re.compile(rb'chatcmpl-sim-(\d+)"[^\n]*?"content":"tok(\d+)')
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_RECV = 262144


@dataclass
class Stream:
    """What one stream delivered: events (data payloads but [DONE]), when, and token stamps."""

    tag: str
    latency: bool = False
    sent: float = 0.0  # when the request left the bench
    events: int = 0
    first_at: float | None = None
    last_at: float = 0.0
    tokens: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None
    done: trio.Event = field(default_factory=trio.Event)


# -- the lean WebSocket sink ----------------------------------------------------------------


class _Envelope(msgspec.Struct):
    type: str = ""
    requestId: str | None = None
    error: Any = None


_envelope = msgspec.json.Decoder(_Envelope).decode


def _unmask(data: bytes, key: bytes) -> bytes:
    n = len(data)
    mask = (key * ((n >> 2) + 1))[:n]
    return (int.from_bytes(data, "big") ^ int.from_bytes(mask, "big")).to_bytes(n, "big")


def _server_frame(text: bytes) -> bytes:
    n = len(text)
    if n < 126:
        return bytes((0x81, n)) + text
    if n < 65536:
        return bytes((0x81, 126)) + n.to_bytes(2, "big") + text
    return bytes((0x81, 127)) + n.to_bytes(8, "big") + text


class _Conn:
    """An accepted connection, plain (a trio socket) or TLS (a ``trio.SSLStream`` over it)."""

    def __init__(self, sock: trio.socket.SocketType, tls: trio.SSLStream[Any] | None) -> None:
        self.sock = sock
        self.tls = tls
        if tls is None:
            self.recv = sock.recv
        else:
            self.recv = tls.receive_some

    async def send_all(self, data: bytes) -> None:
        if self.tls is None:
            await _send_all(self.sock, data)
        else:
            await self.tls.send_all(data)

    def close(self) -> None:
        self.sock.close()


class SinkChannel:
    """One Chat Channel accepted by the sink: the runner's job, its turns in flight."""

    def __init__(self, job_id: str, conn: _Conn) -> None:
        self.job_id = job_id
        self.conn = conn
        self.turns: dict[str, Stream] = {}
        self.frames = 0
        self.closed = trio.Event()
        self._lock = trio.StrictFIFOLock()

    async def send_text(self, text: bytes) -> None:
        async with self._lock:
            await self.conn.send_all(_server_frame(text))

    async def turn(self, body: dict[str, Any], stream: Stream) -> Stream:
        """Send one ``chat.completion.request`` and wait for its done (or error) frame."""
        rid = uuid.uuid4().hex
        self.turns[rid] = stream
        frame = {
            "type": "chat.completion.request",
            "jobId": self.job_id,
            "requestId": rid,
            "body": body,
        }
        data = _server_frame(msgspec.json.encode(frame))
        async with self._lock:
            # stamped once the lock is held: taking it is a checkpoint (a pass of the bench's own
            # scheduler), which would otherwise count in this path's TTFT and in no other's
            stream.sent = clock()
            await self.conn.send_all(data)
        await stream.done.wait()
        del self.turns[rid]
        return stream

    def _frame(self, payload: bytes, at: float) -> None:
        self.frames += 1
        env = _envelope(payload)
        stream = self.turns.get(env.requestId) if env.requestId else None
        if stream is None:
            return
        if env.type == "chat.completion.chunk":
            stream.events += 1
            stream.last_at = at
            if stream.first_at is None:
                stream.first_at = at
            if stream.latency:
                found = _TOK.search(payload)
                if found:
                    stream.tokens.append((int(found.group(1)), at))
        elif env.type in ("chat.completion.done", "chat.completion.error"):
            if env.type == "chat.completion.error":
                stream.error = str(env.error)
            stream.done.set()

    async def read(self, buf: bytes) -> None:
        conn = self.conn
        try:
            while True:
                pos = 0
                end = len(buf)
                at = clock()
                while end - pos >= 2:
                    b0, b1 = buf[pos], buf[pos + 1]
                    size = b1 & 0x7F
                    off = pos + 2
                    if size == 126:
                        if end - off < 2:
                            break
                        size = int.from_bytes(buf[off : off + 2], "big")
                        off += 2
                    elif size == 127:
                        if end - off < 8:
                            break
                        size = int.from_bytes(buf[off : off + 8], "big")
                        off += 8
                    masked = b1 & 0x80
                    if end - off < size + (4 if masked else 0):
                        break
                    if masked:
                        key = buf[off : off + 4]
                        off += 4
                        payload = _unmask(buf[off : off + size], key)
                    else:
                        payload = buf[off : off + size]
                    pos = off + size
                    opcode = b0 & 0x0F
                    if opcode == 1 or opcode == 2:
                        self._frame(payload, at)
                    elif opcode == 8:  # close: answer it and stop
                        with _suppress():
                            async with self._lock:
                                await conn.send_all(b"\x88\x02\x03\xe8")
                        return
                    elif opcode == 9:  # ping
                        async with self._lock:
                            await conn.send_all(bytes((0x8A, len(payload))) + payload)
                buf = buf[pos:]
                data = await conn.recv(_RECV)
                if not data:
                    return
                buf = buf + data if buf else data
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            self.closed.set()
            conn.close()
            for stream in self.turns.values():
                stream.error = stream.error or "channel closed"
                stream.done.set()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)  # type: ignore[arg-type]


class WsSink:
    """Accepts Chat Channels (any path; the job id from the query) and keeps them by job id.

    With an ``ssl_context`` it is a ``wss://`` sink (TLS by ``trio.SSLStream``, in the bench
    process: the relay's side of TLS is what the relaying process pays).
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self.channels: dict[str, SinkChannel] = {}
        self.port = 0
        self.ssl_context = ssl_context
        self._changed = trio.Event()

    @property
    def url(self) -> str:
        scheme = "wss" if self.ssl_context else "ws"
        return f"{scheme}://127.0.0.1:{self.port}/sink"

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket()
        listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await listener.bind(("127.0.0.1", 0))
        listener.listen(4096)
        self.port = listener.getsockname()[1]
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                sock, _ = await listener.accept()
                _nodelay(sock)
                nursery.start_soon(self._handshake, sock)

    async def _handshake(self, sock: trio.socket.SocketType) -> None:
        tls = None
        if self.ssl_context is not None:
            tls = trio.SSLStream(trio.SocketStream(sock), self.ssl_context, server_side=True)
        conn = _Conn(sock, tls)
        buf = b""
        while b"\r\n\r\n" not in buf:
            try:
                data = await conn.recv(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                sock.close()
                return
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        target = lines[0].split()[1].decode()
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        accept = base64.b64encode(hashlib.sha1(headers[b"sec-websocket-key"] + _GUID).digest())
        await conn.send_all(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n",
        )
        job_id = parse_qs(urlsplit(target).query)["jobId"][0]
        channel = SinkChannel(job_id, conn)
        self.channels[job_id] = channel
        self._changed.set()
        self._changed = trio.Event()
        await channel.read(rest)
        if self.channels.get(job_id) is channel:
            del self.channels[job_id]

    async def wait_channels(self, job_ids: list[str], within: float) -> list[SinkChannel]:
        with trio.fail_after(within):
            while not all(j in self.channels for j in job_ids):
                await self._changed.wait()
        return [self.channels[j] for j in job_ids]


# -- the floor's sink ----------------------------------------------------------------------


class FloorSession:
    """One session socket of the floor: requests go out on it, raw SSE bytes come back."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.events = 0
        self.dones = 0
        self.bytes = 0
        self.first_at: float | None = None
        self.last_at = 0.0
        self.latency = False
        self.tokens: list[tuple[int, int, float]] = []  # (sim id, token index, at)
        self._carry = b""
        self._changed = trio.Event()

    def reset(self, latency: bool) -> None:
        self.events = self.dones = 0
        self.first_at = None
        self.latency = latency
        self.tokens = []

    async def request(self, body: bytes) -> None:
        await _send_all(self.sock, b"%d\n" % len(body) + body)

    async def read(self) -> None:
        while True:
            data = await self.sock.recv(_RECV)
            at = clock()
            if not data:
                return
            self.bytes += len(data)
            region = self._carry + data if self._carry else data
            cut = region.rfind(b"\n\n")
            if cut < 0:
                self._carry = region
                continue
            complete, self._carry = region[: cut + 2], region[cut + 2 :]
            dones = complete.count(b"data: [DONE]")
            events = complete.count(b"data: ") - dones
            if events:
                self.events += events
                self.last_at = at
                if self.first_at is None:
                    self.first_at = at
                if self.latency:
                    for found in _SIM_EVENT.finditer(complete):
                        self.tokens.append((int(found.group(1)), int(found.group(2)), at))
            if dones:
                self.dones += dones
                self._changed.set()
                self._changed = trio.Event()

    async def wait_dones(self, n: int) -> None:
        while self.dones < n:
            await self._changed.wait()


class FloorSink:
    def __init__(self) -> None:
        self.sessions: list[FloorSession] = []
        self.port = 0
        self._changed = trio.Event()

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                sock, _ = await listener.accept()
                _nodelay(sock)
                session = FloorSession(sock)
                self.sessions.append(session)
                self._changed.set()
                self._changed = trio.Event()
                nursery.start_soon(session.read)

    async def wait_sessions(self, n: int, within: float = 10) -> None:
        with trio.fail_after(within):
            while len(self.sessions) < n:
                await self._changed.wait()


# -- the SSE client --------------------------------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    """How an SSE client reads one API's stream: what counts as a chunk, where a token's index
    is, what ends the stream and what is an error.

    ``counted``: the markers whose occurrences count as chunks (``data: `` for chat completions,
    ``[DONE]`` excepted). ``token``: finds each content token's index (the simulator's
    ``tok<i>``) in a token's event. ``ends``: a marker that ends the answer; ``errors``: one
    that ends it with an error (its event is kept as ``Stream.error``)."""

    name: str
    path: str
    counted: tuple[bytes, ...]
    token: re.Pattern[bytes]
    ends: tuple[bytes, ...]
    errors: tuple[bytes, ...] = ()


# Chat completions: every ``data:`` event is a chunk, the runner's bytes verbatim.
CHAT = Dialect("chat", "/v1/chat/completions", (b"data: ",), _TOK, (b"data: [DONE]",))
# Anthropic Messages, as gateway/apis/messages/stream.py writes it: each token one
# ``content_block_delta`` whose delta is ``{"type":"text_delta","text":"tok0 "}``. Counted as
# chunks: each token's event, and ``message_start`` (the role chunk's) and ``message_stop``
# (the finish chunk's, and the end's), so a stream of N tokens counts N + 2, as the same
# stream does over chat completions (role chunk, N tokens, finish chunk). The hub also gets a
# usage chunk on this path (it asks for ``include_usage``): its cost is the translation's.
MESSAGES = Dialect(
    "messages",
    "/v1/messages",
    (b'"delta":{"type":"text_delta"', b"event: message_start\n", b"event: message_stop\n"),
    re.compile(rb'"delta":\{"type":"text_delta","text":"tok(\d+)'),
    (b"event: message_stop\n", b"event: error\n"),
    (b"event: error\n",),
)
# The Responses API, as gateway/apis/responses/stream.py writes it: each token one
# ``response.output_text.delta`` event with ``"delta":"tok0 "``. Counted as chunks: each token's
# event, ``response.created`` (the role chunk's) and the final event (``response.completed``,
# or ``.incomplete`` / ``.failed``): N + 2, as for ``MESSAGES``.
RESPONSES = Dialect(
    "responses",
    "/v1/responses",
    (
        b"event: response.output_text.delta\n",
        b"event: response.created\n",
        b"event: response.completed\n",
        b"event: response.incomplete\n",
        b"event: response.failed\n",
    ),
    re.compile(rb'"type":"response\.output_text\.delta"[^\n]*?"delta":"tok(\d+)'),
    (
        b"event: response.completed\n",
        b"event: response.incomplete\n",
        b"event: response.failed\n",
    ),
    (b"event: response.failed\n", b"event: response.incomplete\n"),
)


class SSEClient:
    """POSTs request bodies to ``host:port`` and reads the SSE answers (kept-alive), in one
    API's ``Dialect`` (chat completions unless told)."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str | None = None,
        headers: dict[str, str] | None = None,
        dialect: Dialect = CHAT,
    ) -> None:
        self.host = host
        self.port = port
        self.dialect = dialect
        self.path = path or dialect.path
        self.headers = headers or {}
        self.idle: list[trio.socket.SocketType] = []

    async def _connect(self) -> trio.socket.SocketType:
        if self.idle:
            return self.idle.pop()
        return await self._new()

    async def _new(self) -> trio.socket.SocketType:
        sock = _socket()
        await sock.connect((self.host, self.port))
        return sock

    async def stream(self, body: bytes, stream: Stream, session: str | None = None) -> Stream:
        headers = {**self.headers}
        if session is not None:
            headers["x-chat-session"] = session
        head = (
            f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            "content-type: application/json\r\naccept: text/event-stream\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            + f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            stream.sent = clock()
            for fresh in (False, True):
                # a kept-alive connection the server closed while idle (uvicorn, LiteLLM's
                # server, closes them after 5 s) is found closed before the response head:
                # the request is sent again once, on a new connection
                reused = bool(self.idle) and not fresh
                sock = await self._connect() if not fresh else await self._new()
                reusable = False
                try:
                    await _send_all(sock, head + body)
                    reusable = await self._read(sock, stream)
                except OSError:
                    stream.error = "closed before the response head"
                finally:
                    if reusable:
                        self.idle.append(sock)
                    else:
                        sock.close()
                if not (reused and stream.error == "closed before the response head"):
                    break
                stream.error = None
        finally:
            stream.done.set()
        return stream

    async def _read(self, sock: trio.socket.SocketType, stream: Stream) -> bool:
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = await sock.recv(_RECV)
            if not data:
                stream.error = "closed before the response head"
                return False
            buf += data
        at = clock()
        head, _, region = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        chunked = b"transfer-encoding: chunked" in lower
        close = b"connection: close" in lower
        if status != 200:
            stream.error = f"HTTP {status}: {region[:300]!r}"
            return False
        dialect = self.dialect
        chat = dialect is CHAT
        carry = b""
        tail = b""
        finished = False
        while True:
            if region:
                tail = (tail + region[-7:])[-7:]
                if not finished:
                    if carry:
                        region = carry + region
                    cut = region.rfind(b"\n\n")
                    if cut < 0:
                        carry = region
                    else:
                        complete, carry = region[: cut + 2], region[cut + 2 :]
                        if chat:
                            finished = b"data: [DONE]" in complete
                            events = complete.count(b"data: ") - finished
                        else:
                            finished = any(m in complete for m in dialect.ends)
                            events = sum(complete.count(m) for m in dialect.counted)
                            for marker in dialect.errors:
                                at_error = complete.find(marker)
                                if at_error >= 0:
                                    stream.error = repr(complete[at_error : at_error + 300])
                        if events:
                            stream.events += events
                            stream.last_at = at
                            if stream.first_at is None:
                                stream.first_at = at
                            if stream.latency:
                                stream.tokens.extend(
                                    (int(t), at) for t in dialect.token.findall(complete)
                                )
                if finished and (not chunked or tail == b"\r\n0\r\n\r\n"):
                    return chunked and not close
            region = await sock.recv(_RECV)
            at = clock()
            if not region:
                if not finished:
                    stream.error = "closed mid-stream"
                return False


def _socket() -> trio.socket.SocketType:
    """A TCP socket that sends each write at once (no Nagle delay), as trio's own streams do."""
    sock = trio.socket.socket()
    _nodelay(sock)
    return sock


def _nodelay(sock: trio.socket.SocketType) -> None:
    sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]
