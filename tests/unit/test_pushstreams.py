"""The runners' push streams kept alive by one ticker (``gateway.hub.pushstreams``), in memory on
trio's autojump clock: every quiet stream gets its keepalive within the interval and a tick, a
stream that writes its own events gets none, a stream whose socket is backed up gets none on
top, a stream gone is skipped; and the ticker wakes about once a second for the whole fleet,
not once a stream and interval."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
import trio.testing

from gateway.hub.pushstreams import KEEPALIVE, TICK, PushStreams
from gateway.wire.errors import ClientGone

QUIET = 10.0


@dataclass(eq=False)
class FakeStream:
    """A push stream's response: what was written, when."""

    gone: bool = False
    backlog: int = 0
    raises: bool = False
    writes: list[float] = field(default_factory=list)

    def write_nowait(self, data: bytes, before: bytes = b"", end: bool = False) -> bool:
        assert data == KEEPALIVE and not before and not end
        if self.raises:
            raise ClientGone()
        self.writes.append(trio.current_time())
        return True


async def test_one_ticker_keeps_a_fleets_quiet_streams_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    streams = PushStreams(lambda: QUIET)
    fleet = [FakeStream() for _ in range(1000)]
    busy, backed_up = FakeStream(), FakeStream(backlog=1)
    gone, broken = FakeStream(gone=True), FakeStream(raises=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(streams.run)
        with (
            streams.kept(busy),
            streams.kept(backed_up),
            streams.kept(gone),
            streams.kept(broken),
        ):
            nursery.start_soon(_writes_often, streams, busy)
            opened = {}
            for stream in fleet:  # the streams open spread over one interval
                await trio.sleep(QUIET / len(fleet))
                opened[stream] = trio.current_time()
                nursery.start_soon(_kept, streams, stream)
            await trio.sleep(6 * QUIET)
            end = trio.current_time()
            nursery.cancel_scope.cancel()
    for stream in fleet:
        times = [opened[stream], *stream.writes]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert len(stream.writes) >= 5  # none silent for an interval and a tick
        assert all(QUIET <= gap <= QUIET + TICK for gap in gaps), gaps
        assert end - times[-1] <= QUIET + TICK
    assert busy.writes == [] and backed_up.writes == [] and gone.writes == []
    assert broken.writes == []  # ClientGone from a write: skipped, the ticker goes on
    assert streams.keepalives == sum(len(s.writes) for s in fleet)
    # about a wake a second for 1,000 streams (not a wake per stream and interval: ~100 a second)
    assert streams.ticks <= (end - fleet_start(opened)) / TICK + 2
    assert len(streams) == 0  # every stream left as its block ended


def fleet_start(opened: dict[FakeStream, float]) -> float:
    return min(opened.values()) - QUIET / 1000


async def _kept(streams: PushStreams, stream: FakeStream) -> None:
    with streams.kept(stream):
        await trio.sleep_forever()


async def _writes_often(streams: PushStreams, stream: FakeStream) -> None:
    """A stream with events of its own, more often than the interval."""
    while True:
        streams.wrote(stream)
        await trio.sleep(QUIET / 4)
