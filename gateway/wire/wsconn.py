"""One WebSocket connection's state for either end, sans-IO (wsproto's ``Connection`` is the model).

No socket and no clock here: the caller feeds what it read (``receive``, with the time "now"),
writes what the connection owes the peer (``data_to_send``) when its socket has room, and asks
the keepalive clock when to wake (``next_tick``) and what is due then (``tick``). The client
(``gateway.wire.wsclient``) and the server (``gateway.wire.wsserver``) each keep only their I/O.

What it decides, for both ends alike:

- the opening handshake (RFC 6455 §4): the client's request headers and the check of the
  server's 101 answer; the server's check of an upgrade request and its 101 headers;
- the close state (§7): ``OPEN``, then ``CLOSING`` once we sent our close frame, ``CLOSED`` once
  the peer's close came (answered with its code), or once we failed the connection (a frame that
  breaks RFC 6455: the reader's close code; a peer that lets our pongs pile up: 1008);
- ping and pong (§5.5.2): a ping is answered; at most one pong waits to be written, and a newer
  ping's pong replaces an unsent older one (the RFC allows answering only the latest); a peer that
  keeps pinging while our answer waits for it to read is failed with 1008 (policy violation);
- the keepalive clock: a ping every ``interval`` s, the peer dead when nothing at all came
  ``timeout`` s after one;
- the bounds of a message, in bytes and in fragments (``gateway.wire.wsframes.FrameReader``).

Data frames are not built here: each end writes its text frames itself, at once (the hot path
takes no call through this object); it reads ``state`` first.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.wire.wsframes import (
    MAX_FRAGMENTS,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    ClientFramer,
    FrameReader,
    close_code_of,
    close_payload,
    close_reason_of,
    server_frame,
)

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3
CLOSE_ABNORMAL = 1006  # the TCP connection ended without a close frame (§7.1.5); never sent
CLOSE_POLICY = 1008  # a peer that keeps pinging while our pongs wait for it to read
CLOSE_NO_PONG = 1011  # the keepalive's timeout passed with nothing heard
PINGS_WHILE_PONG_WAITS = 16  # pings answered while our pong from an earlier read is unwritten
PING_PAYLOAD = b"alp"


class WsState(enum.Enum):
    """Where a connection is in its life (RFC 6455 §7)."""

    OPEN = "open"  # messages go both ways
    CLOSING = "closing"  # we sent our close frame; the peer's answer is awaited
    CLOSED = "closed"  # the peer's close came, or we failed the connection: nothing more is read


class Tick(enum.Enum):
    """What the keepalive clock found due (``WebSocketConnection.tick``)."""

    PING = "ping"  # a ping waits in ``data_to_send``
    DEAD = "dead"  # nothing came ``timeout`` s after a ping: the path is dead


@dataclass(frozen=True, slots=True)
class Keepalive:
    """A ping once the peer has been silent for ``interval`` × ``patience`` s (0: none): its
    messages, its pings and its pongs all count, so a busy connection sends none and two ends
    that both ping take turns, one ping a round between them; the peer is dead when nothing at
    all arrives ``timeout`` s after one. An end with ``patience`` over 1 (the hub's channels)
    leaves the pinging to a peer that pings every ``interval`` (the runner, which dialled
    through the NAT that the pings keep): it is then never the one that pings."""

    interval: float = 20.0
    timeout: float = 20.0
    patience: float = 1.0

    @property
    def quiet(self) -> float:
        """The silence after which this end pings."""
        return self.interval * self.patience


# -- the opening handshake (RFC 6455 §4) -------------------------------------------------------


def new_key(entropy: Callable[[int], bytes] = os.urandom) -> bytes:
    """A client's ``Sec-WebSocket-Key``: 16 random bytes, base64."""
    return base64.b64encode(entropy(16))


def accept_value(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` that answers ``key`` (§4.2.2)."""
    return base64.b64encode(hashlib.sha1(key.strip() + GUID).digest())


def request_headers(host: str, key: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of a client's upgrade request (§4.1), for an HTTP/1.1 ``GET``."""
    return [
        (b"Host", host.encode()),
        (b"Upgrade", b"websocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Key", key),
        (b"Sec-WebSocket-Version", b"13"),
    ]


def _tokens(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> set[bytes]:
    """The comma-separated tokens of every ``name`` header, lower case."""
    return {
        token.strip().lower()
        for key, value in headers
        if key.lower() == name
        for token in value.split(b",")
    }


def answer_problem(headers: Iterable[tuple[bytes, bytes]], key: bytes) -> str | None:
    """What is wrong with a server's 101 answer to our upgrade with ``key`` (§4.1, points 1-6),
    or None."""
    headers = list(headers)
    accept = b""
    for name, value in headers:
        name = name.lower()
        if name == b"sec-websocket-accept":
            accept = value
        elif name in (b"sec-websocket-extensions", b"sec-websocket-protocol"):
            return f"{name.decode()} that was not asked for"
    if b"websocket" not in _tokens(headers, b"upgrade"):
        return "no Upgrade: websocket"
    if b"upgrade" not in _tokens(headers, b"connection"):
        return "no Connection: Upgrade"
    if accept.strip() != accept_value(key):
        return "a Sec-WebSocket-Accept that does not match the key"
    return None


def upgrade_key(method: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The ``Sec-WebSocket-Key`` of a valid upgrade request (§4.2.1: ``GET``, a key, version
    13), or None when it is not one."""
    key = version = None
    for name, value in headers:
        if name == b"sec-websocket-key":
            key = value.strip()
        elif name == b"sec-websocket-version":
            version = value.strip()
    if method != b"GET" or not key or version != b"13":
        return None
    return key


def accept_headers(key: bytes) -> list[tuple[bytes, bytes]]:
    """The headers of the server's 101 answer to an upgrade with ``key`` (§4.2.2)."""
    return [
        (b"Upgrade", b"websocket"),
        (b"Connection", b"Upgrade"),
        (b"Sec-WebSocket-Accept", accept_value(key)),
    ]


# -- an open connection --------------------------------------------------------------------------


class WebSocketConnection:
    """One open WebSocket's state: the close handshake, ping and pong, the keepalive clock and
    the message bounds. ``client``: our end is the client (our control frames masked, the
    peer's frames unmasked). Nothing here waits or reads a clock: the caller passes ``now``."""

    __slots__ = (
        "client",
        "state",
        "close_code",
        "close_reason",
        "failure",
        "pending",
        "heard_at",
        "reader",
        "keepalive",
        "_control",
        "_feed",
        "_pong",
        "_ping",
        "_close",
        "_pings_unanswered",
        "_ping_at",
        "_awaiting",
    )

    def __init__(
        self,
        *,
        client: bool,
        max_message: int,
        max_fragments: int = MAX_FRAGMENTS,
        keepalive: Keepalive | None = None,
        now: float = 0.0,
        entropy: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.client = client
        self.state = WsState.OPEN
        # the close code and reason of whoever closed first (the peer's, or ours when we
        # started the close or failed the connection); None while open
        self.close_code: int | None = None
        self.close_reason = ""
        self.failure: tuple[int, str] | None = None  # we failed it: the code and why
        self.pending = False  # control frames wait in ``data_to_send``
        self.heard_at = now  # the last time anything came from the peer
        self.reader = FrameReader(max_message, masked=not client, max_fragments=max_fragments)
        self._feed = self.reader.feed
        self._control: Callable[[int, bytes], bytes] = (
            ClientFramer(entropy).control if client else server_frame
        )
        self._pong: bytes | None = None  # the payload of the latest ping not answered yet
        self._ping: bytes | None = None
        self._close: bytes | None = None  # our close frame, not written yet
        self._pings_unanswered = 0  # pings that came while a pong from an earlier read waited
        self.keepalive = keepalive if keepalive is not None and keepalive.interval > 0 else None
        self._ping_at = now + self.keepalive.quiet if self.keepalive is not None else math.inf
        self._awaiting: float | None = None  # when the ping with nothing heard after it went

    # -- reading ---------------------------------------------------------------------------

    def receive(self, data: bytes, now: float) -> list[tuple[int, bytes]]:
        """The data messages (``(opcode, payload)``: text or binary, whole) that ``data``
        completes, in order; the control frames among them are dealt with here (a ping's pong
        owed, the peer's close answered). Nothing is read once ``CLOSED``."""
        self.heard_at = now
        if self.state is WsState.CLOSED:
            return []
        reader = self.reader
        seen = reader.controls
        frames = self._feed(data)
        if reader.controls == seen and reader.violation is None:
            return frames  # data frames only: the hot path
        messages: list[tuple[int, bytes]] = []
        carried = self._pong is not None  # a pong from an earlier read still waits: not read
        for op, payload in frames:
            if op == OP_PING:
                if self.state is WsState.OPEN:  # closing: our close frame answers it
                    if carried:
                        self._pings_unanswered += 1
                        if self._pings_unanswered >= PINGS_WHILE_PONG_WAITS:
                            self.fail(
                                CLOSE_POLICY,
                                f"{self._pings_unanswered} pings while our answer waited "
                                "for it to read",
                            )
                            return messages
                    self._pong = payload
                    self.pending = True
            elif op == OP_CLOSE:
                self._closed_by_peer(payload)
                return messages  # nothing after a close frame is read (§5.5.1)
            elif op != OP_PONG:
                messages.append((op, payload))
        if reader.violation is not None:
            self.fail(*reader.violation)
        return messages

    def unread(self) -> None:
        """The server's reader waits for a slow consumer of the peer's messages: the peer counts
        as having answered (the path is not the slow part), and pings go on at the interval
        (the peer, unread meanwhile, still hears from us)."""
        self._awaiting = None

    def heard(self, now: float) -> None:
        """Count the peer as heard from at ``now`` without a read (the server: its reader
        waits for a slow consumer of the peer's messages, so the path is not the slow part)."""
        self.heard_at = now

    def _closed_by_peer(self, payload: bytes) -> None:
        if self.close_code is None:
            self.close_code = close_code_of(payload)
            self.close_reason = close_reason_of(payload)
        if self.state is WsState.OPEN:  # answered with its code (§5.5.1)
            self._close = self._control(OP_CLOSE, payload[:2])
            self.pending = True
        self.state = WsState.CLOSED

    # -- closing ---------------------------------------------------------------------------

    def close(self, code: int, reason: str = "") -> None:
        """Start the closing handshake: our close frame is owed, the peer's answer awaited.
        Nothing once closing or closed."""
        if self.state is not WsState.OPEN:
            return
        self.state = WsState.CLOSING
        self.close_code, self.close_reason = code, reason
        self._close = self._control(OP_CLOSE, close_payload(code, reason))
        self.pending = True

    def fail(self, code: int, reason: str) -> None:
        """Fail the connection (RFC 6455 §7.1.7): our close frame with ``code`` is owed unless
        one went already, nothing more is read; ``failure`` says why."""
        if self.state is WsState.CLOSED:
            return
        if self.state is WsState.OPEN:
            self._close = self._control(OP_CLOSE, close_payload(code, reason))
            self.pending = True
        self.state = WsState.CLOSED
        self.close_code, self.close_reason = code, reason
        self.failure = (code, reason)

    # -- writing ---------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """The control frames owed, in order (a pong, a ping, our close frame last), taken: the
        caller writes them now. Call it when the socket has room, so that what waits here
        stays bounded (one of each)."""
        out = b""
        if self._pong is not None:
            out = self._control(OP_PONG, self._pong)
            self._pong = None
            self._pings_unanswered = 0
        if self._ping is not None:
            out += self._control(OP_PING, self._ping)
            self._ping = None
        if self._close is not None:
            out += self._close
            self._close = None
        self.pending = False
        return out

    # -- the keepalive clock ---------------------------------------------------------------

    def next_tick(self) -> float:
        """When ``tick`` has something to do next (inf: never, no keepalive or not open)."""
        if self.state is not WsState.OPEN or self.keepalive is None:
            return math.inf
        awaiting = self._awaiting
        ping_at = max(self._ping_at, self.heard_at + self.keepalive.quiet)
        if awaiting is None or self.heard_at >= awaiting:  # answered: the next ping is next
            return ping_at
        return min(ping_at, awaiting + self.keepalive.timeout)

    def tick(self, now: float) -> Tick | None:
        """What is due at ``now``: a ping (it waits in ``data_to_send``), the peer found dead
        (nothing heard ``timeout`` s after a ping: the caller fails or drops the connection),
        or nothing."""
        keepalive = self.keepalive
        if keepalive is None or self.state is not WsState.OPEN:
            return None
        awaiting = self._awaiting
        if awaiting is not None and self.heard_at >= awaiting:
            awaiting = self._awaiting = None  # a pong, or anything else, came
        if awaiting is not None and now >= awaiting + keepalive.timeout:
            return Tick.DEAD
        if now < self._ping_at or now < self.heard_at + keepalive.quiet:
            return None  # not yet, or the peer was heard from lately: no ping needed
        self._ping_at = now + keepalive.interval
        if awaiting is None:
            self._awaiting = now
        self._ping = PING_PAYLOAD
        self.pending = True
        return Tick.PING

    def silence(self) -> str:
        """Why a ``Tick.DEAD`` peer is dead, in words."""
        timeout = self.keepalive.timeout if self.keepalive is not None else 0.0
        return f"no answer to a ping within {timeout:g} s"
