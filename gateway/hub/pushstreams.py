"""The runners' push streams kept alive by one hub task: a keepalive comment on each stream that
has been quiet for the interval, written by a ticker that wakes about once a second for the
whole fleet, instead of a timer (a cancellation, a task's wake) per stream and interval.

A stream is registered while its runner is subscribed (``kept``); a write of the stream's own
(``wrote``: a ``job_available``) restarts its interval. The streams are kept oldest write first,
so a tick looks only at those due. A stream whose socket has not taken what was written before
(a slow or dead path) gets no keepalive on top: its runner is not waiting on silence.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import trio

from gateway.wire.errors import ClientGone

KEEPALIVE = b": keepalive\n\n"
TICK = 1.0  # s between the ticker's wakes, at most (a quarter of the interval when shorter)


class Stream(Protocol):
    """What the ticker needs of a push stream's response (``gateway.wire.http.Response``)."""

    gone: bool

    @property
    def backlog(self) -> int: ...

    def write_nowait(self, data: bytes, before: bytes = b"", end: bool = False) -> bool: ...


class PushStreams:
    """The open push streams, by their last write (see the module's docstring)."""

    def __init__(self, quiet: Callable[[], float]) -> None:
        self._quiet = quiet  # s a stream may stay silent (read at each tick: settings reload)
        self._streams: OrderedDict[Stream, float] = OrderedDict()  # oldest write first
        self.keepalives = 0  # comments written
        self.ticks = 0  # the ticker's wakes

    def __len__(self) -> int:
        return len(self._streams)

    @contextmanager
    def kept(self, stream: Stream) -> Iterator[None]:
        """``stream`` kept alive while the block runs (its head just written)."""
        self._streams[stream] = trio.current_time()
        try:
            yield
        finally:
            self._streams.pop(stream, None)

    def wrote(self, stream: Stream) -> None:
        """The stream wrote an event of its own: its quiet interval starts again."""
        if stream in self._streams:
            self._streams.move_to_end(stream)
            self._streams[stream] = trio.current_time()

    def tick(self, now: float) -> float:
        """A keepalive on every stream quiet for the interval by ``now``; when the next is due."""
        quiet = self._quiet()
        streams = self._streams
        while streams:
            stream, last = next(iter(streams.items()))
            if last + quiet > now:
                return last + quiet
            streams.move_to_end(stream)
            streams[stream] = now
            if stream.gone or stream.backlog:
                continue  # its socket has not taken what it was given: not silent
            try:
                stream.write_nowait(KEEPALIVE)
            except ClientGone:  # its own task sees the stream end
                continue
            self.keepalives += 1
        return now + quiet

    async def run(self) -> None:
        """The ticker, until cancelled."""
        while True:
            now = trio.current_time()
            due = self.tick(now)
            self.ticks += 1
            await trio.sleep_until(max(due, now + min(TICK, self._quiet() / 4)))
