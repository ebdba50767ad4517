"""The holder's side of a forwarded turn: the internal routes another replica reaches a channel of
this one by (``/internal/replica/``, each request signed with the team's secret: ``signing``),
each request's frames
written to that replica's response as this channel's reader reads them, raw (``ForwardSink``).

``requests/{rid}``: the body is a request frame; it is opened on the job's channel (its frames
routed to the response, framed by ``framing``), sent to the runner, and answered until the end
frame (then the response ends) or the channel's loss (the response ends without one). The asking
replica gone, or past ``client_backlog`` behind, the turn is cancelled on the runner.
``requests/{rid}/attach``: a request another replica holds, named in this channel's hello on a
redial (a resume, docs/protocol.md §6), parked here until it attaches. ``frames``: any other
frame for the runner (``chat.end``)."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from gateway.hub.channel import Channels, Reply, ServerChannel
from gateway.hub.replicas.framing import HEAD, record
from gateway.hub.replicas.remote import ROUTE
from gateway.hub.replicas.signing import BODY_DIGEST, SIGNATURE, Verifier, body_digest
from gateway.hub.routekit import HTTPError, Request, wait_disconnect
from gateway.hub.settings import HubSettings
from gateway.wire import protocol
from gateway.wire.errors import ClientGone
from gateway.wire.http import Response, header

log = logging.getLogger("gateway.hub.replicas")

CONTENT_TYPE = b"application/x-alp-frames"
CANCEL_WITHIN = 2.0  # s: bound on telling the runner a forwarded turn is cancelled
PATHS = {
    "request": ROUTE + "(?P<job_id>[^/]+)/requests/(?P<rid>[^/]+)",
    "attach": ROUTE + "(?P<job_id>[^/]+)/requests/(?P<rid>[^/]+)/attach",
    "frames": ROUTE + "(?P<job_id>[^/]+)/frames",
}


class ForwardSink:
    """One forwarded request's frames on their way to the replica that asked: each chunk frame
    as it was read (its length, then the frame), the read's frames in one write; the end frame
    re-encoded (once a turn) and the response ended with it. Parked (``resp`` None) until its
    replica attaches: the frames wait, at most ``bound`` bytes."""

    __slots__ = ("resp", "bound", "pending", "size", "ended", "overrun", "done", "_wake")

    def __init__(self, bound: int, resp: Response | None = None) -> None:
        self.resp = resp
        self.bound = bound
        self.pending: list[bytes] = []
        self.size = 0  # bytes pending while parked
        self.ended = False  # the request's end is in ``pending`` (or written)
        self.overrun = False  # the replica that asked fell ``bound`` behind
        self.done = trio.Event()  # nothing more will be written
        self._wake = trio.Event()

    # -- the channel's reader (``gateway.hub.channel.Sink``) --------------------------------

    def chunk(self, chunk: object, frame: bytes) -> None:
        self.pending.append(_length(frame))
        self.pending.append(frame)
        if self.resp is None:
            self.size += HEAD + len(frame)
            if self.size > self.bound:
                self._give_up()

    def flush(self) -> None:
        if self.resp is not None and self.pending:
            self._write(False)

    def reply(self, frame: Reply) -> None:
        self.pending.append(record(protocol.encode_frame(frame)))
        self.ended = True
        if self.resp is not None:
            self._write(True)

    def lost(self) -> bool:
        self.ended = True
        if self.resp is not None:
            self._write(True)
        return False  # the replica that asked holds it: it waits for the resume there

    def resume_count(self) -> int | None:
        return None

    def resumed(self) -> None:
        pass

    # -- the route's task --------------------------------------------------------------------

    def attach(self, resp: Response) -> None:
        """Its replica attached: what waited goes now."""
        self.resp = resp
        self._write(self.ended)

    def _write(self, end: bool) -> None:
        resp = self.resp
        assert resp is not None
        data = b"".join(self.pending)
        self.pending.clear()
        try:
            taken = resp.write_nowait(data, b"", end)
        except ClientGone:
            taken = True
            end = True
        if end:
            self.done.set()
            self._wake.set()
        if not taken:
            if resp.backlog > self.bound:
                self._give_up()
            self._wake.set()

    def _give_up(self) -> None:
        self.overrun = True
        self.done.set()
        self._wake.set()

    async def wait(self) -> None:
        await self._wake.wait()
        self._wake = trio.Event()


def _length(frame: bytes) -> bytes:
    """A frame's length, as ``framing.record`` puts it before the frame."""
    return len(frame).to_bytes(HEAD, "big")


class HolderRelay:
    """The internal routes of one replica (``check`` before any of them)."""

    def __init__(
        self,
        team_secrets: tuple[str, ...],
        channels: Channels,
        settings: HubSettings,
        spawn: Callable[..., Any],
    ) -> None:
        self.verifier = Verifier(team_secrets)
        self.channels = channels
        self.settings = settings
        self.spawn = spawn  # starts a task in the team's nursery
        self.parked: dict[tuple[str, str], tuple[ForwardSink, ServerChannel]] = {}

    def check(self, req: Request) -> None:
        """HTTPError 401 unless the request is signed with a team secret, within the window and
        for the first time (before its body is read; ``_body`` checks the body's digest)."""
        scope = req.scope
        refusal = self.verifier.check(
            header(scope, SIGNATURE),
            header(scope, BODY_DIGEST),
            scope["method"],
            scope["path"],
            time.time(),
        )
        if refusal is not None:
            raise HTTPError(401, refusal, "unauthorized")

    async def _body(self, req: Request) -> bytes:
        """The request's body, whose digest its signature covers (HTTPError 401 otherwise)."""
        body = await req.body(self.settings.max_body)
        signed = header(req.scope, BODY_DIGEST) or b""
        if not hmac.compare_digest(body_digest(body).encode(), signed):
            raise HTTPError(401, "the body is not the one signed", "unauthorized")
        return body

    def _channel(self, job_id: str) -> ServerChannel:
        ch = self.channels.local(job_id)
        if ch is None or ch.closed.is_set():
            raise HTTPError(404, "no channel of this job on this replica", "no_channel")
        return ch

    async def request(self, req: Request) -> None:
        """``POST requests/{rid}``: one forwarded turn (see the module's docstring)."""
        settings = self.settings
        body = await self._body(req)
        ch = self._channel(req.params["job_id"])
        rid = req.params["rid"]
        if ch.routes(rid):
            raise HTTPError(409, "this request is already open", "conflict")
        sink = ForwardSink(settings.client_backlog)
        ch.open(rid, sink)
        await self._serve(req, ch, rid, sink, body)

    async def attach(self, req: Request) -> None:
        """``POST requests/{rid}/attach``: a parked request's frames, from where they waited."""
        found = self.parked.pop((req.params["job_id"], req.params["rid"]), None)
        if found is None:
            raise HTTPError(404, "no such request waits here", "no_request")
        sink, ch = found
        await self._body(req)  # empty, as signed
        await self._serve(req, ch, req.params["rid"], sink, b"")

    async def frames(self, req: Request) -> None:
        """``POST frames``: a frame for the runner (``chat.end``)."""
        body = await self._body(req)
        ch = self._channel(req.params["job_id"])
        if not await ch.send(body):
            raise HTTPError(404, "the channel closed", "no_channel")
        await req.resp.whole(200, b"{}")

    def park(self, ch: ServerChannel, rid: str) -> None:
        """A request of another replica, named in ``ch``'s hello: its frames wait for it
        (``attach``) for ``resume_within``."""
        sink = ForwardSink(self.settings.client_backlog)
        ch.open(rid, sink)
        self.parked[(ch.job_id, rid)] = (sink, ch)
        self.spawn(self._unpark, ch, rid, sink)

    async def _unpark(self, ch: ServerChannel, rid: str, sink: ForwardSink) -> None:
        with trio.move_on_after(self.settings.resume_within + 1.0):
            await sink.done.wait()  # given up (too much waited) or ended meanwhile
        if self.parked.get((ch.job_id, rid), (None,))[0] is sink:
            del self.parked[(ch.job_id, rid)]
            log.info("job %s: request %s was not taken back: cancelled", ch.job_id, rid)
            await _cancel(ch, rid)

    async def _serve(
        self, req: Request, ch: ServerChannel, rid: str, sink: ForwardSink, frame: bytes
    ) -> None:
        resp = req.resp
        head = resp.head(200, [(b"content-type", CONTENT_TYPE), (b"cache-control", b"no-store")])
        try:
            resp.write_nowait(b"", head)
            sink.attach(resp)
            if frame and not await ch.send(frame):
                sink.lost()
            async with trio.open_nursery() as nursery:

                async def until_gone() -> None:
                    await wait_disconnect(req.receive)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(until_gone)
                while not sink.overrun:
                    if resp.backlog and not resp.gone:
                        await resp.flush()
                    elif sink.done.is_set():
                        break
                    else:
                        await sink.wait()
                nursery.cancel_scope.cancel()
        except ClientGone:
            pass
        finally:
            if sink.overrun:
                log.warning(
                    "job %s: request %s: the replica that asked fell %d bytes behind: cancelled",
                    ch.job_id,
                    rid,
                    sink.bound,
                )
                resp.reset()
            await _cancel(ch, rid)


async def _cancel(ch: ServerChannel, rid: str) -> None:
    """``chat.completion.cancel`` for a forwarded turn nobody reads any more, unless it ended
    (shielded, bounded)."""
    if ch.closed.is_set() or not ch.routes(rid):
        return
    ch.close_request(rid)
    frame = protocol.encode_frame(protocol.CancelFrame(ch.job_id, rid))
    with trio.move_on_after(CANCEL_WITHIN) as scope:
        scope.shield = True
        await ch.send(frame)
