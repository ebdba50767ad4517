"""One front-door turn served, from its admission to its end: its key's limits, its session, a
channel from the dispatcher, its request frame, its answer relayed (the turn writes it), and
another channel when the one it was on went before it sent anything. Domain refusals become
HTTP errors here, in the caller's API (``Turn.refuse``)."""

from __future__ import annotations

import itertools
import logging
import math
import uuid
from collections.abc import Awaitable, Callable

import msgspec
import trio

from gateway.apis.continuation import answer_so_far
from gateway.apis.dialects import TurnSpec
from gateway.apis.shapes import (
    channel_lost,
    embeddings_unsupported,
    model_not_found,
    no_capable_runner,
    no_runner,
    no_runner_connected,
    queue_full,
    queue_timeout,
    runner_busy,
    runner_gone,
    too_many_sessions,
)
from gateway.hub.accounting import Accounting, LimitExceeded
from gateway.hub.channel import ServerChannel
from gateway.hub.dispatcher import Dispatcher, Unplaced
from gateway.hub.dispatchplan import Refusal, Refuse
from gateway.hub.sessions import Session, Sessions, TooManySessions
from gateway.hub.settings import HubSettings
from gateway.hub.store import ApiKey
from gateway.hub.turn import Turn
from gateway.hub.turnstate import State, TurnLost, TurnSuspended
from gateway.wire import protocol
from gateway.wire.errors import HTTPError
from gateway.wire.http import Request, header

log = logging.getLogger("gateway.hub.serving")

DEFAULT_SESSION = "default"
MAX_ATTEMPTS = 3  # channels a turn may lose before it answers with an error
QUICK_DEATH = 1.0  # s: a broken channel's runner silent this long is taken for dead (``_resume``)
CANCEL_SEND_TIMEOUT = 2.0  # s: bound on sending chat.completion.cancel

# A turn's id (and its requests' on channels): 32 hex digits as a UUID's, unique across processes
# by the random half, in this one by the count (no urandom syscall per turn and per request)
_ID_PREFIX = uuid.uuid4().hex[:16]
_ids = itertools.count(1)


def new_id() -> str:
    """A fresh id for a turn or a request."""
    return f"{_ID_PREFIX}{next(_ids):016x}"


def limit_error(exc: LimitExceeded) -> HTTPError:
    """A key's limit passed: 429 with Retry-After (``budget_exceeded`` for a budget)."""
    return HTTPError(
        429,
        exc.message,
        "budget_exceeded" if exc.limit.startswith("budget") else "rate_limit_exceeded",
        type_="rate_limit_error",
        headers=[(b"retry-after", str(exc.retry_after).encode())],
    )


class Serving:
    """Serves the front door's turns (``serve``) with the hub's accounting, sessions and
    dispatcher."""

    def __init__(
        self,
        settings: HubSettings,
        accounting: Accounting,
        sessions: Sessions,
        dispatcher: Dispatcher,
        embeds: Callable[[ServerChannel], Awaitable[bool]] | None = None,
    ) -> None:
        self.settings = settings
        self.accounting = accounting
        self.sessions = sessions
        self.dispatcher = dispatcher
        # whether a channel's runner took up the embeddings extension (the catalog knows)
        self.embeds = embeds

    async def serve(
        self,
        req: Request,
        key: ApiKey,
        spec: TurnSpec,
        session_id: str,
        traceparent: str | None = None,
    ) -> None:
        """Serve one turn of the key's session ``session_id`` ("" for the default one)."""
        settings = self.settings
        turn = self.accounting.coordination.turn_type(
            new_id(),
            key.id,
            key.name,
            session_id or DEFAULT_SESSION,
            spec.body,
            spec.dialect,
            req.resp,
            model=spec.model,
            stream=spec.stream,
            bound=settings.client_backlog,
            max_answer=settings.max_body,
            strip_usage=spec.strip_usage,
            reserved=self.accounting.reservation(spec.max_tokens),
            # told at its end: a turn refused at its admission is not in flight (``refused``)
            on_end=self.accounting.ended,
            now=trio.current_time(),
        )
        try:
            await self.accounting.admit(turn)
        except LimitExceeded as exc:
            turn.refuse(limit_error(exc))
            return
        except TooManySessions as exc:  # a team's admission holds the key's session cap
            turn.refuse(too_many_sessions(exc.limit))
            return
        try:
            try:
                session, evicted = await self.sessions.enter(key, turn.session)
            except TooManySessions as exc:
                turn.refuse(too_many_sessions(exc.limit))
                return
            try:
                if evicted is not None:
                    await self.sessions.end_evicted(evicted)
                await self._attempts(req, turn, session, traceparent)
            finally:
                self.sessions.leave(session)
        finally:
            if not turn.state.final:  # cancelled under it (the hub stopping)
                turn.cut()
            if turn.state is State.OVERRUN:
                self.dispatcher.counters.turns_overrun += 1
            # a replica's: its row in the store, then its last write
            await self.accounting.coordination.settle(turn)

    async def _attempts(
        self, req: Request, turn: Turn, session: Session, traceparent: str | None
    ) -> None:
        """The turn on a channel; again on another when one is lost before the client got
        anything, up to ``MAX_ATTEMPTS``."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                placed = await self.dispatcher.channel_for(
                    session, turn, req.connection, traceparent
                )
            except Unplaced as exc:
                turn.refuse(self._refusal(exc.refusal, req, session))
                return
            if placed is None:  # the client left while it waited
                return
            ch, opened = placed
            # a job opened for this turn carries its traceparent; else the turn's frame does
            if await self._on(req, turn, session, ch, None if opened else traceparent):
                return
            log.warning(
                "job %s: channel lost before the turn sent anything (attempt %d of %d)",
                ch.job_id,
                attempt,
                MAX_ATTEMPTS,
            )
        turn.refuse(
            channel_lost(f"the chat channel was lost {MAX_ATTEMPTS} times before an answer")
        )

    async def _on(
        self,
        req: Request,
        turn: Turn,
        session: Session,
        ch: ServerChannel,
        traceparent: str | None,
        continuation: bool = False,
    ) -> bool:
        """The turn on one channel: True once it is over, False when the channel went before
        the client got anything (it can be served again). A channel that goes mid-answer is
        waited for (``_resume``), else the answer is continued on another runner."""
        settings = self.settings
        rid = new_id()
        request: protocol.RequestFrame | protocol.EmbeddingsRequestFrame
        if turn.api == protocol.EMBEDDINGS:
            if self.embeds is None or not await self.embeds(ch):
                turn.refuse(embeddings_unsupported(turn.model or "", ch.runner_id))
                return True
            request = protocol.EmbeddingsRequestFrame(ch.job_id, rid, msgspec.Raw(turn.body))
        else:
            request = protocol.RequestFrame(
                ch.job_id, rid, msgspec.Raw(turn.body), traceparent, continuation
            )
        frame = protocol.encode_frame(request)
        backlog = ch.backlog
        if backlog and backlog + len(frame) > settings.channel_backlog:  # a runner not reading
            log.warning(
                "job %s: %d bytes of requests wait unsent on its channel: turn %s refused",
                ch.job_id,
                backlog,
                turn.id,
            )
            turn.refuse(runner_busy(backlog, settings.channel_backlog))
            return True
        turn.sent(rid, ch.runner_id, ch.job_id)
        ch.open(rid, turn)
        try:
            if not await ch.send(frame):
                turn.unsent()
                if turn.state is not State.SUSPENDED:
                    return False
            first_within = math.inf if settings.ping_interval > 0 else settings.first_frame_timeout
            while True:
                try:
                    await turn.relay(req.connection, settings.keepalive_interval, first_within)
                    return True
                except TurnLost:
                    if turn.state is State.SENT:  # no frame within first_within
                        log.warning(
                            "job %s: no frame for turn %s within %g s: closing its channel",
                            ch.job_id,
                            turn.id,
                            first_within,
                        )
                        ch.request_close(1011, f"no frame within {first_within:g} s")
                        turn.unsent()
                    return False
                except TurnSuspended:
                    if not await self._resume(req, turn, ch, rid):
                        return await self._continue(req, turn, session)
                    ch = self.dispatcher.channels.get(ch.job_id) or ch
        finally:
            if ch.routes(rid):  # the runner has not ended it: nobody reads it any more
                ch.close_request(rid)
                await _send_cancel(ch, rid)

    async def _resume(self, req: Request, turn: Turn, old: ServerChannel, rid: str) -> bool:
        """Wait (``resume_within``, keeping the client patient) for the job's channel to come
        back and resume the turn (``Channels.accept`` names it in its hello) and for the runner
        to go on with it (a frame of it on the new channel: a runner without the extension never
        sends one). True when it went on (or ended meanwhile); False when the runner may be gone
        (the turn is then continued elsewhere, if it can be).

        A channel that broke (not one found silent by the pings, whose runner may not know yet)
        while the runner gives no sign of life for ``QUICK_DEATH`` s is taken for a runner that
        died: a runner whose connections were cut redials in a fraction of that."""
        settings = self.settings
        channels = self.dispatcher.channels
        board = self.dispatcher.board
        job_id, runner_id = old.job_id, old.runner_id
        dropped = trio.current_time()
        deadline = dropped + settings.resume_within
        dead_by = dropped + QUICK_DEATH if old.end_code != 1011 else math.inf
        interval = settings.keepalive_interval if settings.keepalive_interval > 0 else math.inf
        log.info("job %s: channel lost mid-answer: turn %s waits for its redial", job_id, turn.id)
        resumes = turn.resumes
        while not turn.state.final and not turn.unresumable:
            if turn.state is State.ANSWERING and turn.frames > turn.resumed_from:
                break  # the runner goes on with it on the new channel
            now = trio.current_time()
            job = board.jobs.get(job_id)
            if now >= deadline or job is None or job.over or job_id in channels.runner_ended:
                break
            if now >= dead_by and turn.resumes == resumes:
                if board.last_seen.get(runner_id, -math.inf) < dropped:
                    log.info("job %s: runner %s gave no sign of life since", job_id, runner_id)
                    break
                dead_by = math.inf  # it lives: its redial gets the whole window
            await turn.sleep(req.connection, min(deadline, dead_by, now + interval))
            if turn.state is not State.ANSWERING and trio.current_time() < deadline:
                turn.keepalive()
        channels.unsuspend(job_id, rid)
        if turn.resumes > resumes and (
            turn.frames > turn.resumed_from or turn.state in (State.DONE, State.FAILED)
        ):
            self.dispatcher.counters.turns_resumed += 1
            log.info("job %s: turn %s resumed on the redialled channel", job_id, turn.id)
            return True
        if turn.state.final:
            return True
        new = channels.get(job_id)
        if new is not None and new.routes(rid):
            new.close_request(rid)  # resumed, but the runner never went on with it
        turn.not_resumed()
        return False

    async def _continue(self, req: Request, turn: Turn, session: Session) -> bool:
        """The answer so far continued on another runner (docs/protocol.md §6): one answer for
        the client. A turn that had begun a tool call, or whose client left, ends as it is."""
        if turn.state.final:
            return True
        found = answer_so_far(turn.parts or turn.gathered, text_only=False)
        body = None
        if found is not None and found.text and not found.finished:
            body = turn.continuation(found.text)
        if found is None or body is None:
            turn.lose()
            return True
        old = turn.job_id
        dispatcher = self.dispatcher
        if old is not None:
            if session.job_id == old:
                session.had_job = old
                await self.sessions.bind(session, None)
            with trio.move_on_after(CANCEL_SEND_TIMEOUT) as scope:
                scope.shield = True
                await dispatcher.channels.cancel_job(old, "its turn is continued on another runner")
        turn.continue_as(found.id or "", body)
        try:
            placed = await dispatcher.channel_for(session, turn, req.connection)
        except Unplaced:
            turn.lose()
            return True
        if placed is None:
            return True
        ch, _opened = placed
        dispatcher.counters.turns_continued += 1
        log.warning(
            "turn %s: continued on runner %s (job %s) after %d chunks",
            turn.id,
            ch.runner_id,
            ch.job_id,
            turn.chunks,
        )
        return await self._on(req, turn, session, ch, None, continuation=True)

    def _refusal(self, refusal: Refuse, req: Request, session: Session) -> HTTPError:
        """The HTTP answer to the dispatcher's refusal (logged once)."""
        s = self.settings
        owner, project = session.owner, session.project
        why = refusal.why
        if why is Refusal.NO_RUNNER_CONNECTED:
            return no_runner_connected(owner, project, server_url(req))
        if why is Refusal.NO_CAPABLE_RUNNER:
            return no_capable_runner(refusal.live)
        if why is Refusal.UNKNOWN_MODEL:  # learnt as the runners' lists came in
            return model_not_found(refusal.waiter.model or "", list(refusal.models))
        if why is Refusal.QUEUE_FULL:
            log.warning(
                "%s/%s: every runner busy and the queue full: refused (position %d of %d)",
                owner,
                project,
                refusal.position,
                refusal.of,
            )
            return queue_full(
                refusal.busy, s.queue_length, refusal.position, refusal.of, s.queue_wait
            )
        if why is Refusal.QUEUE_TIMEOUT:
            log.warning(
                "%s/%s: every runner busy for %g s: a turn gave up at position %d of %d",
                owner,
                project,
                s.queue_wait,
                refusal.position,
                refusal.of,
            )
            return queue_timeout(refusal.busy, s.queue_wait, refusal.position, refusal.of)
        if refusal.waited_for:  # its model's runners withdrew chat-llm:v1 (stopped): named
            runners = self.dispatcher.board.runners
            names = ", ".join(
                sorted((getattr(runners.get(r), "name", None) or r) for r in refusal.waited_for)
            )
            model = refusal.waiter.model
            log.warning(
                "model %.200r: waited %g s for runner(s) %s to come back (session %s)",
                model,
                s.runner_wait_timeout,
                names,
                session.name,
            )
            return runner_gone(model or "", names, s.runner_wait_timeout)
        log.warning(
            "no runner with %s connected within %g s (session %s)",
            protocol.CAPABILITY,
            s.runner_wait_timeout,
            session.name,
        )
        return no_runner(s.runner_wait_timeout)


async def _send_cancel(ch: ServerChannel, rid: str) -> None:
    """``chat.completion.cancel`` for a turn nobody reads any more (shielded, bounded)."""
    if ch.closed.is_set():
        return
    frame = protocol.encode_frame(protocol.CancelFrame(ch.job_id, rid))
    with trio.move_on_after(CANCEL_SEND_TIMEOUT) as scope:
        scope.shield = True
        if await ch.send(frame):
            log.info("sent chat.completion.cancel for request %s of job %s", rid, ch.job_id)


def server_url(req: Request) -> str:
    """The hub's URL as the client reached it (for a hint naming ``--server``)."""
    host = header(req.scope, b"host")
    scheme = req.scope.get("scheme", "http")
    return f"{scheme}://{host.decode('latin-1')}" if host else ""
