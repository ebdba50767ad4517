"""One front-door turn: all that is kept of it in one record, its state, and its HTTP response,
which it alone writes.

A ``Turn`` is made when a client's request is admitted and lives until its response ends. It
is the ``Sink`` its channel's reader hands the turn's frames to: each read's chunks become the
client's events (the dialect's ``Translation``) in one write to the client's socket, at once; a
non-streamed turn gathers them (bounded) and writes one answer at the end. Every write to the
response goes through the turn's methods, whichever task calls them (the channel's reader for
frames, the turn's own task for keepalives, backlog and errors), and the turn's state (``State``)
says what may still be written: it moves by ``TurnState._move`` only (the table ``NEXT``), and
ends in one place (``_end``). The hub's other parts give it what they know of it (``on_end``,
``admitted_as``, ``recorded_as``, ``continue_as``), and write none of its attributes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from gateway.apis.chunks import choices_mark, has_usage, is_usage_only, read_usage
from gateway.apis.continuation import Stitch, continuation_body
from gateway.apis.dialects import Dialect, Translation
from gateway.apis.shapes import SSE_HEADERS, Code, upstream_error
from gateway.hub.turnstate import State, TurnLost, TurnState, TurnSuspended
from gateway.wire.errors import ClientGone, Headers, HTTPError
from gateway.wire.http import Connection, Response
from gateway.wire.park import Park
from gateway.wire.protocol import RESUME_UNAVAILABLE, DoneFrame, ErrorFrame, ModelsFrame

log = logging.getLogger("gateway.hub.turn")

_NOWHERE = 1 << 62  # past the end of any frame: ``startswith`` there is False


class Turn(TurnState):
    """One front-door turn, its record and its response (see the module's docstring)."""

    __slots__ = (
        # the record (its usage row; its state is ``TurnState``'s): who, what, when, the tokens
        *("id", "key_id", "key_name", "session", "api", "model", "model_label", "stream"),
        *("started", "first_token", "ended", "runner_id", "job_id", "status", "error"),
        *("prompt_tokens", "completion_tokens", "estimated", "reserved", "cost", "ref_cost"),
        *("priority", "chunks", "attempts", "on_end"),
        # the request, in the client's API
        *("body", "asked", "dialect", "strip_usage", "request_id"),
        # the response writer: the client's events, its bound, a non-streamed answer gathered
        *("resp", "bound", "max_answer", "translation", "_encode", "pending", "last"),
        *("gathered", "gathered_bytes", "_choices", "_choices_at"),
        # resume and continuation: the frames a redial names, the part a continuation carries
        *("frames", "parts", "unresumable", "resumed_from", "resumes", "stitch", "continued"),
        *("prior_prompt", "prior_completion"),
        *("_waker", "_flushing"),  # its own task asleep (``sleep``), flushing (``flush_backlog``)
    )

    def __init__(
        self,
        turn_id: str,
        key_id: str,
        key_name: str,
        session: str,
        body: bytes,
        dialect: Dialect,
        resp: Response,
        *,
        model: str | None,
        stream: bool,
        bound: int,
        max_answer: int,
        strip_usage: bool = False,
        reserved: int = 0,
        on_end: Callable[[Turn], None] | None = None,
        now: float,
    ) -> None:
        self._state = State.WAITING  # where every turn starts; it moves by ``_move`` only
        self.id = turn_id
        self.key_id = key_id
        self.key_name = key_name
        self.session = session
        self.api = dialect.api
        self.model = model
        self.model_label = model or ""  # the model as the ledger names it (set at the end)
        self.stream = stream
        self.started = now
        self.first_token: float | None = None
        self.ended: float | None = None
        self.runner_id: str | None = None
        self.job_id: str | None = None
        self.status: int | None = None  # the HTTP status of an error answer
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.estimated = False  # the tokens are the hub's estimate (the backend said none)
        self.reserved = reserved  # tokens held against the key's token limits until the end
        self.cost: float | None = None  # at its model's price as it ended (None: no price)
        self.ref_cost: float | None = None  # the same tokens at the reference price
        self.priority = 1  # its key's class in the queue (0 interactive, 1 standard, 2 background)
        self.chunks = 0  # chunks of the answer so far (a streamed turn's pace, live)
        self.attempts = 0  # channels the request was sent on
        self.body = body  # the chat-completions body sent down the channel
        self.asked = body  # the client's own (a continuation's body is built from it)
        self.dialect = dialect
        self.resp = resp
        self.bound = bound  # bytes the client may fall behind by
        self.max_answer = max_answer  # bytes a non-streamed answer may gather
        self.strip_usage = strip_usage  # the hub asked for usage the client did not
        self.translation: Translation | None = dialect.stream() if stream else None
        self._encode: Callable[[Any], bytes] | None = (
            self.translation.chunk if self.translation is not None else None
        )
        self.pending: list[bytes] = []  # events of the read at hand
        self.gathered: list[bytes] = []  # a non-streamed turn's chunks
        self.gathered_bytes = 0
        self.last: Any = None  # the last chunk (where a usage is)
        self.frames = 0  # chunk frames received on its current request (what a resume names)
        # a streamed turn's chunks, by reference, for a continuation (up to ``max_answer``
        # bytes, counted in ``gathered_bytes``)
        self.parts: list[Any] = []
        self.unresumable = False  # the runner said it cannot resume it (or its window passed)
        self.resumed_from = 0  # ``frames`` when it was last resumed (what the hello named)
        self.resumes = 0  # times a redialled channel resumed it
        self.stitch: Callable[[Any], bytes | None] | None = None  # a continuation's chunks
        self.continued = False  # another runner continued its answer
        self.prior_prompt = 0  # tokens of the part before a continuation (estimated)
        self.prior_completion = 0
        self.error: str | None = None
        # how this turn's frames open a non-empty choices, and where (``choices_mark``)
        self._choices = b""
        self._choices_at = _NOWHERE
        self._waker: Park | None = None  # the turn's task asleep (``sleep``)
        self._flushing: trio.CancelScope | None = None  # the turn's task flushing the backlog
        self.request_id: str | None = None  # the request id of the current attempt
        self.on_end = on_end  # told once, at the end (ended or refused)

    def __repr__(self) -> str:
        return f"<Turn {self.id} {self.api} {self._state.label}>"

    # -- the record -------------------------------------------------------------------

    @property
    def outcome(self) -> str | None:
        """``ok``, ``error``, ``lost``, ``client_gone`` or ``refused`` once ended, else None."""
        state = self._state
        return state.outcome if state.final else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def duration(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens together (0 where none are known)."""
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)

    @property
    def answered(self) -> bool:
        """Whether the client got any of the answer (its chunks, not keepalives)."""
        return self.first_token is not None

    def take_usage(self, raw: Any) -> None:
        """The tokens of a chunk (or a whole completion) that carries ``usage``."""
        found = read_usage(raw)
        if found is not None:
            prompt, completion = found
            if prompt is not None:
                self.prompt_tokens = prompt
            if completion is not None:
                self.completion_tokens = completion
            elif self.api == "embeddings" and prompt is not None:
                self.completion_tokens = 0  # an embedding generates no tokens

    def admitted_as(self, priority: int, reserved: int) -> None:
        """Its class in the queue and the tokens it holds against its key's limits till its end."""
        self.priority = priority
        self.reserved = reserved

    def recorded_as(self, label: str, cost: float | None = None, ref: float | None = None) -> None:
        """Its model as the ledger names it (never a client's made-up name), and, at its end
        where that model has a price, what its tokens cost at it and at the reference price."""
        self.model_label = label
        self.cost = cost
        self.ref_cost = ref

    def _end(self, state: State, now: float | None = None) -> None:
        """The one place a turn ends: its move to the final ``state`` (the first one wins), its
        tokens made whole, its task woken, ``on_end`` told."""
        if self._state.final:
            return
        self._move(state)
        self.ended = trio.current_time() if now is None else now
        if self.completion_tokens is None and self.chunks:
            self.estimated = True  # the backend said nothing: charged a token a chunk delivered
            self.completion_tokens = self.chunks
        elif self.continued and self.completion_tokens is not None:
            self.completion_tokens += self.prior_completion  # the part before, estimated
            self.estimated = True
        if self.estimated and self.prompt_tokens is None:
            self.prompt_tokens = self.dialect.prompt_estimate(self.body)
        if self.continued and self.prompt_tokens is not None:
            self.prompt_tokens += self.prior_prompt  # both parts' prompts were read
        if self._flushing is not None and (state is State.CLIENT_GONE or state is State.OVERRUN):
            self._flushing.cancel()  # a flush to a client that does not read would never end
        waker = self._waker  # its task looks at it now (``wake``, inline: once a turn)
        if waker is not None:
            waker.cancel()
        if self.on_end is not None:
            self.on_end(self)

    def sent(self, request_id: str, runner_id: str, job_id: str) -> None:
        """Its request goes on a channel (``request_id`` there) now."""
        self.request_id = request_id
        self.runner_id, self.job_id = runner_id, job_id
        self.attempts += 1
        self.frames = 0
        state = self._state
        if not state.final:  # a continuation goes on answering: its client has a part
            to = State.ANSWERING if self.first_token is not None or self.gathered else State.SENT
            if to is not state:
                self._move(to)

    def unsent(self) -> None:
        """Its channel went before the client got anything: it waits for another."""
        if self._state is State.SENT:
            self._move(State.WAITING)

    def cut(self) -> None:
        """The hub stops under the turn: what the client has is all it gets."""
        self._end(State.CUT)

    # -- frames in (the channel's reader: ``gateway.hub.channel.Sink``) ------------------

    def chunk(self, chunk: msgspec.Raw, frame: bytes = b"") -> None:
        state = self._state
        if state is not State.SENT and state is not State.ANSWERING:
            return
        self.frames += 1
        if not len(chunk):
            return
        if self.stitch is not None:  # a continuation's chunk, made the first part's own
            stitched = self.stitch(chunk)
            if stitched is None:
                return
            chunk, frame = msgspec.Raw(stitched), b""
        self.last = chunk
        self.chunks += 1
        encode = self._encode
        if encode is None:  # a non-streamed turn: gathered, bounded
            if state is State.SENT:  # its first chunk
                self._move(State.ANSWERING)
            size = self.gathered_bytes + len(chunk)
            if size > self.max_answer:
                self._too_large()
                return
            self.gathered_bytes = size
            self.gathered.append(bytes(chunk))
            return
        if (
            self.strip_usage
            and not frame.startswith(self._choices, self._choices_at)
            and self._usage_only(frame or bytes(chunk))
        ):
            return  # the usage chunk the hub added: counted at the end, not this client's
        size = self.gathered_bytes + len(chunk)
        if size <= self.max_answer:  # kept (a reference) for a continuation, bounded
            self.parts.append(chunk)
        elif self.parts:
            self.parts = []  # an answer longer than a continuation may carry: not kept
        self.gathered_bytes = size
        events = encode(chunk)
        if events:
            self.pending.append(events)

    def _usage_only(self, data: bytes) -> bool:
        """``chunk``'s test for a frame not laid out as the turn's last known one (its first,
        the usage chunk, a head that changed): where its choices open is kept for the next."""
        mark = choices_mark(data)
        if mark is not None:
            self._choices, self._choices_at = mark
            return False
        return is_usage_only(data)

    def flush(self) -> None:
        pending = self.pending
        if pending:
            self.pending = []
            self._write(pending[0] if len(pending) == 1 else b"".join(pending))

    def reply(self, frame: DoneFrame | ErrorFrame | ModelsFrame) -> None:
        state = self._state
        if state.final or state is State.WAITING:
            return
        if frame.__class__ is DoneFrame:
            self._done()  # the chunks of the read at hand, then the end, in one write
            return
        self.flush()
        if isinstance(frame, ErrorFrame):
            if frame.error == RESUME_UNAVAILABLE and (self.answered or self.gathered):
                self.unresumable = True  # its frames are gone: continued elsewhere, if it can be
                if self._state is not State.SUSPENDED:
                    self._move(State.SUSPENDED)
                self.wake()
                return
            self._failed(frame.error or "the runner reported an error")
        # a models answer for a chat turn: not this turn's (ignored)

    def lost(self) -> bool:
        """The channel ended under the request: True when the turn waits for the job's
        redialled channel to resume it (it had answered part: ``SUSPENDED``)."""
        state = self._state
        if state.final or state is State.WAITING or state is State.SUSPENDED:
            return state is State.SUSPENDED
        self.flush()
        if self._state.final:
            return False
        if not self.answered:  # nothing reached the client: it can be served again
            self._move(State.WAITING)
            self.chunks = 0
            self.gathered = []
            self.gathered_bytes = 0
            self.parts = []
            self.last = None
            self.wake()
            return False
        self._move(State.SUSPENDED)  # resumed on the redial, else continued, else lost
        self.wake()
        return True

    def revoke(self) -> None:
        """Its API key was revoked while in flight: it ends now (``CUT``), its client told."""
        self._refuse_late(HTTPError(401, "this API key was revoked", Code.KEY_REVOKED), State.CUT)

    def lose(self) -> None:
        """It could be neither resumed nor continued: ends ``LOST``, its client told."""
        message = "the chat channel to the runner was lost mid-turn"
        log.warning("%s (job %s, turn %s)", message, self.job_id, self.id)
        self._cut(State.LOST, message, "channel_lost")

    def resume_count(self) -> int | None:
        """What a resume names for it: the chunk frames received on its request (None: it
        waits no more, its client gone)."""
        return None if self._state.final else self.frames

    def resumed(self) -> None:
        """Its request goes on, on the job's redialled channel (the rest of its frames next)."""
        if self._state is State.SUSPENDED and not self.unresumable:
            self._move(State.ANSWERING)
            self.resumed_from = self.frames
            self.resumes += 1
            self.wake()

    def continuation(self, text: str) -> bytes | None:
        """The body continuing the answer so far (every part's ``text``): from the client's own."""
        return continuation_body(self.asked, text, extend=False)

    def continue_as(self, first_id: str, body: bytes) -> None:
        """Another runner continues its answer with ``body`` (``continuation``): what came
        before is charged as estimated, the new chunks made the first part's (``Stitch``)."""
        self.prior_prompt += self.dialect.prompt_estimate(self.body)
        self.prior_completion += self.chunks
        self.body = body
        self.continued = True
        self.stitch = Stitch(first_id)
        self.unresumable = False
        self.frames = 0
        if self._state is State.SUSPENDED:
            self._move(State.ANSWERING)

    def not_resumed(self) -> None:
        """Its runner never went on with it on the redialled channel: it waits to be continued."""
        if self._state is State.ANSWERING:
            self._move(State.SUSPENDED)

    # -- writing the response ----------------------------------------------------------

    def _head(self, status: int = 200) -> bytes:
        resp = self.resp
        if resp.started:
            return b""
        return resp.head(status, [*SSE_HEADERS, (b"x-request-id", self.id.encode())])

    def _write(self, data: bytes, end: bool = False) -> None:
        resp = self.resp
        try:  # the head with the first chunk
            done = resp.write_nowait(data, b"" if resp.started else self._head(), end)
        except ClientGone:
            self._end(State.CLIENT_GONE)
            return
        if self.first_token is None:
            self.first_token = trio.current_time()
            if self._state is State.SENT:
                self._move(State.ANSWERING)
        if not done:
            # behind by more than ``bound`` before this write: one chunk larger than the bound,
            # to a client that reads, is no overrun (its write is bounded by ``max_body``)
            if resp.backlog - len(data) > self.bound and not resp.finished:
                self._overrun()
            else:
                self.wake()  # the turn's task flushes the rest

    def _done(self) -> None:
        last = self.last
        if last is not None and has_usage(last):
            self.take_usage(last)
        if self.translation is None:
            self._answer_whole()
            return
        pending, self.pending = self.pending, []
        pending.append(self.translation.done())
        self._write(b"".join(pending), end=True)  # the last chunks and the end, in one write
        if not self._state.final:
            self._end(State.DONE)

    def _answer_whole(self) -> None:
        """A non-streamed turn's one answer: its chunks folded in the client's API."""
        chunks, self.gathered = self.gathered, []
        if not chunks:
            why = "the runner finished the turn without a completion"
            self._refuse_late(upstream_error(why, "empty_completion"), State.FAILED)
            return
        self.first_token = now = trio.current_time()  # (and its end's: one clock read)
        try:
            body = self.dialect.fold(chunks)
        except Exception as exc:  # a runner's answer the fold cannot read: the client is told
            log.warning("turn %s: the runner's answer could not be folded: %r", self.id, exc)
            why = "the runner's answer could not be read"
            self._refuse_late(upstream_error(why, "bad_completion"), State.FAILED)
            return
        headers = [(b"content-type", b"application/json"), (b"x-request-id", self.id.encode())]
        self._whole(200, body, headers)
        if not self._state.final:
            self._end(State.DONE, now)

    def _failed(self, message: str) -> None:
        self.error = message
        log.info("runner error on job %s turn %s: %s", self.job_id, self.id, message)
        if self.answered or self.pending:
            self._cut(State.FAILED, message, "upstream_error")
        else:
            self._refuse_late(upstream_error(message), State.FAILED)

    def _cut(self, state: State, message: str, code: str) -> None:
        """End a stream the client has part of with an error event in its API."""
        if self.translation is not None and not self.resp.finished:
            pending, self.pending = self.pending, []
            pending.append(self.translation.error(message, code))
            self._write(b"".join(pending), end=True)
        else:  # a non-streamed turn: nothing went out yet
            self._whole_error(upstream_error(message, code))
        self._end(state)

    def _too_large(self) -> None:
        message = f"the runner's answer is over {self.max_answer} bytes, the hub's bound"
        log.warning("turn %s (job %s): %s", self.id, self.job_id, message)
        self.gathered = []
        self._whole_error(HTTPError(502, message, "answer_too_large"))
        self._end(State.FAILED)

    def _overrun(self) -> None:
        """The client fell ``bound`` bytes behind: its turn ends (the runner is told by the
        serving loop's cancel), and its connection closes after an error event, if it fits."""
        message = (
            f"the client read too slowly: more than {self.bound} bytes of the stream were waiting"
        )
        log.warning("turn %s (job %s): %s; ending it", self.id, self.job_id, message)
        translation = self.translation
        if translation is not None and not self.resp.finished:
            try:
                self.resp.write_nowait(translation.error(message, "client_too_slow"), b"", True)
            except ClientGone:
                pass
        self.resp.gone = True  # its connection closes
        self._end(State.OVERRUN)

    def _whole(self, status: int, body: bytes, headers: Headers) -> None:
        resp = self.resp
        if resp.started:
            return
        try:
            head = resp.head(status, [*headers, (b"content-length", b"%d" % len(body))])
            done = resp.write_nowait(body, head, True)
        except ClientGone:
            self._end(State.CLIENT_GONE)
            return
        if not done:
            self.wake()

    def _whole_error(self, err: HTTPError) -> None:
        self.status = err.status
        headers = [(b"content-type", b"application/json"), *err.headers]
        self._whole(err.status, self.dialect.error_body(err), headers)

    def _refuse_late(self, err: HTTPError, state: State) -> None:
        """An error before the client got any of the answer: a whole error response, or, after
        keepalives started the stream, an error event that ends it."""
        self.status = err.status
        if self.resp.started and self.translation is not None:
            if not self.resp.finished:
                self._write(self.translation.error(err.message, err.code or "error"), end=True)
        else:
            self._whole_error(err)
        self._end(state)

    def refuse(self, err: HTTPError) -> None:
        """Answer with ``err`` in the client's API (no runner served the turn, or a limit, or
        it was lost too often): the turn ends refused, or failed once a runner had it."""
        self._refuse_late(err, State.REFUSED if self.runner_id is None else State.FAILED)

    def keepalive(self) -> None:
        """Keep a streamed turn's client (and proxies) patient while no chunk comes (before the
        first, or while the turn waits to be resumed or continued): the stream's head if it
        has not gone yet, then a keepalive in the client's API."""
        translation = self.translation
        if translation is None or self._state.final:
            return
        try:
            self.resp.write_nowait(translation.keepalive(), self._head())
        except ClientGone:
            self._end(State.CLIENT_GONE)

    def client_left(self) -> None:
        """The client's connection closed (seen by the turn's task)."""
        self.resp.gone = True
        self._end(State.CLIENT_GONE)

    # -- the turn's own task -------------------------------------------------------------

    def wake(self) -> None:
        """Have the turn's task look at the turn now (it waits in ``sleep``)."""
        waker = self._waker
        if waker is not None:
            waker.cancel()

    async def sleep(self, conn: Connection, deadline: float = math.inf) -> None:
        """Wait until something happens to the turn (``wake``), ``deadline`` (trio clock) or
        the client leaves (then the turn ends ``CLIENT_GONE``). Parked: a wake is a reschedule,
        not a cancel scope's ``Cancelled`` (``gateway.wire.park``); a scope for a deadline."""
        self._waker = park = Park()
        try:
            if deadline == math.inf:
                gone = await conn.wait_disconnect(park)
            else:
                gone = False
                with trio.CancelScope(deadline=deadline):
                    gone = await conn.wait_disconnect(park)
        finally:
            self._waker = None
        if gone:
            self.client_left()

    async def flush_backlog(self) -> None:
        """Write what the client's socket did not take yet; cut short when the client goes or
        falls ``bound`` behind meanwhile (a flush to a client that does not read never ends)."""
        with trio.CancelScope() as scope:
            self._flushing = scope
            try:
                await self.resp.flush()
            except ClientGone:
                self._end(State.CLIENT_GONE)
            finally:
                self._flushing = None

    async def relay(self, conn: Connection, keepalive: float, first_within: float) -> None:
        """The turn's task while its request is on a channel: the backlog flushed, keepalives
        until the first chunk (a streamed turn; each quiet ``keepalive`` s), the client watched;
        returns when the turn is over; TurnLost when its channel ended before it sent anything,
        or gave no frame within ``first_within`` s (then the caller closes that channel)."""
        first_by = trio.current_time() + first_within
        while True:
            if self.resp.backlog and not self.resp.gone:
                await self.flush_backlog()
                continue
            state = self._state
            if state.final:
                return
            if state is State.WAITING:
                raise TurnLost()
            if state is State.SUSPENDED:
                raise TurnSuspended()
            if state is State.ANSWERING:
                await self.sleep(conn)
                continue
            wake_at = first_by
            if keepalive > 0 and self.translation is not None:
                wake_at = min(wake_at, trio.current_time() + keepalive)
            await self.sleep(conn, wake_at)
            if self._state is not State.SENT or trio.current_time() < wake_at:
                continue
            if trio.current_time() >= first_by:
                raise TurnLost()
            self.keepalive()
