"""One turn forwarded: a backend that serves its model chosen, its answer relayed, and the
answer continued on another backend of the runner when the first one dies mid-answer.

A backend that cannot be reached (nothing was sent) is probed at once and the turn goes to the
next backend serving the model, as ever. One that dies after it was sent the turn (its
connection lost, or silent past ``idle_timeout``) is left too, and the next one continues the
answer (docs/protocol.md §6): with nothing relayed yet the turn is sent again whole; with text
relayed and no tool call begun, the next backend is asked to continue that text (as a final
assistant message, in its own way: ``Backend.continuation``) and its chunks are stitched onto
the first part (``gateway.apis.continuation``), so the Server sees one answer. The text is read out
of the payloads relayed, which a turn keeps (by reference) only when another backend serves its
model; without one, the fault is the turn's error, as before.
"""

from __future__ import annotations

import itertools
import logging

from gateway.apis.continuation import Stitch, answer_so_far, continuation_body
from gateway.observe import Counters, Redactor
from gateway.runner.backend import (
    Backend,
    BackendError,
    BackendIdle,
    BackendLost,
    BackendUnreachable,
)
from gateway.runner.backends import BackendPool, TurnRoute
from gateway.runner.relay import Relay, StitchPayloads
from gateway.runner.turn import Turn
from gateway.wire import http1, protocol
from gateway.wire.stream import BadPayload

log = logging.getLogger("gateway.channel")

_ERROR_BODY_LIMIT = 512


class TurnFailed(Exception):
    """The turn cannot be served; the message is safe for a frame (no key)."""


class AnswerWhole(Exception):
    """The backend died after its answer had finished (its usage or [DONE] lost): done."""


class Forwarder:
    """Forwards the turns of one Chat Job to the runner's backends, through its ``relay``."""

    def __init__(self, job_id: str, pool: BackendPool, relay: Relay, counters: Counters) -> None:
        self.job_id = job_id
        self.pool = pool
        self.relay = relay
        self.counters = counters

    async def forward(self, frame: protocol.CompletionRequest, turn: Turn) -> None:
        """Route one turn, hold a slot on a backend serving its model, relay its chunks and
        done frame; ``TurnFailed`` when it cannot."""
        request_id = frame.requestId
        try:
            route = await self.pool.route(frame.model, bytes(frame.body))
        except BackendError as exc:
            raise TurnFailed(str(exc)) from None
        span = turn.span
        traceparent = None
        if span is not None:
            span.routed(route.model or route.requested)
            traceparent = span.traceparent
        continuing = frame.continuation
        if continuing and not any(_continues(b, route.body) for b in route.candidates):
            raise TurnFailed(protocol.CONTINUATION_UNSUPPORTED)
        if len(route.candidates) > 1:
            turn.relayed = []  # kept by reference: another backend may continue the answer
        body, stitch = route.body, None
        tried: list[Backend] = []
        while True:
            backend: Backend | None = None
            try:
                async with self.pool.turn(route, self.job_id, request_id, tried) as backend:
                    sent = backend.continuation(body) if continuing else body
                    if sent is None:  # a backend of a kind that cannot continue an answer
                        tried.append(backend)
                        if len(tried) >= len(route.candidates):
                            raise TurnFailed(protocol.CONTINUATION_UNSUPPORTED)
                        continue
                    if span is not None:
                        span.backend(backend.url)
                    async with backend.stream(sent, traceparent) as response:
                        await self._relay(turn, response, backend.key, stitch)
                        return
            except BackendUnreachable as exc:
                assert backend is not None
                self.pool.suspect(backend)
                tried.append(backend)
                if len(tried) >= len(route.candidates):
                    raise TurnFailed(str(exc)) from None
                log.warning(
                    "job %s request %s: %s; trying another backend", self.job_id, request_id, exc
                )
            except (BackendLost, BackendIdle, http1.ConnectionLost) as exc:
                assert backend is not None
                what = str(exc) if isinstance(exc, BackendError) else f"stream broke: {exc}"
                if isinstance(exc, http1.ConnectionLost):
                    what = f"backend {backend.url} {what}"
                tried.append(backend)
                try:
                    rest = self._rest(turn, route, tried)
                except AnswerWhole:
                    await self.relay.end(turn, turn.frames.done)
                    return
                if rest is None:
                    raise TurnFailed(what) from None
                body, stitch = rest
                continuing = continuing or stitch is not None
                self.counters.inc("turns_continued")
                log.warning(
                    "job %s request %s: %s; continuing on another backend (%d chunks relayed)",
                    self.job_id,
                    request_id,
                    what,
                    turn.chunks,
                )
            except BackendError as exc:
                raise TurnFailed(str(exc)) from None
            except (BadPayload, http1.ProtocolError) as exc:
                url = backend.url if backend is not None else "?"
                raise TurnFailed(f"backend {url} {exc}") from None
            except http1.ExchangeFailed as exc:
                url = backend.url if backend is not None else "?"
                raise TurnFailed(f"backend {url} stream broke: {exc}") from None

    def _rest(
        self, turn: Turn, route: TurnRoute, tried: list[Backend]
    ) -> tuple[bytes, StitchPayloads | None] | None:
        """What to send the next backend for the rest of ``turn``'s answer (the body, and the
        stitch for its chunks), or None when it cannot go on: no other backend, its payloads
        not kept, or an answer that is not text only. ``AnswerWhole`` when it had finished."""
        if all(b in tried for b in route.candidates):
            return None
        if turn.chunks == 0:
            return route.body, None  # nothing relayed: the turn again, whole
        if turn.relayed is None:
            return None
        so_far = answer_so_far(itertools.chain.from_iterable(turn.relayed))
        if so_far is None:
            return None
        if so_far.finished:
            raise AnswerWhole
        body = continuation_body(route.body, so_far.text)
        if body is None:
            return None
        return body, Stitch(so_far.id).payloads

    async def _relay(
        self,
        turn: Turn,
        response: http1.ClientResponse,
        key: str | None,
        stitch: StitchPayloads | None,
    ) -> None:
        """Relay one backend answer: every SSE event becomes a chunk frame written the moment
        its read is split (``Relay``, in the poller's task while it streams), then the done
        frame. An error answer's body goes to the Server in the error frame, with the backend's
        key (``key``), bearer tokens and credential fields masked: a backend that echoes the
        request's headers must not hand the key on."""
        if not 200 <= response.status < 300:
            # read a key's length more, so a key cut at the limit is still masked whole
            extra = len(key) if key else 0
            body = await response.read_body(_ERROR_BODY_LIMIT + extra)
            text = Redactor([key], limit=None)(body)
            text = _truncated(text.encode(), _ERROR_BODY_LIMIT)
            raise TurnFailed(f"backend returned {response.status}: {text}")
        chunks = turn.chunks
        try:
            await self.relay.answer(turn, response, stitch)
        finally:
            self.counters.inc("chunks", turn.chunks - chunks)


def _continues(backend: Backend, body: bytes) -> bool:
    try:
        return backend.continuation(body) is not None
    except protocol.FrameError:
        return False


def _truncated(data: bytes, limit: int) -> str:
    if len(data) > limit:
        return data[:limit].decode(errors="replace").strip() + "…"
    return data.decode(errors="replace").strip()
