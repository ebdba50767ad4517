"""The hub's core: the Server side of docs/protocol.md §1-§4 and §6 as one ASGI app, with its state and serve_hub.

Chat Jobs (and every status report received) are kept in the hub's SQLite store as well as in
memory, and reloaded at start: a hub restarted on the same data directory accepts the redial of a
job's runner and goes on serving it.

Test hooks:

- ``Hub.faults``: route name -> list of faults, each consumed by one request on that route (see
  ``Fault``): an HTTP status, ``RESET`` (the TCP connection is closed abortively, no response),
  ``LOST`` (the request is processed, then the connection is reset instead of answering),
  ``Hold(s)`` (the request is held unanswered for ``s`` seconds, never processed, then reset) or
  ``Delay(s)`` (the request is processed after ``s`` seconds, answered if the client still waits).
- ``Hub.hits``: every request to a runner route, in order, with the fault it met.
- ``ServerChannel.pause_reading()`` / ``resume_reading()``: a Server that stops reading a channel.
- Admin routes (``Authorization: Bearer <admin token>``): ``GET /api/hub/jobs`` lists every job
  with its reports; ``GET /api/hub/sessions`` the front door's session -> job mapping.
"""

from __future__ import annotations

import collections
import hmac
import importlib
import logging
import math
import pathlib
import re
import socket
import struct
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType
from typing import Any

import hypercorn.config
import hypercorn.trio
import msgspec
import trio

from gateway import protocol
from gateway.hub.store import (
    ADMIN_TOKEN_PREFIX,
    DEFAULT_KEY_PROJECT,
    ApiKey,
    Runner,
    Store,
    StoredJob,
    load_or_create_admin_token,
    new_token,
    token_hash,
)

__all__ = [
    "LOST",
    "RESET",
    "ApiKey",
    "Delay",
    "Fault",
    "Hit",
    "Hold",
    "Hub",
    "Job",
    "ServerChannel",
    "open_hub",
    "serve_hub",
]

log = logging.getLogger("gateway.hub")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MiB = 1024 * 1024
CHANNEL_PATH = "/api/lives/chat/channel/ws"
ROUTES = ("register", "poll", "claim", "status", "progress", "events", "channel")
REQUEST_BUFFER = 256  # inbound frames buffered per open request before the reader pushes back
GENERAL_BUFFER = 1024  # inbound frames buffered for recv(); more are dropped
SUBSCRIBER_BUFFER = 64  # job_available events buffered per events subscriber; more are dropped
CLOSE_REPLACED = 4000  # an old channel replaced by a new connection for the same job
CLOSE_OFFLINE = 1001  # the runner was declared offline
HITS_KEPT = 4096  # Hub.hits keeps this many recent requests

_BASE_RE = re.compile(r"^/api/owners/([^/]+)/projects/([^/]+)/(.+)$")
_RUN_JOB_RE = re.compile(r"^runs/([^/]+)/jobs/([^/]+)$")
_RUN_JOB_PROGRESS_RE = re.compile(r"^runs/([^/]+)/jobs/([^/]+)/progress$")


class _Envelope(msgspec.Struct):
    """Just enough of an inbound frame to route it; every other field is skipped."""

    type: Any = None
    requestId: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_json_encoder = msgspec.json.Encoder()


# -- fault injection ------------------------------------------------------------------------

RESET = "reset"
"""A fault: close the TCP connection abortively (RST) without any response."""

LOST = "lost"
"""A fault: process the request, then reset the connection instead of answering (the Server
acted, the client cannot know). On the channel route it is the same as ``RESET``."""


@dataclass(frozen=True, slots=True)
class Hold:
    """A fault: hold the request unanswered for ``seconds`` (or until the client gives up), then
    reset the connection. The request is never processed: a hung Server, a lost request."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Delay:
    """A fault: wait ``seconds``, then process the request as usual and answer if the client still
    waits. With a client that times out first, the Server acted but its answer was lost."""

    seconds: float


Fault = int | str | Hold | Delay
"""One injected fault: an HTTP status (a WebSocket handshake refused with it), ``RESET``, ``LOST``,
``Hold(s)`` or ``Delay(s)``; the tuples ``("hold", s)`` and ``("delay", s)`` are accepted too."""


@dataclass(frozen=True, slots=True)
class Hit:
    """One request to a runner route (``ROUTES``): when (trio clock), which route, which fault."""

    at: float
    route: str
    fault: Fault | None


def _normalize_fault(fault: Any) -> Fault:
    if isinstance(fault, tuple) and len(fault) == 2 and fault[0] in ("hold", "delay"):
        return Hold(float(fault[1])) if fault[0] == "hold" else Delay(float(fault[1]))
    if isinstance(fault, Hold | Delay) or fault in (RESET, LOST):
        return fault
    if isinstance(fault, int) and not isinstance(fault, bool) and 200 <= fault <= 599:
        return fault
    raise ValueError(f"not a fault: {fault!r} (an HTTP status, RESET, LOST, Hold(s) or Delay(s))")


def _connection_stream() -> trio.SocketStream | trio.SSLStream[trio.SocketStream] | None:
    """The TCP (or TLS) stream under the current ASGI request, found through Hypercorn's trio worker.

    Hypercorn runs each connection in a ``trio.serve_listeners`` handler task (whose frame holds
    the accepted ``stream``) and the ASGI app in a nursery below it; ASGI itself offers no way to
    the socket. None when the layout is not the expected one.
    """
    task: Any = trio.lowlevel.current_task()
    while task is not None:
        frame = getattr(task.coro, "cr_frame", None)
        if frame is not None:
            stream = frame.f_locals.get("stream")
            if isinstance(stream, trio.SocketStream | trio.SSLStream):
                return stream
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    return None


def _abort_connection() -> bool:
    """Close the current request's TCP connection with an RST (SO_LINGER 0); False if not found."""
    stream = _connection_stream()
    if stream is None:
        return False
    sock = (
        stream.socket if isinstance(stream, trio.SocketStream) else stream.transport_stream.socket
    )
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass  # already closed
    sock.close()
    return True


@dataclass(eq=False)
class Job:
    """One queued or claimed Job (mirrored in the hub's SQLite store)."""

    id: str
    owner: str
    project: str
    needs: list[str]
    agent_definition: dict[str, Any]
    origin: str = "api"  # "api" (enqueue_job) or "frontdoor" (a /v1 chat session)
    run_id: str | None = None
    claimed_by: str | None = None  # runner id
    runner_name: str | None = None  # the "name" sent with the claim
    status: str = "queued"  # "queued" | "in_progress" | "completed"
    conclusion: str | None = None  # "success" | "failure"
    reports: list[dict[str, Any]] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)
    completed: trio.Event = field(default_factory=trio.Event)
    claimed: trio.Event = field(default_factory=trio.Event)
    cancelled: bool = False
    cancel_reason: str | None = None
    final_reported: bool = False  # a runner's "completed" report was accepted
    claimed_at: float | None = None  # trio clock; None for a job reloaded at start
    channel_opened: bool = False  # a channel of this job was accepted (since this hub started)

    def record(self) -> StoredJob:
        """The job as the store keeps it (without its reports)."""
        return StoredJob(
            id=self.id,
            owner=self.owner,
            project=self.project,
            needs=list(self.needs),
            agent_definition=self.agent_definition,
            origin=self.origin,
            run_id=self.run_id,
            claimed_by=self.claimed_by,
            runner_name=self.runner_name,
            status=self.status,
            conclusion=self.conclusion,
            final_reported=self.final_reported,
            cancelled=self.cancelled,
            cancel_reason=self.cancel_reason,
        )

    @classmethod
    def from_record(cls, stored: StoredJob) -> Job:
        """A job reloaded from the store, its events set to match its state."""
        job = cls(
            id=stored.id,
            owner=stored.owner,
            project=stored.project,
            needs=list(stored.needs),
            agent_definition=dict(stored.agent_definition),
            origin=stored.origin,
            run_id=stored.run_id,
            claimed_by=stored.claimed_by,
            runner_name=stored.runner_name,
            status=stored.status,
            conclusion=stored.conclusion,
            reports=list(stored.reports),
            cancelled=stored.cancelled,
            cancel_reason=stored.cancel_reason,
            final_reported=stored.final_reported,
        )
        if job.claimed_by is not None:
            job.claimed.set()
        if job.status == "completed":
            job.completed.set()
        return job

    def admin_json(self) -> dict[str, Any]:
        """Everything about the job, for ``GET /api/hub/jobs``."""
        return {
            "id": self.id,
            "runId": self.run_id,
            "owner": self.owner,
            "project": self.project,
            "needs": list(self.needs),
            "agentDefinition": self.agent_definition,
            "origin": self.origin,
            "claimedBy": self.claimed_by,
            "runnerName": self.runner_name,
            "status": self.status,
            "conclusion": self.conclusion,
            "finalReported": self.final_reported,
            "cancelled": self.cancelled,
            "cancelReason": self.cancel_reason,
            "reports": list(self.reports),
        }

    def to_json(self) -> dict[str, Any]:
        """The Job as a poll reply lists it."""
        return {
            "id": self.id,
            "runId": None,
            "needs": list(self.needs),
            "agentDefinition": self.agent_definition,
        }


class ServerChannel:
    """One accepted Chat Channel WebSocket, seen from the Server side."""

    def __init__(self, hub: Hub, job_id: str, runner_id: str, send: Send) -> None:
        self.hub = hub
        self.job_id = job_id
        self.runner_id = runner_id
        self.closed = trio.Event()
        self._asgi_send = send
        self._lock = trio.Lock()
        self._requests: dict[str, trio.MemorySendChannel[tuple[str, float]]] = {}
        self._general_send, self._general_recv = trio.open_memory_channel[tuple[str, float]](
            GENERAL_BUFFER
        )
        self._loop_scope = trio.CancelScope()
        self._close_code: int | None = None
        self._close_reason: str | None = None
        self._terminated = trio.Event()
        self._reading = trio.Event()  # set while the pump may read; cleared by pause_reading()
        self._reading.set()
        self.dropped = 0  # inbound frames dropped because recv() was not read

    def __repr__(self) -> str:
        state = "closed" if self.closed.is_set() else "open"
        return f"<ServerChannel job={self.job_id} runner={self.runner_id} {state}>"

    async def send(self, frame: dict[str, Any] | str | bytes) -> None:
        """Send one message: a dict as JSON text, a str as text, bytes as a binary message.

        A send on a closed channel is dropped quietly (its requests already saw EndOfChannel).
        """
        if isinstance(frame, dict):
            message: Message = {
                "type": "websocket.send",
                "text": _json_encoder.encode(frame).decode(),
            }
        elif isinstance(frame, str):
            message = {"type": "websocket.send", "text": frame}
        elif isinstance(frame, bytes | bytearray | memoryview):
            message = {"type": "websocket.send", "bytes": bytes(frame)}
        else:
            raise TypeError(f"cannot send {type(frame).__name__} on a channel")
        async with self._lock:
            if self.closed.is_set():
                return
            await self._asgi_send(message)

    def open_request(self, request_id: str) -> trio.MemoryReceiveChannel[tuple[str, float]]:
        """Route inbound text messages whose ``requestId`` is ``request_id`` to the returned channel.

        Each item is ``(text, time.perf_counter() at receipt)``. When the socket closes the
        channel ends (EndOfChannel); on an already closed channel it ends at once.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already open on this channel")
        send_ch, recv_ch = trio.open_memory_channel[tuple[str, float]](REQUEST_BUFFER)
        if self.closed.is_set():
            send_ch.close()
        else:
            self._requests[request_id] = send_ch
        return recv_ch

    def close_request(self, request_id: str) -> None:
        """Stop routing ``request_id``; later messages for it go to ``recv()``."""
        send_ch = self._requests.pop(request_id, None)
        if send_ch is not None:
            send_ch.close()

    @property
    def reading_paused(self) -> bool:
        return not self._reading.is_set()

    def pause_reading(self) -> None:
        """Stop reading the WebSocket (a slow Server): inbound frames pile up in Hypercorn's
        small queue, then in the TCP buffers, until the runner's sends block. While paused a
        disconnect is noticed only on ``resume_reading()``; ``close()`` still works."""
        if self._reading.is_set():
            self._reading = trio.Event()

    def resume_reading(self) -> None:
        """Read the WebSocket again after ``pause_reading()``."""
        self._reading.set()

    async def recv(self) -> tuple[str, float]:
        """The next inbound text message not routed to an open request; EndOfChannel once closed."""
        return await self._general_recv.receive()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close the WebSocket (``code`` != 1000 simulates a dropped channel)."""
        self.request_close(code, reason)
        with trio.move_on_after(5):
            await self._terminated.wait()

    def request_close(self, code: int = 1000, reason: str | None = None) -> None:
        """Close without waiting: end the channel now, the close frame follows from its own task."""
        if self._close_code is None and not self._terminated.is_set():
            self._close_code = code
            self._close_reason = reason
        self._finish()
        self._loop_scope.cancel()

    # -- internals, driven by the hub's WebSocket handler --------------------

    def _finish(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for send_ch in self._requests.values():
            send_ch.close()
        self._requests.clear()
        self._general_send.close()
        self.hub._channel_gone(self)

    async def _route(self, text: str, at: float) -> None:
        try:
            envelope = _envelope_decoder.decode(text)
        except msgspec.DecodeError:
            request_id = None
        else:
            request_id = envelope.requestId if isinstance(envelope.requestId, str) else None
        if request_id is not None:
            send_ch = self._requests.get(request_id)
            if send_ch is not None:
                try:
                    try:
                        send_ch.send_nowait((text, at))  # no scheduling point per frame
                    except trio.WouldBlock:
                        await send_ch.send((text, at))  # that request reads slowly: push back
                    return
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    if self._requests.get(request_id) is send_ch:
                        del self._requests[request_id]
        try:
            self._general_send.send_nowait((text, at))
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("channel %s: recv() not read, dropping inbound frames", self.job_id)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _serve(self, receive: Receive) -> None:
        """Pump inbound messages until the socket closes or ``close()`` is asked for."""
        disconnected = False
        try:
            with self._loop_scope:
                while True:
                    if not self._reading.is_set():  # paused; receive() is the checkpoint
                        await self._reading.wait()
                    message = await receive()
                    kind = message.get("type")
                    if kind == "websocket.disconnect":
                        disconnected = True
                        break
                    if kind != "websocket.receive":
                        continue
                    text = message.get("text")
                    if text is None:
                        continue  # binary inbound frames are ignored
                    at = time.perf_counter()
                    self.hub._seen(self.runner_id)
                    await self._route(text, at)
        finally:
            self._finish()
            try:
                if not disconnected:
                    close: Message = {"type": "websocket.close", "code": self._close_code or 1000}
                    if self._close_reason:
                        close["reason"] = self._close_reason
                    async with self._lock:
                        await self._asgi_send(close)
            finally:
                self._terminated.set()


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            text = value.decode("latin-1").strip()
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer":
                return None
            token = token.strip()
            return token or None
    return None


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _HTTPError(400, "client disconnected")
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise _HTTPError(413, f"request body over {limit} bytes")
        chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise _HTTPError(400, "request body is not JSON") from None
    if not isinstance(obj, dict):
        raise _HTTPError(400, "request body must be a JSON object")
    return obj


def _string_list(obj: dict[str, Any], key: str, *, required: bool) -> list[str]:
    value = obj.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _HTTPError(400, f'"{key}" must be a list of strings')
    return value


async def _send_json(
    send: Send, status: int, obj: Any = None, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    no_body = status < 200 or status in (204, 304)
    body = b"" if no_body else _json_encoder.encode(obj if obj is not None else {})
    out_headers = list(headers or [])
    if not no_body:
        out_headers.append((b"content-type", b"application/json"))
        out_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": out_headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, status: int, message: str) -> None:
    headers = [(b"www-authenticate", b"Bearer")] if status == 401 else None
    await _send_json(send, status, {"error": message}, headers)


async def _wait_disconnect(receive: Receive, cancel_scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            cancel_scope.cancel()
            return


def _frontdoor_module() -> ModuleType | None:
    try:
        return importlib.import_module("gateway.hub.frontdoor")
    except ModuleNotFoundError as exc:
        if exc.name != "gateway.hub.frontdoor":
            raise
        return None


class Hub:
    """The ALP Server emulator's state and its ASGI app (runner API, Chat Channel, /v1 front door)."""

    def __init__(
        self,
        data_dir: pathlib.Path | str | None = None,
        *,
        admin_token: str | None = None,
        events: bool = True,
        register_paths: tuple[str, ...] = ("runners", "runners/register"),
        offline_after: float = 60.0,
        reoffer_after: float = 10.0,
        session_idle_timeout: float = 600.0,
        runner_wait_timeout: float = 30.0,
        keepalive_interval: float = 15.0,
        max_body: int = 16 * MiB,
    ) -> None:
        self.data_dir = pathlib.Path(data_dir).expanduser() if data_dir is not None else None
        self.store = Store(self.data_dir)
        if admin_token is not None:
            self.admin_token = admin_token
            self.admin_token_created = False
        elif self.data_dir is not None:
            self.admin_token, self.admin_token_created = load_or_create_admin_token(self.data_dir)
        else:
            self.admin_token = new_token(ADMIN_TOKEN_PREFIX)
            self.admin_token_created = True
        self._admin_hash = token_hash(self.admin_token)
        self.events = events
        self.register_paths = tuple(register_paths)
        self.offline_after = offline_after
        self.reoffer_after = reoffer_after
        self.session_idle_timeout = session_idle_timeout
        self.runner_wait_timeout = runner_wait_timeout
        self.keepalive_interval = keepalive_interval
        self.max_body = max_body
        self.jobs: dict[str, Job] = {job.id: Job.from_record(job) for job in self.store.load_jobs()}
        self.faults: dict[str, list[Fault]] = {route: [] for route in ROUTES}
        self.hits: collections.deque[Hit] = collections.deque(maxlen=HITS_KEPT)
        self.hit_counts: collections.Counter[str] = collections.Counter()
        self._hit_changed = trio.Event()
        self.last_seen: dict[
            str, float
        ] = {}  # runner id -> trio.current_time() of its last sign of life
        self._channels: dict[str, ServerChannel] = {}
        self._channel_changed = trio.Event()
        self._subscribers: dict[tuple[str, str], set[trio.MemorySendChannel[str]]] = {}
        self._routes: list[tuple[re.Pattern[str], dict[str, tuple[str, Any]]]] = []
        for path in self.register_paths:
            self._routes.append(
                (re.compile("^" + re.escape(path) + "$"), {"POST": ("register", self._register)})
            )
        self._routes += [
            (re.compile(r"^runners/jobs$"), {"POST": ("poll", self._poll)}),
            (re.compile(r"^runners/generate-jitconfig$"), {"POST": ("claim", self._claim)}),
            (_RUN_JOB_RE, {"PATCH": ("status", self._status)}),
            (_RUN_JOB_PROGRESS_RE, {"POST": ("progress", self._progress)}),
        ]
        if self.events:
            self._routes.append(
                (re.compile(r"^runners/events$"), {"GET": ("events", self._events)})
            )

    # -- public helpers ------------------------------------------------------

    def enqueue_job(
        self,
        owner: str,
        project: str,
        needs: list[str],
        agent_definition: dict[str, Any] | None = None,
        *,
        origin: str = "api",
    ) -> Job:
        """Queue a Job for ``owner/project`` and tell every events subscriber of that project."""
        job = Job(
            id=str(uuid.uuid4()),
            owner=owner,
            project=project,
            needs=list(needs),
            agent_definition=dict(agent_definition) if agent_definition is not None else {},
            origin=origin,
        )
        self.jobs[job.id] = job
        self.save_job(job)
        for send_ch in list(self._subscribers.get((owner, project), ())):
            try:
                send_ch.send_nowait(job.id)
            except trio.WouldBlock:
                pass  # that subscriber has events pending already: it will poll anyway
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.get((owner, project), set()).discard(send_ch)
        return job

    def channel(self, job_id: str) -> ServerChannel | None:
        """The job's current open channel, or None."""
        return self._channels.get(job_id)

    async def wait_channel(
        self,
        job_id: str,
        timeout: float | None = None,  # noqa: ASYNC109 (the shared API)
    ) -> ServerChannel | None:
        """The job's current open channel, waiting for a (re)connect.

        None on timeout, and at once when the job is unknown, completed or cancelled
        (no channel can come then).
        """
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                ch = self._channels.get(job_id)
                if ch is not None:
                    return ch
                job = self.jobs.get(job_id)
                if job is None or job.status == "completed" or job.cancelled:
                    return None
                await self._channel_changed.wait()
        return None

    async def end_job(self, job_id: str, reason: str) -> None:
        """Send ``chat.end`` on the job's channel if one is open."""
        ch = self._channels.get(job_id)
        if ch is not None:
            await ch.send(protocol.end_frame(job_id, reason))

    async def cancel_job(self, job_id: str, reason: str = "cancelled") -> None:
        """Withdraw a job: a queued one leaves the queue; an open one gets ``chat.end`` and is marked cancelled."""
        job = self.jobs.get(job_id)
        if job is None or job.status == "completed":
            return
        if job.claimed_by is not None:
            job.cancel_reason = reason
            await self.end_job(job_id, reason)
        self.withdraw_job(job_id, reason)

    def withdraw_job(self, job_id: str, reason: str) -> None:
        """Mark a job cancelled without telling its runner (``cancel_job`` sends ``chat.end`` first).

        A queued job is forgotten; a claimed one stays, cancelled: its channel is refused from now
        on, so its runner ends the session and sends its final report.
        """
        job = self.jobs.get(job_id)
        if job is None or job.status == "completed":
            return
        job.cancel_reason = reason
        job.cancelled = True
        if job.claimed_by is None:
            del self.jobs[job_id]
            self.store.delete_job(job_id)
        else:
            self.save_job(job)
        self._notify_channel_change()

    def save_job(self, job: Job) -> None:
        """Write the job's state to the store (after every change)."""
        self.store.save_job(job.record())

    def _add_report(self, job: Job, report: dict[str, Any]) -> None:
        job.reports.append(report)
        self.store.add_job_report(job.id, report)

    def register_runner(
        self, owner: str, project: str, name: str, labels: list[str]
    ) -> dict[str, Any]:
        """Register a runner for ``owner/project``: ``{"id","name","token","registeredAt"}``."""
        runner, token = self.store.add_runner(owner, project, name, list(labels))
        return {
            "id": runner.id,
            "name": runner.name,
            "token": token,
            "registeredAt": runner.registered_at,
        }

    def create_api_key(self, name: str, project: str = DEFAULT_KEY_PROJECT) -> str:
        return self.store.create_api_key(name, project)

    def list_api_keys(self) -> list[dict[str, Any]]:
        return self.store.list_api_keys()

    def revoke_api_key(self, name: str) -> bool:
        return self.store.revoke_api_key(name)

    def check_api_key(self, token: str) -> ApiKey | None:
        return self.store.check_api_key(token)

    def runner_by_token(self, token: str) -> Runner | None:
        return self.store.runner_by_token(token)

    def is_admin_token(self, token: str) -> bool:
        return hmac.compare_digest(token_hash(token), self._admin_hash)

    @property
    def runners_connected(self) -> set[str]:
        """Runner ids with an open channel."""
        return {ch.runner_id for ch in self._channels.values()}

    def open_channels(self) -> list[ServerChannel]:
        return list(self._channels.values())

    async def check_offline(self) -> list[Job]:
        """Force-complete (as failure) the open jobs of runners silent for ``offline_after`` s."""
        now = trio.current_time()
        forced: list[Job] = []
        for job in list(self.jobs.values()):
            if job.claimed_by is None or job.status == "completed":
                continue
            last = self.last_seen.get(job.claimed_by)
            if last is None:  # a job reloaded at start: its runner gets offline_after to show up
                self.last_seen[job.claimed_by] = now
                continue
            if now - last <= self.offline_after:
                continue
            report = {
                "status": "completed",
                "conclusion": "failure",
                "logs": "runner offline",
                "forced": True,
            }
            self._add_report(job, report)
            job.status = "completed"
            job.conclusion = "failure"
            job.completed.set()
            self.save_job(job)
            forced.append(job)
            log.info("runner %s offline: job %s force-completed", job.claimed_by, job.id)
            ch = self._channels.get(job.id)
            if ch is not None:
                ch.request_close(CLOSE_OFFLINE, "runner offline")
        if forced:
            self._notify_channel_change()
        return forced

    async def watch_offline(self) -> None:
        """Run ``check_offline`` periodically, forever."""
        interval = min(max(self.offline_after / 5, 0.02), 5.0)
        while True:
            await trio.sleep(interval)
            await self.check_offline()

    # -- internals -----------------------------------------------------------

    def _seen(self, runner_id: str) -> None:
        self.last_seen[runner_id] = trio.current_time()

    def _notify_channel_change(self) -> None:
        self._channel_changed.set()
        self._channel_changed = trio.Event()

    def _channel_gone(self, ch: ServerChannel) -> None:
        if self._channels.get(ch.job_id) is ch:
            del self._channels[ch.job_id]
            self._notify_channel_change()

    def _take_fault(self, route: str) -> Fault | None:
        faults = self.faults.get(route)
        fault = _normalize_fault(faults.pop(0)) if faults else None
        self.hits.append(Hit(trio.current_time(), route, fault))
        self.hit_counts[route] += 1
        self._hit_changed.set()
        self._hit_changed = trio.Event()
        return fault

    async def wait_hits(self, route: str, n: int) -> list[Hit]:
        """Wait until ``n`` requests reached ``route``; returns that route's (recent) hits."""
        while self.hit_counts[route] < n:
            await self._hit_changed.wait()
        return [h for h in self.hits if h.route == route]

    async def _hold(self, fault: Hold, receive: Receive) -> None:
        """Hold a request unanswered for ``fault.seconds`` or until the client disconnects."""
        with trio.move_on_after(fault.seconds):
            while True:
                message = await receive()
                if message["type"] in ("http.disconnect", "websocket.disconnect"):
                    return

    async def _reset(self, receive: Receive, send: Send, websocket: bool) -> None:
        """Close the connection without a response (an RST), then let Hypercorn notice."""
        if not _abort_connection():
            # Not under Hypercorn's trio worker as expected: the nearest thing. An HTTP client
            # skips a 1xx answer and then sees the connection closed without a response.
            log.warning("reset fault: the connection's socket was not found; closing it instead")
            if websocket:
                await send({"type": "websocket.close", "code": 1011})
            else:
                await send({"type": "http.response.start", "status": 199, "headers": []})
            return
        gone = ("http.disconnect", "websocket.disconnect")
        with trio.move_on_after(2):
            while (await receive())["type"] not in gone:
                pass

    async def _apply_fault(
        self, fault: Fault, receive: Receive, send: Send, *, websocket: bool = False
    ) -> Receive | None:
        """Act out ``fault`` (``LOST`` here: a reset); returns the receive to process the request
        with (``Delay``), else None."""
        if isinstance(fault, int):
            if websocket:
                await self._reject_ws(send, fault, {"error": "injected"})
            else:
                await _send_json(send, fault, {"error": "injected"})
            return None
        if isinstance(fault, Hold):
            await self._hold(fault, receive)
            await self._reset(receive, send, websocket)
            return None
        if isinstance(fault, Delay):
            if websocket:
                await trio.sleep(fault.seconds)
                return receive
            # read the body now and replay it: the client may be gone when the handler runs
            body = await _read_body(receive, self.max_body)
            await trio.sleep(fault.seconds)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return replay
        await self._reset(receive, send, websocket)
        return None

    def _runner(self, scope: Scope, owner: str, project: str) -> Runner:
        token = _bearer(scope)
        runner = self.store.runner_by_token(token) if token else None
        if runner is None:
            raise _HTTPError(
                401, "a runner token is required" if token is None else "unknown runner token"
            )
        self._seen(runner.id)
        if (runner.owner, runner.project) != (owner, project):
            raise _HTTPError(403, f"this runner is registered to {runner.owner}/{runner.project}")
        return runner

    def _own_job(self, runner: Runner, owner: str, project: str, run_id: str, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None or (job.owner, job.project) != (owner, project):
            raise _HTTPError(404, "no such job")
        if job.claimed_by != runner.id:
            raise _HTTPError(403, "this job is not claimed by this runner")
        if job.run_id != run_id:
            raise _HTTPError(404, "no such run for this job")
        return job

    # -- the ASGI app ----------------------------------------------------------

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point (HTTP, WebSocket, lifespan)."""
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._dispatch_http(scope, receive, tracked_send)
        except _HTTPError as exc:
            if not started:
                await _send_error(send, exc.status, exc.message)
        except Exception:
            log.exception("error handling %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await _send_error(send, 500, "internal error")

    async def _dispatch_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path.startswith("/api/hub/"):
            await self._admin(scope, send, path)
            return
        if path.startswith("/v1/"):
            frontdoor = _frontdoor_module()
            if frontdoor is None:
                raise _HTTPError(501, "the front door is not available")
            await frontdoor.handle(self, scope, receive, send)
            return
        m = _BASE_RE.match(path)
        if m is None:
            raise _HTTPError(404, "not found")
        owner, project, rest = m.group(1), m.group(2), m.group(3)
        for pattern, methods in self._routes:
            rm = pattern.match(rest)
            if rm is None:
                continue
            entry = methods.get(scope["method"])
            if entry is None:
                allow = ", ".join(methods).encode()
                await _send_json(send, 405, {"error": "method not allowed"}, [(b"allow", allow)])
                return
            route, handler = entry
            fault = self._take_fault(route)
            if fault == LOST:
                await self._lose_answer(handler, scope, receive, owner, project, rm.groups())
                await self._reset(receive, send, websocket=False)
                return
            if fault is not None:
                replay = await self._apply_fault(fault, receive, send)
                if replay is None:
                    return
                receive = replay
            await handler(scope, receive, send, owner, project, *rm.groups())
            return
        raise _HTTPError(404, "not found")

    async def _lose_answer(
        self,
        handler: Any,
        scope: Scope,
        receive: Receive,
        owner: str,
        project: str,
        groups: tuple[str, ...],
    ) -> None:
        """Run ``handler`` for its effect only: whatever it answers is dropped."""

        async def drop(message: Message) -> None:
            pass

        try:
            await handler(scope, receive, drop, owner, project, *groups)
        except _HTTPError as exc:
            log.info(
                "lost answer: %s %s would have failed: %s",
                scope["method"],
                scope["path"],
                exc.message,
            )

    def _unstarted_claim(self, job: Job, runner_id: str) -> bool:
        """The job is claimed by ``runner_id``, which has not started it (no in_progress, no channel)."""
        return (
            job.claimed_by == runner_id
            and job.status == "queued"
            and not job.cancelled
            and not job.channel_opened
        )

    async def _admin(self, scope: Scope, send: Send, path: str) -> None:
        """``GET /api/hub/jobs`` and ``GET /api/hub/sessions``, for the admin credential only."""
        token = _bearer(scope)
        if token is None:
            raise _HTTPError(401, "the admin credential is required")
        if not self.is_admin_token(token):
            raise _HTTPError(403, "only the admin credential may use /api/hub/")
        if path not in ("/api/hub/jobs", "/api/hub/sessions"):
            raise _HTTPError(404, "not found")
        if scope["method"] != "GET":
            await _send_json(send, 405, {"error": "method not allowed"}, [(b"allow", b"GET")])
            return
        if path == "/api/hub/jobs":
            await _send_json(send, 200, {"jobs": [job.admin_json() for job in self.jobs.values()]})
            return
        frontdoor = _frontdoor_module()
        listing = getattr(frontdoor, "sessions", None) if frontdoor is not None else None
        found = listing(self) if listing is not None else {}
        sessions = [
            {"key": key[0], "session": key[1], "jobId": job_id} for key, job_id in found.items()
        ]
        await _send_json(send, 200, {"sessions": sessions})

    async def _register(
        self, scope: Scope, receive: Receive, send: Send, owner: str, project: str
    ) -> None:
        body = await _read_body(receive, self.max_body)
        token = _bearer(scope)
        if token is None:
            raise _HTTPError(401, "a user credential is required to register a runner")
        if not self.is_admin_token(token):
            if self.store.runner_by_token(token) is not None:
                raise _HTTPError(
                    403, "a runner token was presented: only a user credential registers a runner"
                )
            if self.store.check_api_key(token) is not None:
                raise _HTTPError(
                    403, "an API key was presented: only a user credential registers a runner"
                )
            raise _HTTPError(401, "unknown credential")
        obj = _json_object(body)
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            raise _HTTPError(400, '"name" must be a non-empty string')
        labels = _string_list(obj, "labels", required=False)
        await _send_json(send, 201, self.register_runner(owner, project, name, labels))

    async def _poll(
        self, scope: Scope, receive: Receive, send: Send, owner: str, project: str
    ) -> None:
        body = await _read_body(receive, self.max_body)
        runner = self._runner(scope, owner, project)
        capabilities = set(_string_list(_json_object(body), "capabilities", required=True))
        now = trio.current_time()

        def offered(job: Job) -> bool:
            if job.claimed_by is None:
                return job.status == "queued" and not job.cancelled
            # a claim whose answer this runner may have lost: offered to it again after a while
            claimed_at = -math.inf if job.claimed_at is None else job.claimed_at
            return self._unstarted_claim(job, runner.id) and now - claimed_at >= self.reoffer_after

        jobs = [
            job.to_json()
            for job in self.jobs.values()
            if job.owner == owner
            and job.project == project
            and set(job.needs) <= capabilities
            and offered(job)
        ]
        if not jobs:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await _send_json(send, 200, {"jobs": jobs})

    async def _claim(
        self, scope: Scope, receive: Receive, send: Send, owner: str, project: str
    ) -> None:
        body = await _read_body(receive, self.max_body)
        runner = self._runner(scope, owner, project)
        obj = _json_object(body)
        job_id = obj.get("jobId")
        name = obj.get("name")
        if not isinstance(job_id, str) or not isinstance(name, str):
            raise _HTTPError(400, '"jobId" and "name" must be strings')
        job = self.jobs.get(job_id)
        if job is None or (job.owner, job.project) != (owner, project):
            raise _HTTPError(404, "no such job")
        if self._unstarted_claim(job, runner.id):
            # the same runner again before starting the job: it lost our answer; same runId
            log.info(
                "job %s claimed again by runner %s: same run %s", job.id, runner.id, job.run_id
            )
            await _send_json(send, 200, {"runId": job.run_id})
            return
        if job.claimed_by is not None or job.status != "queued" or job.cancelled:
            raise _HTTPError(409, "this job is already claimed")
        job.claimed_by = runner.id
        job.runner_name = name
        job.run_id = str(uuid.uuid4())
        job.claimed_at = trio.current_time()
        job.claimed.set()
        self.save_job(job)
        await _send_json(send, 200, {"runId": job.run_id})

    async def _job_request(
        self, scope: Scope, receive: Receive, owner: str, project: str, run_id: str, job_id: str
    ) -> tuple[Job, dict[str, Any]]:
        """A runner's request about one of its jobs: the job and the JSON object sent."""
        body = await _read_body(receive, self.max_body)
        runner = self._runner(scope, owner, project)
        return self._own_job(runner, owner, project, run_id, job_id), _json_object(body)

    async def _status(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        owner: str,
        project: str,
        run_id: str,
        job_id: str,
    ) -> None:
        job, obj = await self._job_request(scope, receive, owner, project, run_id, job_id)
        self._add_report(job, obj)
        status = obj.get("status")
        if status == "in_progress":
            if job.status == "completed":
                raise _HTTPError(409, "this job is already completed")
            job.status = "in_progress"
            self.save_job(job)
        elif status == "completed":
            if job.status == "completed":
                raise _HTTPError(409, "this job is already completed")
            conclusion = obj.get("conclusion")
            if conclusion not in ("success", "failure"):
                raise _HTTPError(400, '"conclusion" must be "success" or "failure"')
            for key in ("logs", "completionReason"):
                if obj.get(key) is not None and not isinstance(obj[key], str):
                    raise _HTTPError(400, f'"{key}" must be a string')
            job.status = "completed"
            job.conclusion = conclusion
            job.final_reported = True
            job.completed.set()
            self.save_job(job)
            self._notify_channel_change()
        else:
            raise _HTTPError(400, '"status" must be "in_progress" or "completed"')
        await _send_json(send, 200, {"id": job.id, "runId": job.run_id, "status": job.status})

    async def _progress(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        owner: str,
        project: str,
        run_id: str,
        job_id: str,
    ) -> None:
        job, obj = await self._job_request(scope, receive, owner, project, run_id, job_id)
        job.progress.append(obj)
        if not isinstance(obj.get("stage"), str):
            raise _HTTPError(400, '"stage" must be a string')
        if obj.get("message") is not None and not isinstance(obj["message"], str):
            raise _HTTPError(400, '"message" must be a string or null')
        if job.status == "completed":
            raise _HTTPError(409, "this job is already completed")
        await _send_json(send, 200, {})

    async def _events(
        self, scope: Scope, receive: Receive, send: Send, owner: str, project: str
    ) -> None:
        self._runner(scope, owner, project)
        send_ch, recv_ch = trio.open_memory_channel[str](SUBSCRIBER_BUFFER)
        subscribers = self._subscribers.setdefault((owner, project), set())
        subscribers.add(send_ch)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_wait_disconnect, receive, nursery.cancel_scope)
                while True:
                    job_id: str | None = None
                    with trio.move_on_after(self.keepalive_interval):
                        job_id = await recv_ch.receive()
                    if job_id is None:
                        chunk = b": keepalive\n\n"
                    else:
                        data = _json_encoder.encode({"jobId": job_id})
                        chunk = b"event: job_available\ndata: " + data + b"\n\n"
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            subscribers.discard(send_ch)
            if not subscribers and self._subscribers.get((owner, project)) is subscribers:
                del self._subscribers[(owner, project)]
            send_ch.close()

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()
        if message.get("type") != "websocket.connect":
            return
        if scope["path"] != CHANNEL_PATH:
            await self._reject_ws(send, 404, {"error": "not found"})
            return
        fault = self._take_fault("channel")
        if fault is not None:
            if await self._apply_fault(fault, receive, send, websocket=True) is None:
                return
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
        job_id = (query.get("jobId") or [""])[0]
        token = (query.get("token") or [""])[0]
        runner = self.store.runner_by_token(token) if token else None
        if runner is not None:
            self._seen(runner.id)
        job = self.jobs.get(job_id)
        if (
            runner is None
            or job is None
            or job.claimed_by != runner.id
            or job.status == "completed"
            or job.cancelled
        ):
            await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
            return
        await send({"type": "websocket.accept"})
        job.channel_opened = True
        ch = ServerChannel(self, job.id, runner.id, send)
        old = self._channels.get(job.id)
        self._channels[job.id] = ch
        if old is not None:
            old.request_close(CLOSE_REPLACED, "replaced by a new connection")
        self._notify_channel_change()
        await ch._serve(receive)

    async def _reject_ws(self, send: Send, status: int, obj: Any) -> None:
        body = _json_encoder.encode(obj)
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})


def _hypercorn_config(
    hub: Hub,
    host: str,
    port: int,
    certfile: str | pathlib.Path | None = None,
    keyfile: str | pathlib.Path | None = None,
) -> hypercorn.config.Config:
    if (certfile is None) != (keyfile is None):
        raise ValueError("TLS needs both a certificate and its key")
    config = hypercorn.config.Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("gateway.hub.server")
    config.websocket_max_message_size = hub.max_body
    config.graceful_timeout = 1.0
    if certfile is not None and keyfile is not None:
        config.certfile = str(certfile)
        config.keyfile = str(keyfile)
    return config


async def serve_hub(
    hub: Hub,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    certfile: str | pathlib.Path | None = None,
    keyfile: str | pathlib.Path | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``hub`` on ``host:port`` (0 = a free port) until cancelled; ``started`` gets the base URL.

    With ``certfile`` and ``keyfile`` (PEM) it serves HTTPS and WSS only; the URL is ``https://``.
    """
    config = _hypercorn_config(hub, host, port, certfile, keyfile)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.watch_offline)
        frontdoor = _frontdoor_module()
        restore = getattr(frontdoor, "restore", None) if frontdoor is not None else None
        if restore is not None:
            restore(hub)  # the front door's sessions, before any request arrives
        run = getattr(frontdoor, "run", None) if frontdoor is not None else None
        if run is not None:
            nursery.start_soon(run, hub)
        binds: list[str] = await nursery.start(
            partial(hypercorn.trio.serve, hub.app, config, mode="asgi")  # type: ignore[arg-type]
        )
        task_status.started(binds[0])


@asynccontextmanager
async def open_hub(hub: Hub | None = None, **serve_kwargs: Any) -> AsyncIterator[tuple[Hub, str]]:
    """Serve a hub (a fresh in-memory one by default) for the body of the block; yields (hub, base_url)."""
    if hub is None:
        hub = Hub()
    async with trio.open_nursery() as nursery:
        base_url: str = await nursery.start(partial(serve_hub, hub, **serve_kwargs))
        try:
            yield hub, base_url
        finally:
            nursery.cancel_scope.cancel()
