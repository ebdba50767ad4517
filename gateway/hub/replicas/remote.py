"""A job's channel held by another replica, as a turn of this one sees it: a ``ServerChannel``
whose request frames go to the holder over an authenticated internal route (one HTTP request
per turn on kept-alive connections, ``Peer``), and whose answer frames come back in that
request's response, as the holder read them (``framing``), to be decoded and routed here by
request id exactly as a local channel's reader does (``ServerChannel.on_texts``).

A turn's request is the one thing that crosses: its frame is sent whole, its answer read until
the end frame; a cancel closes that request (the holder cancels the turn on the runner); a
``chat.end`` is a request of its own. A holder that cannot be reached marks its replica down
(``Peer.suspect``): its channels count as gone until its runners redial another replica."""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections.abc import Callable

import trio

from gateway.hub.channel import Channels, ServerChannel, Sink
from gateway.hub.replicas.framing import Records, frame_head
from gateway.hub.replicas.signing import sign
from gateway.wire import http1, protocol

log = logging.getLogger("gateway.hub.replicas")

ROUTE = "/internal/replica/channels/"  # the holder's routes (``gateway.hub.replicas.relay``)
CONNECT_TIMEOUT = 2.0  # s to reach another replica; past it, it counts as down
HEAD_TIMEOUT = 10.0  # s for its answer's head (it answers at once: the frame is sent after)
_REQUEST = protocol.COMPLETION_REQUEST.encode()
_CANCEL = protocol.COMPLETION_CANCEL.encode()


class Peer:
    """Another replica as this one reaches it: its URL, a pool of kept-alive connections, and
    whether it is taken for down (its heartbeat expired, or a connection to it failed since
    its last heartbeat)."""

    def __init__(
        self, replica: str, url: str, secret: str, ssl_context: ssl.SSLContext | None
    ) -> None:
        """``secret``: the team secret this replica signs with."""
        self.replica = replica
        self.url = url
        self.client = http1.Client(
            url,
            ssl_context=ssl_context,
            connect_timeout=CONNECT_TIMEOUT,
            max_idle=64,
            keepalive_expiry=30.0,
            env={},  # another replica is reached directly, never through a proxy
        )
        self.secret = secret
        self.alive = True  # its heartbeat is fresh
        self.suspected_at = -math.inf  # trio clock: a connection to it failed then
        self.heartbeat_seen = -math.inf  # trio clock: when its last fresh heartbeat was read

    @property
    def up(self) -> bool:
        return self.alive and self.suspected_at < self.heartbeat_seen

    def suspect(self, why: str) -> bool:
        """A connection to it failed: down until a heartbeat of it newer than now is read.
        True when it was up."""
        was = self.up
        self.suspected_at = trio.current_time()
        if was:
            log.warning(
                "replica %s (%s) cannot be reached (%s): its channels count as gone",
                self.replica,
                self.url,
                why,
            )
        return was

    def target(self, path: str) -> bytes:
        return self.client.target(path, under_base=False)

    async def post(self, path: str, body: bytes) -> http1.ClientResponse:
        """One request to it (its answer's head read); ConnectFailed, ExchangeFailed."""
        signed = sign(self.secret, "POST", path, body, time.time())
        head = self.client.prepare(
            b"POST", self.target(path), [*signed, (b"content-type", b"application/json")]
        )
        with trio.fail_after(HEAD_TIMEOUT):
            return await self.client.send(head, body)

    def close(self) -> None:
        self.client.close()


class RemoteChannel(ServerChannel):
    """The channel of ``job_id`` as held by ``peer`` (see the module's docstring). ``closed``
    is set when this replica learns the channel is no longer there (new turns then look
    again); turns already on it end as their own requests do."""

    local = False  # another replica's: it carries turns, not the hub's own requests

    def __init__(
        self,
        job_id: str,
        runner_id: str,
        peer: Peer,
        channels: Channels,
        nursery: trio.Nursery,
        lost: Callable[[str, str, Sink], None],
    ) -> None:
        super().__init__(job_id, runner_id, None, channels)
        self.peer = peer
        self._nursery = nursery
        self._lost = lost  # a request whose answer broke off and may be resumed
        self._pumps: dict[str, trio.CancelScope] = {}

    def __repr__(self) -> str:
        state = "closed" if self.closed.is_set() else "open"
        return f"<RemoteChannel job={self.job_id} on {self.peer.replica} {state}>"

    async def send(self, frame: bytes) -> bool:
        """A request frame: sent to the holder, its answer read by a task of its own; a cancel:
        that request closed; any other frame: delivered by the holder. False when the holder
        could not take it (then the turn looks for its channel again)."""
        kind, rid = frame_head(frame)
        if kind == _CANCEL and rid is not None:
            scope = self._pumps.get(rid)
            if scope is not None:
                scope.cancel()
            return True
        if kind == _REQUEST and rid is not None and rid in self._sinks:
            return await self._request(rid, frame, f"{self.job_id}/requests/{rid}")
        path = f"{ROUTE}{self.job_id}/frames"
        try:
            response = await self.peer.post(path, frame)
            await response.discard_rest()
            self.peer.client.release(response)
        except (http1.ExchangeFailed, trio.TooSlowError, OSError) as exc:
            self._unreachable(exc)
            return False
        return response.status == 200

    async def attach(self, rid: str, sink: Sink, resumed: Callable[[], None]) -> bool:
        """Take over a request of this replica that the holder resumed on its channel (its
        hello named it): its frames from where they broke off (``resumed`` is called before
        the first). False when the holder has it not (any more)."""
        self.open(rid, sink)
        path = f"{self.job_id}/requests/{rid}/attach"
        if not await self._request(rid, b"", path, resumed):
            self._sinks.pop(rid, None)
            return False
        return True

    async def _request(
        self, rid: str, frame: bytes, path: str, before: Callable[[], None] | None = None
    ) -> bool:
        try:
            response = await self.peer.post(ROUTE + path, frame)
        except (http1.ExchangeFailed, trio.TooSlowError, OSError) as exc:
            self._unreachable(exc)
            return False
        if response.status != 200:
            await _close(response, self.peer)
            log.info(
                "replica %s has no channel of job %s (%d): looking again",
                self.peer.replica,
                self.job_id,
                response.status,
            )
            self.request_close()
            return False
        scope = trio.CancelScope()
        self._pumps[rid] = scope
        if before is not None:
            before()
        self._nursery.start_soon(self._pump, rid, response, scope)
        return True

    async def _pump(
        self, rid: str, response: http1.ClientResponse, scope: trio.CancelScope
    ) -> None:
        """The request's answer, frame by frame, routed by request id; its end: the runner's
        end frame, else the channel (or the holder) was lost."""
        records = Records()
        body = response.parser.body
        clean = False
        try:
            with scope:
                while True:
                    if body:
                        frames = records.feed(body)
                        body.clear()
                        if frames:
                            await self.on_texts(frames)
                    if response.complete:
                        clean = not records.pending
                        break
                    await response.read_more()
        except (http1.ExchangeFailed, OSError) as exc:
            log.info(
                "job %s: the answer from replica %s broke off (%s)",
                self.job_id,
                self.peer.replica,
                exc,
            )
        finally:
            self._pumps.pop(rid, None)
            if clean and response.reusable:
                self.peer.client.release(response)
            else:
                response.close()
            sink = self._sinks.pop(rid, None)
            if sink is not None and not scope.cancelled_caught:
                if sink.lost():  # a part of the answer reached its client: a resume may come
                    self._lost(self.job_id, rid, sink)

    def close_request(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        scope = self._pumps.get(request_id)
        if scope is not None:
            scope.cancel()

    def request_close(self, code: int = 1000, reason: str | None = None) -> None:
        """No new turn here: the holder closes its channel itself (its pings, its runners'
        offline checks); the turns on it end as their requests do."""
        self.closed.set()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.request_close(code, reason)

    async def serve(self) -> None:  # the holder's reader serves it
        return

    def _unreachable(self, exc: BaseException) -> None:
        why = str(exc) or type(exc).__name__
        if self.peer.suspect(why):
            self._channels.changes.notify()  # its turns wait for their runners' redials
        self.closed.set()


async def _close(response: http1.ClientResponse, peer: Peer) -> None:
    try:
        with trio.move_on_after(1.0):
            await response.discard_rest()
    except http1.ExchangeFailed:
        response.close()
        return
    peer.client.release(response)
