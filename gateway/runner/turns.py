"""The turns of one Chat Job: each in a task of its own that can outlive a channel connection,
and what becomes of them when their channel drops (docs/protocol.md §4, §6).

A ``Turns`` belongs to a session and lives across its channel's redials; each connection
(``gateway.runner.channel.Channel``) attaches to it while it is up. The turns' frames go to the
connection attached (``link``): the relay writes them there. When the channel drops:

- without a resume (a Server that never sent ``chat.channel.hello``, or ``resume_buffer`` 0),
  its turns are cancelled and their backend requests closed, as ever;
- with one, its turns go on: their frames are kept (``ResumeBuffer``, bounded) and sent to
  nobody (``relay.DOWN``). The redialled connection's hello names each turn the Server still
  has a client for and how many of its chunk frames it got: those turns are sent the rest and go
  on live; turns it does not name are cancelled at once; a named turn whose frames are no longer
  kept gets ``resume_unavailable``. No hello within ``HELLO_WAIT``, or ``resume_window`` without
  a redial: the kept turns are cancelled.

A turn that ends while its channel is up keeps its frames a while longer (``linger``: the time
the runner needs to find a dead path), in case the channel turns out to have dropped before
they arrived.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from gateway.observe import Counters, Histogram
from gateway.runner.backends import BackendPool
from gateway.runner.forward import Forwarder, TurnFailed
from gateway.runner.poller import Poller
from gateway.runner.relay import DOWN, Outlet, Relay
from gateway.runner.resume import ResumeBuffer
from gateway.runner.turn import Ending, Turn, TurnEnd
from gateway.wire import protocol
from gateway.wire.wsclient import ChannelClosed

if (
    TYPE_CHECKING
):  # imported only when tracing is on (Runner.run: gateway.runner.otel.Tracing.start)
    from gateway.runner.otel import SessionTrace

log = logging.getLogger("gateway.channel")

SHUTTING_DOWN = "runner shutting down"
HELLO_WAIT = 5.0  # s: how long a redialled channel's hello is waited for by the turns it keeps

_DONE_END = TurnEnd(Ending.DONE)
_CANCELLED_END = TurnEnd(Ending.CANCELLED, protocol.CANCELLED)
SESSION_END = TurnEnd(Ending.SESSION_ENDED, "session ended")
_UNNAMED = TurnEnd(Ending.UNRESUMED, "the redialled channel's hello did not name it")
_NO_HELLO = TurnEnd(Ending.UNRESUMED, "the redialled channel did not resume it (no hello)")
_WINDOW = TurnEnd(Ending.UNRESUMED, "no redialled channel resumed it within resume_window")
_UNAVAILABLE = TurnEnd(Ending.UNRESUMED, "resume_unavailable: its frames were no longer kept")

_TRACED_ERRORS = (Ending.FAILED, Ending.SHUTDOWN)  # a turn span's error status: not the client's


@dataclass
class SessionLimits:
    """A Chat Job's time limits (``agentDefinition``, in seconds; None: none) and the clock they
    run on, kept by the runner across the job's redials."""

    idle: float | None
    total: float | None
    started: float  # trio clock: when the session started
    last_active: float  # trio clock: when the last turn ended (or the session started)

    def idle_reason(self) -> str:
        assert self.idle is not None
        return f"session idle for {self.idle / 60:g} min (idleTimeoutMinutes)"

    def total_reason(self) -> str:
        assert self.total is not None
        return f"session reached its time limit of {self.total / 60:g} min (maxTimeoutMinutes)"


@dataclass(frozen=True, kw_only=True)
class ChannelKit:
    """What every Chat Channel of one runner shares: the backends, the shutdown event and the
    grace turns get after it, the counters and histograms, and the poller (None: each streaming
    turn reads its own socket)."""

    pool: BackendPool
    shutdown: trio.Event
    grace: float = 30.0
    counters: Counters = field(default_factory=Counters)
    ttft: Histogram = field(default_factory=Histogram)
    relay: Histogram = field(default_factory=Histogram)
    poller: Poller | None = None


class Turns:
    """The turns of one Chat Job, their tasks in ``nursery`` (the session's, or one channel's
    when nothing outlives it), and the link their frames go to."""

    def __init__(
        self,
        job_id: str,
        kit: ChannelKit,
        nursery: trio.Nursery,
        *,
        trace: SessionTrace | None = None,
        limits: SessionLimits | None = None,
        resume_buffer: int = 0,
        resume_window: float = 30.0,
        linger: float = 0.0,
    ) -> None:
        self.job_id = job_id
        self.counters = kit.counters
        self.nursery = nursery
        self.trace = trace  # tracing on: the session's span; off: None, and turns do no tracing
        self.limits = limits
        self._turns: dict[str, Turn] = {}
        # ended, their frames kept a while (resume), in the order their lingers began
        self._ended: dict[str, Turn] = {}
        self.no_turns = trio.Event()  # set while no turn is in flight (one per busy spell)
        self.no_turns.set()
        self.turn_began: trio.Event | None = None  # set when a turn starts (idle limit only)
        self.draining = False
        self.drain_reason = SHUTTING_DOWN
        self.buffer = ResumeBuffer(resume_buffer, self._link_lost) if resume_buffer > 0 else None
        self.window = resume_window
        self.linger = linger
        self.resume = False  # the connection attached negotiated a resume (its hello said so)
        self.link: Outlet | None = None  # where frames go now (None: down, or awaiting a hello)
        self._now = trio.lowlevel.current_clock().current_time  # trio.current_time, bound
        self.relay = Relay(DOWN, kit.poller, kit.ttft, kit.relay)
        self.forwarder = Forwarder(job_id, kit.pool, self.relay, kit.counters)
        self._expiry: trio.CancelScope | None = None

    @property
    def in_flight(self) -> int:
        return len(self._turns)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._turns

    async def wait_idle(self) -> None:
        """Wait until no turn is in flight."""
        while self._turns:
            await self.no_turns.wait()

    # -- connections ---------------------------------------------------------------------

    def _kept(self) -> dict[str, Turn]:
        """The turns whose frames are kept for a resume: in flight, and ended."""
        kept = {r: t for r, t in self._turns.items() if t.keep is not None and not t.released}
        kept.update(self._ended)
        return kept

    def attach(self, out: Outlet) -> bool:
        """A channel connection is up. True when turns it may resume wait for its hello (the
        frames go nowhere until ``hello`` or ``no_hello``); else its frames go to ``out`` now."""
        self.resume = False
        if self._kept():
            return True
        self._live(out)
        return False

    def hello(self, out: Outlet, hello: protocol.Hello) -> None:
        """The connection's first frame is the Server's hello: resume the turns it names."""
        if not (hello.resumes and self.buffer is not None):
            self.no_hello(out)
            return
        self._stop_expiry()
        self.resume = True
        named = hello.resume or {}
        kept = self._kept()
        for request_id, unnamed in kept.items():
            if request_id not in named:
                self._unresume(unnamed, _UNNAMED)
        try:
            for request_id, n in named.items():
                turn = kept.get(request_id)
                frames = self.buffer.frames_from(turn, n) if turn is not None else None
                if turn is None or frames is None:
                    error = protocol.error_frame(
                        self.job_id, request_id, protocol.RESUME_UNAVAILABLE
                    )
                    out.offer(error.encode())
                    if turn is not None:
                        self._unresume(turn, _UNAVAILABLE)
                    log.warning(
                        "job %s request %s: %s", self.job_id, request_id, _UNAVAILABLE.message
                    )
                    continue
                for frame in frames:
                    out.offer(frame)
                if turn.end_frame is not None:
                    out.offer(turn.end_frame)
                if turn.ended_at is not None:  # its linger starts again: just sent again
                    turn.ended_at = trio.current_time()
                    if self._ended.pop(request_id, None) is not None:  # the last to end now
                        self._ended[request_id] = turn
                self.counters.inc("turns_resumed")
                log.info(
                    "job %s request %s: resumed from chunk %d (%d sent again)",
                    self.job_id,
                    request_id,
                    n,
                    len(frames),
                )
        except ChannelClosed:
            return  # this connection is gone too: the turns stay kept for the next one
        self._live(out)

    def no_hello(self, out: Outlet) -> None:
        """The connection began without a hello (or without a resume): no turn is resumed."""
        self._stop_expiry()
        self.resume = False
        for turn in self._kept().values():
            self._unresume(turn, _NO_HELLO)
        if self.link is not out:
            self._live(out)

    def _live(self, out: Outlet) -> None:
        self.link = out
        self.relay.out = out
        for turn in self._turns.values():
            if turn.pump is not None:
                turn.pump.bind(out)
        if self.buffer is not None:
            self.buffer.up()
        self._expire_ended()

    def dropped(self, out: Outlet) -> None:
        """The connection ``out`` dropped: its turns are kept when it negotiated a resume,
        else cancelled (their backend requests closed)."""
        if self.link is out:
            self._down()
        self._start_expiry()

    def _link_lost(self, out: object) -> None:
        """A send of a turn that keeps its frames found ``out`` closed: when that is the
        connection attached, it is down from now on (its reader will say so too)."""
        if self.link is not None and self.link is out:
            self._down()
            self._start_expiry()

    def _down(self) -> None:
        self.link = None
        self.relay.out = DOWN
        resume = self.resume
        for turn in list(self._turns.values()):
            if resume and turn.keep is not None and not turn.released:
                if turn.pump is not None:
                    turn.pump.bind(DOWN)
            else:
                turn.stop(SESSION_END)
        if self.buffer is not None:
            self.buffer.down()

    def end_all(self, end: TurnEnd) -> None:
        """The session's channel is over (``chat.end``, the runner's end): every turn goes."""
        self._stop_expiry()
        for turn in list(self._turns.values()):
            turn.stop(end)
        for turn in list(self._ended.values()):
            self._unresume(turn, end)

    def stop_all(self, end: TurnEnd) -> None:
        """Stop every turn in flight (the end of a wind-down's grace)."""
        for turn in list(self._turns.values()):
            turn.stop(end)

    def _unresume(self, turn: Turn, end: TurnEnd) -> None:
        """A kept turn that will not be resumed: cancelled (quietly), its frames let go."""
        if turn.ended_at is None:
            turn.stop(end)  # its task ends it and lets its frames go
            return
        self._ended.pop(turn.request_id, None)
        if self.buffer is not None:
            self.buffer.release(turn)

    def _start_expiry(self) -> None:
        if self._expiry is None and self.link is None and self._kept():
            self._expiry = scope = trio.CancelScope()
            self.nursery.start_soon(self._expire, scope)

    def _stop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _expire(self, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(self.window)
            self._expiry = None
            kept = self._kept()
            if kept:
                log.warning(
                    "job %s: %d turn(s) not resumed within resume_window (%g s): cancelled",
                    self.job_id,
                    len(kept),
                    self.window,
                )
            for turn in kept.values():
                self._unresume(turn, _WINDOW)

    def _expire_ended(self) -> None:
        """While a channel is up: let go of ended turns whose ``linger`` is over. ``_ended`` is
        in the order their lingers began, so only the expired ones at its head are looked at
        (it runs as each turn ends: a scan of every turn kept made a turn's end cost grow
        with the turns ended within ``linger``, thousands under load)."""
        ended = self._ended
        if self.link is None or not ended:
            return
        until = self._now() - self.linger
        buffer = self.buffer
        while ended:
            request_id = next(iter(ended))
            turn = ended[request_id]
            assert turn.ended_at is not None
            if turn.ended_at > until:
                return
            del ended[request_id]
            if buffer is not None:
                buffer.release(turn)

    # -- turns ---------------------------------------------------------------------------

    def start(self, frame: protocol.CompletionRequest) -> None:
        """Start serving one turn in a task of its own (the caller checked its requestId)."""
        request_id = frame.requestId
        old = self._ended.pop(request_id, None)
        if old is not None and self.buffer is not None:
            self.buffer.release(old)
        turn = Turn(request_id, protocol.TurnFrames(self.job_id, request_id), self._now())
        if self.resume:
            turn.keep = self.buffer
        self._turns[request_id] = turn
        if self.no_turns.is_set():  # one event per busy spell: its waiters see it end
            self.no_turns = trio.Event()
        if self.turn_began is not None:
            self.turn_began.set()
        self.nursery.start_soon(self._turn, frame, turn)

    def cancel(self, request_id: str, end: TurnEnd) -> None:
        turn = self._turns.get(request_id)
        if turn is not None:
            turn.stop(end)

    async def _turn(self, frame: protocol.CompletionRequest, turn: Turn) -> None:
        request_id = frame.requestId
        if self.trace is not None:
            turn.span = self.trace.turn(request_id, frame.model, traceparent=frame.traceparent)
        try:
            end = _DONE_END
            try:
                with turn.scope:
                    try:
                        await self.forwarder.forward(frame, turn)
                    except TurnFailed as exc:
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except protocol.FrameError as exc:  # a body that cannot take its model
                        end = TurnEnd(Ending.FAILED, str(exc))
                    except ChannelClosed:
                        end = SESSION_END
            except trio.Cancelled:  # the session itself is ending: no one left to tell
                self._conclude_quietly(turn, turn.stopped or SESSION_END)
                raise
            if turn.scope.cancelled_caught:
                end = turn.stopped or _CANCELLED_END
            await self._conclude(turn, end)
        finally:
            turn.ended_at = now = self._now()
            if self.limits is not None:
                self.limits.last_active = now
            del self._turns[request_id]
            self._keep_ended(turn)
            if not self._turns:
                self.no_turns.set()

    def _keep_ended(self, turn: Turn) -> None:
        """An ended turn that keeps its frames: kept a while (the Server may not have them all),
        else let go."""
        buffer = turn.keep
        if buffer is None:
            return
        stopped = turn.stopped
        if turn.end_frame is None or (stopped is not None and stopped.ending is Ending.UNRESUMED):
            buffer.release(turn)
            return
        self._ended[turn.request_id] = turn
        self._expire_ended()

    async def _conclude(self, turn: Turn, end: TurnEnd) -> None:
        """Count, log, trace and frame one turn's outcome: the one place that does."""
        self._conclude_quietly(turn, end)
        if end.ending.framed:
            frame = protocol.error_frame(self.job_id, turn.request_id, end.message).encode()
            if turn.keep is not None and not turn.released:
                await self.relay.end(turn, frame)
            else:
                await self.send_or_drop(frame)

    def _conclude_quietly(self, turn: Turn, end: TurnEnd) -> None:
        """Count, log and trace one turn's outcome (``_conclude`` without the frame)."""
        ending = end.ending
        self.counters.inc(ending.counter)
        if ending.logged:
            log.warning("job %s request %s: %s", self.job_id, turn.request_id, end.message)
        if turn.span is not None:
            error = end.message if ending in _TRACED_ERRORS else None
            turn.span.end(ending.name.lower(), error, turn.chunks, turn.last_payload)

    async def send_or_drop(self, frame: bytes | str) -> None:
        """Send a frame that is no turn's to keep; dropped when the channel is down or closed."""
        try:
            await self.relay.out.send(frame)
        except ChannelClosed:
            pass  # the channel is ending; there is no one to tell
