"""The hub's OpenAI-compatible front door: serves ``/v1/*`` by relaying each chat turn down a session's Chat Channel.

The session -> Chat Job mapping is kept in the hub's store too: after a restart (``restore``) a
client's next turn on the same ``X-Chat-Session`` goes to the same job once its runner redials.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from gateway import protocol
from gateway.hub.store import StoredSession

if TYPE_CHECKING:
    from gateway.hub.core import Hub, ServerChannel

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Tunables the core's Hub does not carry (a Hub attribute of the same name wins).
DEFAULT_RECONNECT_TIMEOUT = 10.0  # s: a later turn waits at most this long for a dropped channel
DEFAULT_MODELS_TIMEOUT = 3.0  # s: how long /v1/models waits for the runners' answers
CANCEL_SEND_TIMEOUT = 2.0  # s: bound on sending chat.completion.cancel during cleanup

CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
SESSION_HEADER = b"x-chat-session"
DEFAULT_SESSION = "default"
OWNED_BY = "alp-runner"

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_DONE_EVENT = b"data: [DONE]\n\n"
_KEEPALIVE = b": keepalive\n\n"


# -- settings ---------------------------------------------------------------


def _reconnect_timeout(hub: Hub) -> float:
    value = getattr(hub, "reconnect_timeout", None)
    if value is not None:
        return float(value)
    return min(DEFAULT_RECONNECT_TIMEOUT, hub.runner_wait_timeout)


def _models_timeout(hub: Hub) -> float:
    value = getattr(hub, "models_timeout", None)
    return DEFAULT_MODELS_TIMEOUT if value is None else float(value)


# -- errors and responses -----------------------------------------------------


class HTTPError(Exception):
    """An OpenAI-shaped error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.headers = headers or []


def error_object(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class _ClientGone(Exception):
    """Sending to the HTTP client failed: it has disconnected."""


class _Response:
    """One ASGI HTTP response, remembering how far it got."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.gone = False

    async def _emit(self, message: Message) -> None:
        if self.gone:
            raise _ClientGone()
        try:
            await self._send(message)
        except Exception as exc:  # hypercorn raises on send after the client went away
            self.gone = True
            log.debug("send to the HTTP client failed: %r", exc)
            raise _ClientGone() from exc

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._emit({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = True) -> None:
        if not more:
            self.finished = True
        await self._emit({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(
        self, status: int, data: bytes, headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        head = [_JSON, (b"content-length", str(len(data)).encode())]
        await self.start(status, head + (headers or []))
        await self.body(data, more=False)

    async def error(self, err: HTTPError) -> None:
        data = msgspec.json.encode(error_object(err.message, err.type, err.code))
        await self.whole(err.status, data, err.headers)


# -- sessions -----------------------------------------------------------------


@dataclass(eq=False)
class _Session:
    """One chat session: (API key name, X-Chat-Session) -> its Chat Job."""

    key: tuple[str, str]
    owner: str
    project: str
    lock: trio.Lock = field(default_factory=trio.Lock)
    job_id: str | None = None
    turns: int = 0  # requests in flight (waiting for the channel or relaying)
    last_used: float = field(default_factory=trio.current_time)
    # the last failed attempt to get a channel (when, why): requests that queued on the
    # lock behind it share its answer instead of each waiting out another timeout
    failure: tuple[float, HTTPError] | None = None


class _Door:
    """Per-hub front door state: the sessions, the channels it drains, a wake-up for ``run``."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], _Session] = {}
        self.changed = trio.Event()
        self.drained: set[ServerChannel] = set()  # channels whose recv() a drain task reads
        self.to_drain: list[ServerChannel] = []  # adopted, their drain task not started yet
        self.ended_by_runner: set[str] = set()  # job ids whose runner sent chat.end
        self.restored = False  # the stored sessions were loaded (once per hub)

    def poke(self) -> None:
        self.changed.set()

    def adopt(self, ch: ServerChannel) -> None:
        """Have ``run`` read the channel's unrouted frames (late replies, the runner's chat.end)."""
        if ch not in self.drained and not ch.closed.is_set():
            self.drained.add(ch)
            self.to_drain.append(ch)
            self.poke()


_doors: weakref.WeakKeyDictionary[Hub, _Door] = weakref.WeakKeyDictionary()


def _door(hub: Hub) -> _Door:
    """The front door state of ``hub`` (kept here, so the core's Hub needs no field for it)."""
    door = _doors.get(hub)
    if door is None:
        door = _doors[hub] = _Door()
    return door


def sessions(hub: Hub) -> dict[tuple[str, str], str | None]:
    """The live sessions: (API key name, session id) -> job id (for tests and status)."""
    return {key: s.job_id for key, s in _door(hub).sessions.items()}


def _bind(hub: Hub, session: _Session, job_id: str | None) -> None:
    """Point the session at ``job_id`` (None: at no job), in memory and in the store."""
    session.job_id = job_id
    if job_id is None:
        hub.store.delete_session(*session.key)
    else:
        stored = StoredSession(
            session.key[0], session.key[1], session.owner, session.project, job_id
        )
        hub.store.save_session(stored)


def _forget(hub: Hub, door: _Door, key: tuple[str, str]) -> None:
    door.sessions.pop(key, None)
    hub.store.delete_session(*key)


def restore(hub: Hub) -> None:
    """Reload the stored sessions whose job can still serve (once per hub, before serving).

    A front-door job that no stored session points at lost its client in the restart: it is
    withdrawn, so its runner's redial is refused and the runner reports the job's outcome.
    """
    door = _door(hub)
    if door.restored:
        return
    door.restored = True
    now = trio.current_time()
    live: set[str] = set()
    for stored in hub.store.load_sessions():
        key = (stored.key_name, stored.session_id)
        if key in door.sessions or _job_over(hub, stored.job_id):
            if key not in door.sessions:
                hub.store.delete_session(*key)
            continue
        door.sessions[key] = _Session(
            key, stored.owner, stored.project, job_id=stored.job_id, last_used=now
        )
        live.add(stored.job_id)
    for job in list(hub.jobs.values()):
        if job.origin == "frontdoor" and job.id not in live and not _job_over(hub, job.id):
            hub.withdraw_job(job.id, "its chat session was lost in a hub restart")
    if door.sessions:
        log.info("restored %d chat session(s)", len(door.sessions))


def _job_over(hub: Hub, job_id: str) -> bool:
    """True when no further turn can be served by this job (completed, cancelled, ended)."""
    job = hub.jobs.get(job_id)
    if job is None or job.cancelled or job.status == "completed" or job.completed.is_set():
        return True
    return job_id in _door(hub).ended_by_runner


async def _session_channel(hub: Hub, session: _Session) -> tuple[str, ServerChannel]:
    """The session's (job id, open channel), opening a Chat Job when it has none. Lock held."""
    door = _door(hub)
    if session.job_id is not None and _job_over(hub, session.job_id):
        _bind(hub, session, None)  # the runner ended it: this turn opens a new job
    if session.job_id is not None:
        job_id = session.job_id
        ch = hub.channel(job_id)
        if ch is None:  # momentarily reconnecting: wait, bounded (None at once if the job ends)
            within = _reconnect_timeout(hub)
            ch = await hub.wait_channel(job_id, within)
            if ch is None:
                _bind(hub, session, None)
                if not _job_over(hub, job_id):
                    with trio.CancelScope(shield=True):
                        await hub.cancel_job(job_id, "channel lost")
                    log.warning("job %s: channel did not reconnect within %g s", job_id, within)
                    raise HTTPError(
                        503,
                        f"the chat channel of this session was lost and did not reconnect within {within:g} s",
                        "service_unavailable",
                        "channel_lost",
                    )
        if ch is not None:
            door.adopt(ch)
            return job_id, ch
    within = hub.runner_wait_timeout
    job = hub.enqueue_job(
        session.owner,
        session.project,
        needs=[protocol.CAPABILITY],
        agent_definition={"jobType": "chat_llm", "needs": [protocol.CAPABILITY]},
        origin="frontdoor",
    )
    ch = None
    try:
        ch = await hub.wait_channel(job.id, within)
    finally:
        if ch is None:
            with trio.CancelScope(shield=True):
                await hub.cancel_job(job.id, "no runner")
    if ch is None:
        log.warning(
            "no runner with %s connected within %g s (job %s)", protocol.CAPABILITY, within, job.id
        )
        raise HTTPError(
            503,
            f"no runner with {protocol.CAPABILITY} connected within {within:g} s",
            "service_unavailable",
            "no_runner",
        )
    _bind(hub, session, job.id)
    door.adopt(ch)
    log.info("session %s/%s opened chat job %s", session.key[0], session.key[1], job.id)
    return job.id, ch


async def _drain(hub: Hub, ch: ServerChannel) -> None:
    """Read a channel's unrouted frames until it closes: note a runner's chat.end, log the rest."""
    door = _door(hub)
    try:
        while True:
            try:
                text, _t_recv = await ch.recv()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return
            try:
                reply = _reply_decoder.decode(text)
            except msgspec.DecodeError:
                log.debug("job %s: ignoring an undecodable frame", ch.job_id)
                continue
            if reply.type == protocol.END:
                log.info("job %s: the runner ended the session (%s)", ch.job_id, reply.reason)
                door.ended_by_runner.add(ch.job_id)
                door.poke()
            else:
                log.debug("job %s: late or unrouted %s frame", ch.job_id, reply.type)
    finally:
        door.drained.discard(ch)


async def _reap(hub: Hub, door: _Door) -> float:
    """Forget finished sessions, end idle ones; returns when the next one falls due."""
    idle = hub.session_idle_timeout
    now = trio.current_time()
    next_due = math.inf
    for key, session in list(door.sessions.items()):
        if door.sessions.get(key) is not session or session.turns or session.lock.locked():
            continue  # replaced while we awaited, or busy
        if session.job_id is None or _job_over(hub, session.job_id):
            _forget(hub, door, key)
            continue
        due = session.last_used + idle if idle and idle > 0 else math.inf
        if due > now:
            next_due = min(next_due, due)
            continue
        _forget(hub, door, key)
        log.info("session %s/%s idle for %g s: ending job %s", key[0], key[1], idle, session.job_id)
        try:
            await hub.end_job(session.job_id, "idle")
        except Exception as exc:
            log.warning("could not end idle job %s: %r", session.job_id, exc)
    door.ended_by_runner.intersection_update(s.job_id for s in door.sessions.values())
    return next_due


async def run(hub: Hub) -> None:
    """Background work: end idle sessions with ``chat.end`` ("idle"), forget finished ones, drain channels."""
    door = _door(hub)
    async with trio.open_nursery() as nursery:
        while True:
            door.changed = trio.Event()
            while door.to_drain:
                nursery.start_soon(_drain, hub, door.to_drain.pop())
            next_due = await _reap(hub, door)
            if door.changed.is_set():
                continue
            with trio.move_on_at(next_due):
                await door.changed.wait()


# -- request parsing ------------------------------------------------------------


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


def _authenticate(hub: Hub, scope: Scope) -> Any:
    raw = _header(scope, b"authorization")
    if raw is None:
        raise HTTPError(
            401,
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            "invalid_request_error",
            "invalid_api_key",
        )
    scheme, _, token = raw.decode("latin-1").strip().partition(" ")
    token = token.strip()
    key = hub.check_api_key(token) if scheme.lower() == "bearer" and token else None
    if key is None:
        raise HTTPError(
            401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key"
        )
    return key


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    declared = _header(scope, b"content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _too_large(limit: int) -> HTTPError:
    return HTTPError(
        413, f"request body exceeds {limit} bytes", "invalid_request_error", "request_too_large"
    )


class _ChatBody(msgspec.Struct):
    """What the front door checks in a chat-completions body (the rest is passed on unread)."""

    messages: list[msgspec.Raw]
    stream: bool | None = None


_chat_body_decoder = msgspec.json.Decoder(_ChatBody)


def _parse_chat_body(body: bytes) -> tuple[str, bool]:
    """(body as text, stream?) for a valid chat-completions body; HTTPError 400 otherwise."""
    if not body.strip():
        raise HTTPError(
            400,
            "We could not parse the JSON body of your request: it is empty.",
            "invalid_request_error",
            "invalid_json",
        )
    try:
        parsed = _chat_body_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise HTTPError(
            400,
            f"Invalid chat completions request: {exc}",
            "invalid_request_error",
            "invalid_request",
        ) from None
    except msgspec.DecodeError as exc:
        raise HTTPError(
            400,
            f"We could not parse the JSON body of your request: {exc}",
            "invalid_request_error",
            "invalid_json",
        ) from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPError(
            400,
            "We could not parse the JSON body of your request: it is not UTF-8.",
            "invalid_request_error",
            "invalid_json",
        ) from None
    return text, bool(parsed.stream)


# -- inbound frames -------------------------------------------------------------


class _Reply(msgspec.Struct):
    """A runner frame routed to one request; ``chunk`` stays raw bytes, never re-encoded."""

    type: str
    chunk: msgspec.Raw = msgspec.Raw(b"")
    error: Any = None
    models: Any = None
    reason: Any = None


_reply_decoder = msgspec.json.Decoder(_Reply)


async def _next_reply(rx: trio.MemoryReceiveChannel[tuple[str, float]]) -> _Reply | None:
    """The next decodable frame for a request; None when the channel ended."""
    while True:
        try:
            text, _t_recv = await rx.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        try:
            return _reply_decoder.decode(text)
        except msgspec.DecodeError:
            log.warning("ignoring an undecodable frame from the runner: %.200s", text)


def _error_text(reply: _Reply) -> str:
    if isinstance(reply.error, str) and reply.error:
        return reply.error
    if reply.error is None:
        return "the runner reported an error"
    return msgspec.json.encode(reply.error).decode()


# -- the chat turn ----------------------------------------------------------------


@dataclass
class _Turn:
    """One relayed request: which channel, which request id, and how it ended."""

    job_id: str
    rid: str
    ch: ServerChannel
    finished: bool = False  # done/error received: nothing to cancel
    lost: bool = False  # the channel ended under the turn


def _request_frame(job_id: str, rid: str, body: str) -> str:
    head = protocol.encode({"type": protocol.COMPLETION_REQUEST, "jobId": job_id, "requestId": rid})
    return head[:-1] + ',"body":' + body + "}"


async def _chat(hub: Hub, key: Any, scope: Scope, receive: Receive, resp: _Response) -> None:
    limit = hub.max_body
    body = await _read_body(scope, receive, limit)
    text, stream = _parse_chat_body(body)
    raw_sid = _header(scope, SESSION_HEADER)
    sid = raw_sid.decode("latin-1").strip() if raw_sid else ""
    skey = (key.name, sid or DEFAULT_SESSION)

    door = _door(hub)
    session = door.sessions.get(skey)
    if session is None:
        session = door.sessions[skey] = _Session(skey, key.owner, key.project)
    session.turns += 1
    try:
        with trio.CancelScope() as turn_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch_disconnect, receive, resp, turn_scope)
                try:
                    await _serve_turn(hub, session, text, stream, resp)
                finally:
                    nursery.cancel_scope.cancel()
        if turn_scope.cancelled_caught:
            log.info("client of session %s/%s disconnected", skey[0], skey[1])
    finally:
        session.turns -= 1
        session.last_used = trio.current_time()
        if session.job_id is None and not session.turns and door.sessions.get(skey) is session:
            del door.sessions[skey]
        door.poke()


async def _watch_disconnect(receive: Receive, resp: _Response, scope: trio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            resp.gone = True
            scope.cancel()
            return


async def _serve_turn(
    hub: Hub, session: _Session, body: str, stream: bool, resp: _Response
) -> None:
    try:
        arrived = trio.current_time()
        async with session.lock:
            if session.failure is not None and session.failure[0] >= arrived:
                err = session.failure[1]
                raise HTTPError(err.status, err.message, err.type, err.code, err.headers)
            try:
                job_id, ch = await _session_channel(hub, session)
            except HTTPError as err:
                session.failure = (trio.current_time(), err)
                raise
        turn = _Turn(job_id, uuid.uuid4().hex, ch)
        rx = ch.open_request(turn.rid)
        try:
            try:
                await ch.send(_request_frame(job_id, turn.rid, body))
            except Exception as exc:
                turn.lost = True
                log.warning("could not send a turn on job %s: %r", job_id, exc)
                raise HTTPError(
                    503,
                    "the chat channel was lost before the request could be sent",
                    "service_unavailable",
                    "channel_lost",
                ) from None
            if stream:
                await _relay_stream(hub, turn, rx, resp)
            else:
                await _relay_whole(turn, rx, resp)
        finally:
            if not turn.finished and not turn.lost:
                await _send_cancel(turn)
            ch.close_request(turn.rid)
    except HTTPError as err:
        if not resp.started:
            with contextlib.suppress(_ClientGone):
                await resp.error(err)
    except _ClientGone:
        pass


async def _send_cancel(turn: _Turn) -> None:
    frame = protocol.encode(
        {"type": protocol.COMPLETION_CANCEL, "jobId": turn.job_id, "requestId": turn.rid}
    )
    with trio.move_on_after(CANCEL_SEND_TIMEOUT) as scope:
        scope.shield = True
        try:
            await turn.ch.send(frame)
            log.info("sent chat.completion.cancel for request %s of job %s", turn.rid, turn.job_id)
        except Exception as exc:
            log.info("could not send chat.completion.cancel for request %s: %r", turn.rid, exc)


def _sse_data(chunk: msgspec.Raw) -> bytes:
    """One SSE event around a chunk's raw bytes (one copy, no parsing)."""
    event = b"data: " + chunk + b"\n\n"
    if b"\r" in event or event.find(b"\n", 0, len(event) - 2) >= 0:
        # a pretty-printed chunk: one data line per line (SSE joins them back with \n)
        lines = event[6:-2].replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return event


async def _relay_stream(
    hub: Hub, turn: _Turn, rx: trio.MemoryReceiveChannel[tuple[str, float]], resp: _Response
) -> None:
    """Relay a streamed turn as SSE. Chunk frames already queued when one is read go out with
    it, as one body write (nothing waits for more); a done frame right behind them ends it."""
    keepalive = hub.keepalive_interval
    headers = [*_SSE_HEADERS, (b"x-request-id", turn.rid.encode())]
    first_chunk = False
    pending: _Reply | None | object = _NOTHING  # a reply read ahead, to be handled next
    while True:
        if pending is not _NOTHING:
            reply, pending = pending, _NOTHING
        elif not first_chunk and keepalive > 0:
            with trio.move_on_after(keepalive) as wait:
                reply = await _next_reply(rx)
            if wait.cancelled_caught:  # nothing yet: keep the client (and proxies) patient
                if not resp.started:
                    await resp.start(200, headers)
                await resp.body(_KEEPALIVE)
                continue
        else:
            reply = await _next_reply(rx)
        if reply is None:
            turn.lost = True
            message = "the chat channel to the runner was lost mid-turn"
            log.warning("%s (job %s, request %s)", message, turn.job_id, turn.rid)
            if not resp.started:
                raise HTTPError(503, message, "service_unavailable", "channel_lost")
            await _stream_error(resp, message, "channel_lost")
            return
        assert isinstance(reply, _Reply)
        if reply.type == protocol.COMPLETION_CHUNK:
            events: list[bytes] = []
            while True:
                if len(reply.chunk):
                    events.append(_sse_data(reply.chunk))
                else:
                    log.warning("job %s: ignoring a chunk frame without a chunk", turn.job_id)
                pending = _queued_reply(rx)
                if pending is _NOTHING or pending is None:
                    break
                assert isinstance(pending, _Reply)
                if pending.type != protocol.COMPLETION_CHUNK:
                    break
                reply, pending = pending, _NOTHING
            if not events:
                continue
            if not resp.started:
                await resp.start(200, headers)
            first_chunk = True
            if isinstance(pending, _Reply) and pending.type == protocol.COMPLETION_DONE:
                turn.finished = True  # the last chunks and the end of the stream, in one write
                events.append(_DONE_EVENT)
                await resp.body(b"".join(events), more=False)
                return
            await resp.body(events[0] if len(events) == 1 else b"".join(events))
        elif reply.type == protocol.COMPLETION_DONE:
            turn.finished = True
            if not resp.started:
                await resp.start(200, headers)
            await resp.body(_DONE_EVENT, more=False)
            return
        elif reply.type == protocol.COMPLETION_ERROR:
            turn.finished = True
            message = _error_text(reply)
            log.info("runner error on job %s request %s: %s", turn.job_id, turn.rid, message)
            if not resp.started:
                raise HTTPError(502, message, "upstream_error", "upstream_error")
            await _stream_error(resp, message, "upstream_error")
            return


_NOTHING = object()  # no reply queued right now


def _queued_reply(rx: trio.MemoryReceiveChannel[tuple[str, float]]) -> _Reply | None | object:
    """The next decodable reply if one is queued already: ``_NOTHING`` if none is, None if the
    channel has ended (never waits)."""
    while True:
        try:
            text, _t_recv = rx.receive_nowait()
        except trio.WouldBlock:
            return _NOTHING
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return None
        try:
            return _reply_decoder.decode(text)
        except msgspec.DecodeError:
            log.warning("ignoring an undecodable frame from the runner: %.200s", text)


async def _stream_error(resp: _Response, message: str, code: str) -> None:
    event = msgspec.json.encode(error_object(message, "upstream_error", code))
    await resp.body(b"data: " + event + b"\n\n", more=False)


async def _relay_whole(
    turn: _Turn, rx: trio.MemoryReceiveChannel[tuple[str, float]], resp: _Response
) -> None:
    chunks: list[bytes] = []
    while True:
        reply = await _next_reply(rx)
        if reply is None:
            turn.lost = True
            log.warning("chat channel lost mid-turn (job %s, request %s)", turn.job_id, turn.rid)
            raise HTTPError(
                503,
                "the chat channel to the runner was lost mid-turn",
                "service_unavailable",
                "channel_lost",
            )
        if reply.type == protocol.COMPLETION_CHUNK and len(reply.chunk):
            chunks.append(bytes(reply.chunk))
        elif reply.type == protocol.COMPLETION_DONE:
            turn.finished = True
            break
        elif reply.type == protocol.COMPLETION_ERROR:
            turn.finished = True
            message = _error_text(reply)
            log.info("runner error on job %s request %s: %s", turn.job_id, turn.rid, message)
            raise HTTPError(502, message, "upstream_error", "upstream_error")
    if not chunks:
        raise HTTPError(
            502,
            "the runner finished the turn without a completion",
            "upstream_error",
            "empty_completion",
        )
    if len(chunks) == 1 and _object_kind(chunks[0]) != "chat.completion.chunk":
        data = chunks[0]  # the backend's own chat.completion, verbatim
    else:
        data = msgspec.json.encode(aggregate_chunks(chunks))
    await resp.whole(200, data, [(b"x-request-id", turn.rid.encode())])


class _Kind(msgspec.Struct):
    object: Any = None


_kind_decoder = msgspec.json.Decoder(_Kind)


def _object_kind(chunk: bytes) -> Any:
    try:
        return _kind_decoder.decode(chunk).object
    except msgspec.DecodeError:
        return None


# -- aggregation of streamed chunks into one chat.completion -------------------------

_SET_KEYS = frozenset({"role", "index", "type", "id"})


def _merge_tool_calls(into: list[dict[str, Any]], deltas: list[Any]) -> None:
    for position, delta in enumerate(deltas):
        if not isinstance(delta, dict):
            continue
        index = delta.get("index", position)
        target = next((tc for tc in into if tc.get("index") == index), None)
        if target is None:
            target = {"index": index}
            into.append(target)
        for key, value in delta.items():
            if value is None or key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                fn = target.setdefault("function", {})
                for fkey, fval in value.items():
                    if not isinstance(fval, str):
                        if fval is not None:
                            fn[fkey] = fval
                    elif fkey == "name" and fn.get("name") == fval:
                        continue  # a backend repeating the whole name in every delta
                    else:
                        fn[fkey] = fn.get(fkey, "") + fval
            else:
                target[key] = value


def _merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if value is None:
            continue
        if key == "tool_calls" and isinstance(value, list):
            _merge_tool_calls(message.setdefault("tool_calls", []), value)
        elif isinstance(value, str) and key not in _SET_KEYS:
            message[key] = (message.get(key) or "") + value
        else:
            message[key] = value


def aggregate_chunks(chunks: list[bytes]) -> dict[str, Any]:
    """Fold streamed ``chat.completion.chunk`` objects into one ``chat.completion`` object."""
    head: dict[str, Any] = {}
    usage: Any = None
    choices: dict[int, dict[str, Any]] = {}
    for raw in chunks:
        try:
            obj = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        for key in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if obj.get(key) is not None and key not in head:
                head[key] = obj[key]
        if obj.get("usage"):
            usage = obj["usage"]
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            target = choices.setdefault(
                index,
                {
                    "index": index,
                    "message": {"role": "assistant", "content": None},
                    "logprobs": None,
                    "finish_reason": None,
                },
            )
            delta = choice.get("delta", choice.get("message"))
            if isinstance(delta, dict):
                _merge_delta(target["message"], delta)
            if choice.get("finish_reason") is not None:
                target["finish_reason"] = choice["finish_reason"]
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                merged = target["logprobs"] or {}
                for key, value in logprobs.items():
                    if isinstance(value, list):
                        merged[key] = (merged.get(key) or []) + value
                target["logprobs"] = merged
    for choice in choices.values():
        calls = choice["message"].get("tool_calls")
        if calls:
            calls.sort(key=lambda tc: tc.get("index", 0))
            for call in calls:
                call.pop("index", None)
    return {
        "id": head.get("id", "chatcmpl-" + uuid.uuid4().hex),
        "object": "chat.completion",
        "created": head.get("created", int(time.time())),
        "model": head.get("model", ""),
        **(
            {"system_fingerprint": head["system_fingerprint"]}
            if "system_fingerprint" in head
            else {}
        ),
        **({"service_tier": head["service_tier"]} if "service_tier" in head else {}),
        "choices": [choices[i] for i in sorted(choices)],
        "usage": usage,
    }


# -- /v1/models -----------------------------------------------------------------------


def _channel_in_project(hub: Hub, ch: ServerChannel, owner: str, project: str) -> bool:
    job = hub.jobs.get(ch.job_id)
    return job is not None and job.owner == owner and job.project == project


def _model_ids(models: Any) -> list[str]:
    out: list[str] = []
    for item in models if isinstance(models, list) else []:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("id"), str):
            out.append(item["id"])
    return out


async def _ask_models(ch: ServerChannel, within: float, into: list[list[str]], slot: int) -> None:
    rid = uuid.uuid4().hex
    rx = ch.open_request(rid)
    try:
        with trio.move_on_after(within):
            await ch.send(
                protocol.encode(
                    {"type": protocol.MODELS_REQUEST, "jobId": ch.job_id, "requestId": rid}
                )
            )
            while True:
                reply = await _next_reply(rx)
                if reply is None:
                    return
                if reply.type == protocol.MODELS_RESPONSE:
                    into[slot] = _model_ids(reply.models)
                    return
    except Exception as exc:
        log.info("no models from the channel of job %s: %r", ch.job_id, exc)
    finally:
        ch.close_request(rid)


async def list_models(hub: Hub, owner: str, project: str) -> list[str]:
    """Every model id the open channels of ``owner/project`` can serve, deduplicated, in order."""
    channels = [ch for ch in hub.open_channels() if _channel_in_project(hub, ch, owner, project)]
    answers: list[list[str]] = [[] for _ in channels]
    timeout = _models_timeout(hub)
    async with trio.open_nursery() as nursery:
        for slot, ch in enumerate(channels):
            nursery.start_soon(_ask_models, ch, timeout, answers, slot)
    return list(dict.fromkeys(model for answer in answers for model in answer))


def _model_object(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY}


async def _models(hub: Hub, key: Any, model_id: str | None, resp: _Response) -> None:
    models = await list_models(hub, key.owner, key.project)
    created = int(time.time())
    if model_id is None:
        data = {"object": "list", "data": [_model_object(m, created) for m in models]}
        await resp.whole(200, msgspec.json.encode(data))
    elif model_id in models:
        await resp.whole(200, msgspec.json.encode(_model_object(model_id, created)))
    else:
        raise HTTPError(
            404,
            f"The model '{model_id}' does not exist",
            "invalid_request_error",
            "model_not_found",
        )


# -- the ASGI entry point ------------------------------------------------------------------


def _route(method: str, path: str) -> tuple[str, str | None]:
    """(route name, model id) for a /v1 path; HTTPError 404/405 when there is none."""
    path = path.rstrip("/") or path
    if path == CHAT_PATH:
        allowed, name, arg = "POST", "chat", None
    elif path == MODELS_PATH:
        allowed, name, arg = "GET", "models", None
    elif path.startswith(MODELS_PATH + "/") and len(path) > len(MODELS_PATH) + 1:
        allowed, name, arg = "GET", "model", path[len(MODELS_PATH) + 1 :]
    else:
        raise HTTPError(
            404, f"Invalid URL ({method} {path})", "invalid_request_error", "unknown_url"
        )
    if method != allowed:
        raise HTTPError(
            405,
            f"Method {method} is not allowed on {path}; use {allowed}",
            "invalid_request_error",
            "method_not_allowed",
            [(b"allow", allowed.encode())],
        )
    return name, arg


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one HTTP request under ``/v1/`` (called by the hub core's ASGI app)."""
    if scope.get("type") != "http":
        return
    resp = _Response(send)
    method = scope.get("method", "GET").upper()
    path = scope.get("path", "")
    try:
        name, arg = _route(method, path)
        key = _authenticate(hub, scope)
        if name == "chat":
            await _chat(hub, key, scope, receive, resp)
        else:
            await _models(hub, key, arg, resp)
    except HTTPError as err:
        if not resp.started:
            with contextlib.suppress(_ClientGone):
                await resp.error(err)
    except _ClientGone:
        return
    except Exception as exc:
        log.error("front door: unexpected error on %s %s: %r", method, path, exc, exc_info=True)
        with contextlib.suppress(_ClientGone):
            if not resp.started:
                await resp.error(_INTERNAL)
            elif not resp.finished:
                await resp.body(b"", more=False)


_INTERNAL = HTTPError(
    500, "internal error in the hub's front door", "server_error", "internal_error"
)
