"""The front door's handlers: the API key, then a chat turn or the models."""

from __future__ import annotations

import logging
import math
import time
import uuid

import trio

from gateway.hub import turns
from gateway.hub.board import JobBoard
from gateway.hub.channel import Channels, ServerChannel
from gateway.hub.counters import HubCounters
from gateway.hub.frontdoor import dialects, messages
from gateway.hub.frontdoor.models import Models
from gateway.hub.frontdoor.relay import (
    DONE,
    ERROR,
    LOST,
    OVERRUN,
    StreamSink,
    Turn,
    TurnLost,
    relay_stream,
    relay_whole,
    request_frame,
    send_cancel,
    stream_headers,
)
from gateway.hub.frontdoor.sessions import Keepalive, Session, Sessions
from gateway.hub.frontdoor.shapes import (
    SSE_HEADERS,
    channel_lost,
    invalid_key,
    model_list,
    model_not_found,
    model_object,
    no_key,
    parse_chat_request,
)
from gateway.hub.http import ClientGone, HTTPError, Request, Response, bearer, header
from gateway.hub.settings import HubSettings
from gateway.hub.store import ApiKey, Store
from gateway.hub.turns import TurnRecord
from gateway.hub.usage import UsageBook
from gateway.wire.traceparent import valid_traceparent

log = logging.getLogger("gateway.hub.frontdoor")

SESSION_HEADER = b"x-chat-session"
CLAUDE_SESSION_HEADER = b"x-claude-code-session-id"  # Claude Code's own session id
SERVED = (
    "POST /v1/chat/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/models",
)
DEFAULT_SESSION = "default"
MAX_ATTEMPTS = 3  # channels a turn may lose before it answers with an error
KEY_CACHE = 10_000  # API key answers kept at most
_OUTCOME_OF_STATE = {
    DONE: turns.OK,
    ERROR: turns.ERROR,
    LOST: turns.LOST,
    OVERRUN: turns.CLIENT_GONE,
}


class FrontDoor:
    """The ``/v1`` routes of one hub: chat completions, Anthropic Messages, the Responses API
    (one chat turn each), and the models."""

    def __init__(
        self,
        store: Store,
        settings: HubSettings,
        board: JobBoard,
        channels: Channels,
        counters: HubCounters,
    ) -> None:
        self.store = store
        self.settings = settings
        self.counters = counters
        self._keys: dict[str, tuple[ApiKey | None, float]] = {}  # token -> (key, valid until)
        self.usage = UsageBook(store, settings)
        self.sessions = Sessions(store, settings, board, channels, counters)
        self.sessions.on_key_check = self._keep_active
        self.models = Models(store, settings, board, channels, self.sessions)

    async def check_key(self, token: str) -> ApiKey | None:
        """The active API key ``token`` is, or None: from the store, the answer kept for
        ``key_check_interval`` s (a key revoked by another process is refused within that, as
        its sessions end; one revoked here is refused at once: ``forget_keys``)."""
        now = trio.current_time()
        kept = self._keys.get(token)
        if kept is not None and kept[1] > now:
            return kept[0]
        key = await self.store.check_api_key(token)
        if len(self._keys) >= KEY_CACHE:  # bounded: a flood of wrong keys cannot grow it
            self._keys.clear()
        self._keys[token] = (key, now + self.settings.key_check_interval)
        return key

    def forget_keys(self) -> None:
        """Drop the kept answers (a key was revoked or created in this process)."""
        self._keys.clear()

    def _keep_active(self, active: set[str]) -> None:
        """The sessions' key check found these keys active: drop what was kept of any other."""
        for token, (key, _until) in list(self._keys.items()):
            if key is not None and key.id not in active:
                del self._keys[token]

    async def restore(self) -> None:
        """Reload the stored sessions (before serving)."""
        await self.sessions.restore()

    async def run(self) -> None:
        """The front door's background work (idle sessions, draining channels), until cancelled."""
        await self.sessions.run()

    async def _key(self, req: Request) -> ApiKey:
        if header(req.scope, b"authorization") is None:
            raise no_key()
        token = bearer(req.scope)
        key = await self.check_key(token) if token else None
        if key is None:
            raise invalid_key()
        return key

    # -- /v1/models --------------------------------------------------------------------

    async def list_models(self, req: Request) -> None:
        key = await self._key(req)
        models = await self.models.listing(key.owner, key.project)
        await req.resp.json(200, model_list(models, int(time.time())))

    async def retrieve_model(self, req: Request) -> None:
        key = await self._key(req)
        model_id = req.params["model"]
        if model_id not in await self.models.listing(key.owner, key.project):
            raise model_not_found(model_id)
        await req.resp.json(200, model_object(model_id, int(time.time())))

    # -- /v1/chat/completions --------------------------------------------------------------

    async def chat(self, req: Request) -> None:
        """One chat turn: cancelled (``chat.completion.cancel`` to the runner) if the client leaves."""
        key = await self._key(req)
        text, stream, model = parse_chat_request(await req.body(self.settings.max_body))
        mapped = await self._model_for(key, model)
        if mapped is not None and mapped != model:  # the hub's default_model for an unknown one
            text = dialects.with_model(text.encode(), mapped).decode()
        turn = dialects.chat_turn(text, stream, mapped or model, self.settings.count_usage)
        await self._serve(req, key, turn, _session_id(req))

    async def messages(self, req: Request) -> None:
        """``POST /v1/messages`` (Anthropic Messages): translated to one chat turn, the answer
        translated back; every error in Anthropic's shape."""
        try:
            key = await self._anthropic_key(req)
            request = dialects.messages_request(await req.body(self.settings.max_body))
            model = await self._model_for(key, request.model)
            turn = dialects.messages_turn(request, model, request.model or model or "")
        except HTTPError as err:
            await req.resp.whole(err.status, dialects.anthropic_error_body(err), err.headers)
            return
        sid = _session_id(req) or _header_text(req, CLAUDE_SESSION_HEADER)
        await self._serve(req, key, turn, sid)

    async def count_tokens(self, req: Request) -> None:
        """``POST /v1/messages/count_tokens``: an estimate (characters / 4, images 1,600 each:
        the hub has no tokenizer of the runners' models)."""
        try:
            await self._anthropic_key(req)
            body = await req.body(self.settings.max_body)
            try:
                tokens = messages.count_tokens(body)
            except messages.MessagesError as exc:
                raise HTTPError(exc.status, exc.message, None, type_=exc.type) from None
        except HTTPError as err:
            await req.resp.whole(err.status, dialects.anthropic_error_body(err), err.headers)
            return
        await req.resp.json(200, {"input_tokens": tokens})

    async def responses(self, req: Request) -> None:
        """``POST /v1/responses`` (OpenAI Responses API): translated to one chat turn, the
        answer translated back."""
        key = await self._key(req)
        request = dialects.responses_request(await req.body(self.settings.max_body))
        model = await self._model_for(key, request.model)
        turn = dialects.responses_turn(request, model, request.model or model or "")
        await self._serve(req, key, turn, _session_id(req))

    async def not_served(self, req: Request) -> None:
        """``/v1/completions``, ``/v1/embeddings``: the channel carries chat turns only."""
        raise HTTPError(
            404,
            f"{req.scope['path']} is not served by this hub (its runners carry chat turns "
            f"only); it serves {', '.join(SERVED)}",
            "unknown_url",
        )

    async def _anthropic_key(self, req: Request) -> ApiKey:
        """The API key of ``x-api-key`` or ``Authorization: Bearer`` (Anthropic's clients send
        the first); HTTPError 401 with Anthropic's ``authentication_error``."""
        raw = header(req.scope, b"x-api-key")
        token = raw.decode("latin-1").strip() if raw else bearer(req.scope)
        if not token:
            raise HTTPError(401, "x-api-key header is required", None, type_="authentication_error")
        key = await self.check_key(token)
        if key is None:
            raise HTTPError(401, "invalid x-api-key", None, type_="authentication_error")
        return key

    async def _model_for(self, key: ApiKey, model: str | None) -> str | None:
        """The model the runner is asked for: ``model`` when a runner of the project lists it
        (or the lists are not known), else the hub's ``default_model`` when one is set (a client
        with fixed model names: Claude Code), else 404 before any job is opened."""
        if model is None:
            return self.settings.default_model
        available = await self.models.unknown(key.owner, key.project, model)
        if available is None and self.settings.default_model:
            if await self.models.known(key.owner, key.project) is None:
                await self.models.listing(key.owner, key.project)  # learn them first
            available = await self.models.unknown(key.owner, key.project, model)
        if available is None:
            return None  # as the client asked
        if self.settings.default_model:
            return self.settings.default_model
        raise model_not_found(model, available)

    async def _serve(self, req: Request, key: ApiKey, turn: dialects.Turn, sid: str) -> None:
        """Serve one turn of the key's session ``sid``: cancelled (``chat.completion.cancel``
        to the runner) if the client leaves; accounted for in the usage book."""
        record = TurnRecord(
            key.id,
            key.name,
            sid or DEFAULT_SESSION,
            turn.api,
            turn.model,
            turn.stream,
            trio.current_time(),
        )
        try:
            await self.usage.admit(record)  # a limit of the key: 429 in the caller's shape
        except HTTPError as err:
            # never in flight nor in the book (no store write per refused request): only the
            # observers are told (the metrics count a 429 as a limit refusal)
            record.outcome = turns.REFUSED
            record.extra["status"] = err.status
            record.ended = trio.current_time()
            for observe in self.usage.observers:
                observe(record)
            await req.resp.whole(err.status, turn.error_body(err), err.headers)
            return
        self.usage.started(record)
        gone = False
        try:
            try:
                session = await self.sessions.enter(key, sid or DEFAULT_SESSION)
            except HTTPError as err:  # too many sessions for the key (429)
                record.extra["status"] = err.status
                raise
            traceparent = _traceparent(req)
            try:
                with trio.CancelScope() as turn_scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_watch_disconnect, req, turn_scope)
                        try:
                            await self._turn(session, turn, req.resp, traceparent, record)
                        finally:
                            nursery.cancel_scope.cancel()
                gone = turn_scope.cancelled_caught
                if gone:
                    log.info("client of session %s disconnected", session.name)
            finally:
                self.sessions.leave(session)
        finally:
            record.ended = trio.current_time()
            if gone or req.resp.gone:
                record.outcome = turns.CLIENT_GONE
            elif record.outcome is None:
                record.outcome = turns.REFUSED if record.runner_id is None else turns.LOST
            self.usage.ended(record)

    async def _turn(
        self,
        session: Session,
        turn: dialects.Turn,
        resp: Response,
        traceparent: str | None = None,
        record: TurnRecord | None = None,
    ) -> None:
        """Serve one turn; a channel lost before the client got anything moves the turn (the
        same job redialled, else a new one: ``Sessions.channel_of``), up to ``MAX_ATTEMPTS``.
        A ``traceparent`` goes into the definition of a job this turn opens, else into the
        turn's frame (docs/protocol.md §6)."""
        translation = turn.new_stream() if turn.stream else None
        patience = _keepalive(resp, translation) if translation is not None else None
        try:
            arrived = trio.current_time()
            for attempt in range(1, MAX_ATTEMPTS + 1):
                async with session.lock:
                    if session.failure is not None and session.failure[0] >= arrived:
                        raise session.failure[1].copy()
                    job_before = session.job_id
                    try:
                        job_id, ch = await self.sessions.channel_of(session, traceparent, patience)
                    except HTTPError as err:
                        session.failure = (trio.current_time(), err)
                        raise
                in_frame = traceparent if job_id == job_before else None
                try:
                    await self._attempt(job_id, ch, turn, translation, resp, in_frame, record)
                    return
                except TurnLost:
                    log.warning(
                        "job %s: channel lost before request sent anything (attempt %d of %d)",
                        job_id,
                        attempt,
                        MAX_ATTEMPTS,
                    )
            raise channel_lost(f"the chat channel was lost {MAX_ATTEMPTS} times before an answer")
        except HTTPError as err:
            if record is not None:
                record.outcome = turns.REFUSED if record.runner_id is None else turns.ERROR
                record.extra["status"] = err.status
            try:
                if not resp.started:
                    await resp.whole(err.status, turn.error_body(err), err.headers)
                elif not resp.finished and translation is not None:
                    # only keepalive comments went out: end with the error
                    await resp.body(translation.error(err.message, err.code or "error"), False)
            except ClientGone:
                pass
        except ClientGone:
            pass

    async def _attempt(
        self,
        job_id: str,
        ch: ServerChannel,
        spec: dialects.Turn,
        translation: dialects.Translation | None,
        resp: Response,
        traceparent: str | None = None,
        record: TurnRecord | None = None,
    ) -> None:
        """The turn on one channel: the request frame, the replies relayed; TurnLost when the
        channel ends before the client got anything."""
        turn = Turn(job_id, uuid.uuid4().hex, ch)
        if record is not None:
            record.runner_id, record.job_id = ch.runner_id, job_id
        first_within = (
            math.inf if self.settings.ping_interval > 0 else self.settings.first_frame_timeout
        )
        sink: StreamSink | None = None
        rx = None
        if translation is not None:
            sink = StreamSink(
                resp,
                stream_headers(turn.rid),
                self.settings.client_backlog,
                translation,
                record,
                spec.strip_usage,
            )
            ch.open_turn(turn.rid, sink)
        else:
            rx = ch.open_request(turn.rid)
        try:
            try:
                await ch.send(request_frame(job_id, turn.rid, spec.body, traceparent))
            except Exception as exc:  # the socket broke under the send: the channel is gone
                turn.lost = True
                log.warning("could not send a turn on job %s: %r", job_id, exc)
                raise TurnLost() from None
            if sink is not None:
                await relay_stream(
                    turn,
                    sink,
                    resp,
                    self.settings.keepalive_interval,
                    first_within,
                    self.counters,
                )
                if record is not None:
                    record.outcome = _OUTCOME_OF_STATE.get(sink.state)
            else:
                assert rx is not None
                await relay_whole(turn, rx, resp, first_within, spec.fold, record)
                if record is not None:
                    record.outcome = turns.OK
        finally:
            if not turn.finished and not turn.lost and not ch.closed.is_set():
                await send_cancel(turn)
            ch.close_request(turn.rid)


def _header_text(req: Request, name: bytes) -> str:
    raw = header(req.scope, name)
    return raw.decode("latin-1").strip() if raw else ""


def _session_id(req: Request) -> str:
    """The ``X-Chat-Session`` header ("" without one)."""
    return _header_text(req, SESSION_HEADER)


def _traceparent(req: Request) -> str | None:
    """The request's W3C ``traceparent`` header when well-formed (tracing: passed on to the
    runner in the Chat Job's definition or the turn's frame), else None."""
    raw = header(req.scope, b"traceparent")
    return valid_traceparent(raw.decode("latin-1")) if raw else None


def _keepalive(resp: Response, translation: dialects.Translation) -> Keepalive:
    """Keeps a streamed turn's client patient while it waits in the queue: the stream's head
    (without x-request-id: no request exists yet), then a keepalive in the client's API."""

    async def keepalive() -> None:
        if not resp.started:
            resp.start_nowait(200, SSE_HEADERS)
        await resp.body(translation.keepalive())

    return keepalive


async def _watch_disconnect(req: Request, scope: trio.CancelScope) -> None:
    while True:
        message = await req.receive()
        if message["type"] == "http.disconnect":
            req.resp.gone = True
            scope.cancel()
            return
