"""The hub's core: the Server side of PROTOCOL.md §1-4 and §6 as one ASGI app, with its state and serve_hub."""

from __future__ import annotations

import hmac
import importlib
import logging
import math
import pathlib
import re
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
    load_or_create_admin_token,
    new_token,
    token_hash,
)

__all__ = [
    "ApiKey",
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

_BASE_RE = re.compile(r"^/api/owners/([^/]+)/projects/([^/]+)/(.+)$")
_RUN_JOB_RE = re.compile(r"^runs/([^/]+)/jobs/([^/]+)$")
_RUN_JOB_PROGRESS_RE = re.compile(r"^runs/([^/]+)/jobs/([^/]+)/progress$")


class _Envelope(msgspec.Struct):
    """Just enough of an inbound frame to route it; every other field is skipped."""

    type: Any = None
    requestId: Any = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_json_encoder = msgspec.json.Encoder()


@dataclass(eq=False)
class Job:
    """One queued or claimed Job (in memory only)."""

    id: str
    owner: str
    project: str
    needs: list[str]
    agent_definition: dict[str, Any]
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
                    await send_ch.send((text, at))
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
        self.session_idle_timeout = session_idle_timeout
        self.runner_wait_timeout = runner_wait_timeout
        self.keepalive_interval = keepalive_interval
        self.max_body = max_body
        self.jobs: dict[str, Job] = {}
        self.faults: dict[str, list[int]] = {route: [] for route in ROUTES}
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
    ) -> Job:
        """Queue a Job for ``owner/project`` and tell every events subscriber of that project."""
        job = Job(
            id=str(uuid.uuid4()),
            owner=owner,
            project=project,
            needs=list(needs),
            agent_definition=dict(agent_definition) if agent_definition is not None else {},
        )
        self.jobs[job.id] = job
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
        job.cancel_reason = reason
        if job.claimed_by is None:
            del self.jobs[job_id]
            job.cancelled = True
            self._notify_channel_change()
            return
        await self.end_job(job_id, reason)
        job.cancelled = True
        self._notify_channel_change()

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
            if last is not None and now - last <= self.offline_after:
                continue
            report = {
                "status": "completed",
                "conclusion": "failure",
                "logs": "runner offline",
                "forced": True,
            }
            job.reports.append(report)
            job.status = "completed"
            job.conclusion = "failure"
            job.completed.set()
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

    def _take_fault(self, route: str) -> int | None:
        codes = self.faults.get(route)
        if codes:
            return codes.pop(0)
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
            if fault is not None:
                await _send_json(send, fault, {"error": "injected"})
                return
            await handler(scope, receive, send, owner, project, *rm.groups())
            return
        raise _HTTPError(404, "not found")

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
        self._runner(scope, owner, project)
        capabilities = set(_string_list(_json_object(body), "capabilities", required=True))
        jobs = [
            job.to_json()
            for job in self.jobs.values()
            if job.owner == owner
            and job.project == project
            and job.status == "queued"
            and job.claimed_by is None
            and not job.cancelled
            and set(job.needs) <= capabilities
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
        if job.claimed_by is not None or job.status != "queued" or job.cancelled:
            raise _HTTPError(409, "this job is already claimed")
        job.claimed_by = runner.id
        job.runner_name = name
        job.run_id = str(uuid.uuid4())
        job.claimed.set()
        await _send_json(send, 200, {"runId": job.run_id})

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
        body = await _read_body(receive, self.max_body)
        runner = self._runner(scope, owner, project)
        job = self._own_job(runner, owner, project, run_id, job_id)
        obj = _json_object(body)
        job.reports.append(obj)
        status = obj.get("status")
        if status == "in_progress":
            if job.status == "completed":
                raise _HTTPError(409, "this job is already completed")
            job.status = "in_progress"
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
            job.completed.set()
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
        body = await _read_body(receive, self.max_body)
        runner = self._runner(scope, owner, project)
        job = self._own_job(runner, owner, project, run_id, job_id)
        obj = _json_object(body)
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
            await self._reject_ws(send, fault, {"error": "injected"})
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


def _hypercorn_config(hub: Hub, host: str, port: int) -> hypercorn.config.Config:
    config = hypercorn.config.Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("gateway.hub.server")
    config.websocket_max_message_size = hub.max_body
    config.graceful_timeout = 1.0
    return config


async def serve_hub(
    hub: Hub,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``hub`` on ``host:port`` (0 = a free port) until cancelled; ``started`` gets the base URL."""
    config = _hypercorn_config(hub, host, port)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.watch_offline)
        frontdoor = _frontdoor_module()
        run = getattr(frontdoor, "run", None) if frontdoor is not None else None
        if run is not None:
            nursery.start_soon(run, hub)
        binds: list[str] = await nursery.start(
            partial(hypercorn.trio.serve, hub.app, config, mode="asgi")
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
