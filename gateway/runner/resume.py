"""A Chat Job's recent frames, kept by reference for a resume (docs/protocol.md §6): at most
``resume_buffer`` bytes, oldest trimmed first, and what a redialled channel can be sent again.

While the channel is up, each backend read of a turn that keeps its frames adds one entry (the
frame, or the list of frames the read made, the very objects the socket was offered: no copy)
and nothing per chunk; past the bound the oldest entries go, several at once (down to three
quarters of it, so that trimming is rare). While the channel is down the turns go on and their
frames, never sent, are kept whole: past the bound the frames that were sent go first, then the
turn that needs more is stopped (``Ending.UNRESUMED``) and its frames let go.

A turn's frames are let go (``release``) when it no longer needs them; entries of released
turns are skipped, and dropped in one pass once they hold an eighth of the bound (or are most of
the entries): the memory held is at most ``limit`` bytes of kept frames and an eighth of it of
frames let go.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from gateway.runner.turn import Ending, Turn, TurnEnd

# one backend read's frames: (turn, index of its first chunk frame, frame or frames, bytes)
Entry = tuple[Turn, int, bytes | list[bytes], int]

OVERFLOW = TurnEnd(Ending.UNRESUMED, "its frames outgrew resume_buffer while the channel was down")
_PURGE_AT = 256  # dead entries tolerated before a pass drops them (when they are most)


class ResumeBuffer:
    """The kept frames of one Chat Job's channel: ``limit`` bytes at most while it is up."""

    __slots__ = ("entries", "bytes", "limit", "sent", "dead", "dead_bytes", "on_lost")

    def __init__(self, limit: int, on_lost: Callable[[Any], None]) -> None:
        self.entries: deque[Entry] = deque()
        self.bytes = 0
        self.limit = limit
        # while the channel is down: how many of the oldest entries were sent before it went
        # (those may be trimmed; the rest never left); None while it is up
        self.sent: int | None = None
        self.dead = 0  # entries of released turns still in ``entries``
        self.dead_bytes = 0  # and their bytes
        self.on_lost = on_lost  # a send found this outlet closed: the channel is down, if it was

    # -- adding (the per-read path: one append, one length) --------------------------------

    def add(self, turn: Turn, frame: bytes) -> None:
        """Keep one chunk frame of ``turn`` (its index: ``turn.chunks``, counted after)."""
        size = len(frame)
        self.entries.append((turn, turn.chunks, frame, size))
        self.bytes += size
        turn.kept_bytes += size
        turn.kept_entries += 1
        if self.bytes > self.limit:
            self.over(turn)

    def add_batch(self, turn: Turn, frames: list[bytes]) -> None:
        """Keep the chunk frames one read made, as one entry (the list itself)."""
        size = sum(map(len, frames))
        self.entries.append((turn, turn.chunks, frames, size))
        self.bytes += size
        turn.kept_bytes += size
        turn.kept_entries += 1
        if self.bytes > self.limit:
            self.over(turn)

    def lost(self, out: Any, unsent: int = 0) -> None:
        """A send to ``out`` found it closed (the last ``unsent`` entries were not sent)."""
        self.on_lost(out)
        if self.sent is not None and unsent:
            self.sent = max(0, self.sent - unsent)

    # -- the bound ---------------------------------------------------------------------

    def over(self, turn: Turn) -> None:
        """Past the bound, after ``turn`` added: trim; while down, stop ``turn`` if needed."""
        if self.sent is None:
            self._trim(self.limit * 3 // 4)
            return
        self._trim(self.limit)
        if self.bytes > self.limit:  # only frames never sent are left: they cannot go
            turn.stop(OVERFLOW)
            self.release(turn)

    def _trim(self, target: int) -> None:
        entries = self.entries
        down = self.sent is not None
        while self.bytes > target and entries:
            if down:
                if not self.sent:
                    return
                self.sent -= 1
            turn, first, frames, size = entries.popleft()
            if turn.released:
                self.dead -= 1
                self.dead_bytes -= size
                continue
            self.bytes -= size
            turn.kept_bytes -= size
            turn.kept_entries -= 1
            turn.kept_from = first + (1 if isinstance(frames, bytes) else len(frames))

    # -- the channel's state -------------------------------------------------------------

    def down(self) -> None:
        """The channel went down: what is kept now was sent; what comes was not."""
        if self.sent is None:
            self.sent = len(self.entries)

    def up(self) -> None:
        """A channel is up again (every kept frame was sent again, or let go)."""
        self.sent = None
        if self.bytes > self.limit:
            self._trim(self.limit * 3 // 4)

    def release(self, turn: Turn) -> None:
        """``turn``'s frames are no longer needed: let them go (its entries become dead)."""
        if turn.released:
            return
        turn.released = True
        self.bytes -= turn.kept_bytes
        self.dead += turn.kept_entries
        self.dead_bytes += turn.kept_bytes
        turn.kept_bytes = turn.kept_entries = 0
        if self.dead_bytes > self.limit // 8 or (
            self.dead > _PURGE_AT and self.dead * 2 > len(self.entries)
        ):
            self._purge()

    def _purge(self) -> None:
        entries = self.entries
        if self.sent is not None:
            self.sent -= sum(1 for i in range(self.sent) if entries[i][0].released)
        self.entries = deque(e for e in entries if not e[0].released)
        self.dead = self.dead_bytes = 0

    # -- a resume ------------------------------------------------------------------------

    def frames_from(self, turn: Turn, n: int) -> list[bytes] | None:
        """``turn``'s chunk frames from index ``n`` on (0-based over its chunk frames), in
        order; None when they are not all kept (trimmed, released, or more than it sent)."""
        if turn.released or n < turn.kept_from or n > turn.chunks:
            return None
        out: list[bytes] = []
        for owner, first, frames, _size in self.entries:
            if owner is not turn:
                continue
            if isinstance(frames, bytes):
                if first >= n:
                    out.append(frames)
            elif first >= n:
                out.extend(frames)
            elif first + len(frames) > n:
                out.extend(frames[n - first :])
        if len(out) != turn.chunks - n:
            return None  # not reached: every chunk frame of a keeping turn has an entry
        return out
