"""One turn in flight on a Chat Channel: all that is kept of it in one record, and how it ends.

The channel makes a ``Turn`` when the request frame comes and drops it when the turn's task
ends; the relay reads it on every backend read (was it stopped?) and fills in what it relayed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from gateway.wire.protocol import TurnFrames

if (
    TYPE_CHECKING
):  # imported only when tracing is on (Runner.run: gateway.runner.otel.Tracing.start)
    from gateway.runner.otel import TurnTrace


class Ending(enum.Enum):
    """How a turn ended: the counter it adds to, whether the Server is told (an error frame)
    and whether it is worth a log line. ``Channel._conclude`` does all three, in one place."""

    DONE = ("turns_done", False, False)
    FAILED = ("turns_error", True, True)
    CANCELLED = ("turns_cancelled", True, False)  # the Server asked (chat.completion.cancel)
    SHUTDOWN = ("turns_cancelled", True, True)  # the runner is shutting down
    SESSION_ENDED = ("turns_cancelled", False, False)  # chat.end or the channel is gone
    # its channel dropped and it was not resumed (docs/protocol.md §6): no redial in time, a
    # redial that did not name it, its kept frames past the bound; any frame is the resume's
    UNRESUMED = ("turns_cancelled", False, True)

    def __init__(self, counter: str, framed: bool, logged: bool) -> None:
        self.counter = counter
        self.framed = framed
        self.logged = logged


@dataclass(frozen=True)
class TurnEnd:
    """One turn's outcome: how it ended and the message the Server and the log get."""

    ending: Ending
    message: str = ""


@dataclass(eq=False, slots=True)
class Turn:
    """One turn: its request, its frames, its cancel scope and everything its relay tracks."""

    request_id: str
    frames: TurnFrames  # its chunk and done frames (the encoder's, made once)
    arrived: float  # trio clock: when its request frame came (TTFT counts from here)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    span: TurnTrace | None = None  # its trace span (tracing on)
    # why it was stopped; set, it is its cancel flag: nothing more is sent for it
    stopped: TurnEnd | None = None
    first_token: float | None = None  # trio clock: when its first chunk was read (None: not yet)
    chunks: int = 0  # chunk frames offered
    last_payload: bytes = b""  # the last of them (the usage chunk, if any)
    # -- a resume (docs/protocol.md §6), when its channel negotiated one --
    # where its frames are kept (a ``gateway.runner.resume.ResumeBuffer``; None: they are not)
    keep: Any = None
    # its stream's ``gateway.runner.relay.Pump`` while it streams (its outlet is swapped)
    pump: Any = None
    kept_from: int = 0  # the index of its first chunk frame still kept
    kept_bytes: int = 0  # the bytes of its frames kept
    kept_entries: int = 0  # the entries (one backend read's frames each) kept
    released: bool = False  # its kept frames are let go (those left in the buffer are dead)
    end_frame: bytes | None = None  # its done or error frame, once it has one
    ended_at: float | None = None  # trio clock: when its task ended (None: it runs)
    # -- a continuation on another backend after a fault (None: its payloads are not kept) --
    relayed: list[list[bytes]] | None = None  # the payloads relayed, one list per read

    def stop(self, end: TurnEnd) -> None:
        """Stop the turn (the first reason given is kept): its relay sends nothing more, and
        its task is cancelled."""
        if self.stopped is None:
            self.stopped = end
        self.scope.cancel()
