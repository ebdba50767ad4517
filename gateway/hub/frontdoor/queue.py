"""The fair queue of one project's new chat sessions while its runners are at capacity: pure
logic (no trio, no I/O); ``Sessions.open_job`` drives it.

Requests wait in lanes, one per API key, FIFO within a lane; lanes take turns (round-robin):
the order of service interleaves the lanes, one request of each in turn, starting with the lane
whose turn it is. A lane whose request is served goes to the back of the rotation; a new lane
joins at the back. So a key's burst cannot starve another key: one request of the burst, then
the other key's, then the burst again.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.hub.board import Job

RECENT_WAITS = 256  # the last waits kept for the metrics (seconds each)


@dataclass(eq=False)
class Entry:
    """One request waiting for a runner to take its new Chat Job."""

    lane: str  # its API key's id (or the purpose of a hub-made session: model listing)
    arrived: float  # trio clock
    job: Job | None = (
        None  # the board's Job while it holds one (opened, not claimed yet), else None
    )
    waited: bool = False  # it waited with every capable runner at capacity (counted as queued)


class FairQueue:
    """One project's waiting requests: round-robin across lanes (API keys), FIFO within one."""

    def __init__(self) -> None:
        self._lanes: OrderedDict[str, deque[Entry]] = OrderedDict()  # in rotation order

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes.values())

    def __contains__(self, entry: Entry) -> bool:
        lane = self._lanes.get(entry.lane)
        return lane is not None and entry in lane

    def join(self, entry: Entry) -> None:
        """At the end of its lane (a new lane at the back of the rotation)."""
        lane = self._lanes.get(entry.lane)
        if lane is None:
            lane = self._lanes[entry.lane] = deque()
        lane.append(entry)

    def leave(self, entry: Entry, served: bool = False) -> None:
        """Out of the queue; ``served``: it got its runner, and its lane's turn is over (the lane
        goes to the back of the rotation). A request that gave up leaves the rotation as it is."""
        lane = self._lanes.get(entry.lane)
        if lane is None or entry not in lane:
            return
        lane.remove(entry)
        if not lane:
            del self._lanes[entry.lane]
        elif served:
            self._lanes.move_to_end(entry.lane)

    def order(self) -> list[Entry]:
        """Every waiting request in the order it would be served: the lanes interleaved, one
        request each in turn, from the lane whose turn it is."""
        lanes = list(self._lanes.values())
        out: list[Entry] = []
        depth = max((len(lane) for lane in lanes), default=0)
        for i in range(depth):
            out.extend(lane[i] for lane in lanes if i < len(lane))
        return out

    def position(self, entry: Entry) -> tuple[int, int]:
        """(its position in the order of service from 1, how many wait); a request not in the
        queue: the place it would take if it joined now, of one more."""
        if entry in self:
            return self.order().index(entry) + 1, len(self)
        self.join(entry)
        try:
            return self.order().index(entry) + 1, len(self)
        finally:
            self.leave(entry)

    def lanes(self) -> dict[str, int]:
        """Requests waiting per lane, in rotation order."""
        return {key: len(lane) for key, lane in self._lanes.items()}


@dataclass
class WaitStats:
    """How long requests waited in the queues (those that did: ``Entry.waited``), by how it
    ended: served (a runner took the job), timed out, or the client left."""

    count: int = 0
    total: float = 0.0  # s, summed
    longest: float = 0.0  # s
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_WAITS))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.longest = max(self.longest, seconds)
        self.recent.append(seconds)


@dataclass(frozen=True)
class QueueStats:
    """The queues now, for a metrics endpoint (``Sessions.queue_stats()``)."""

    depth: dict[str, int]  # "owner/project" -> requests waiting now (projects with any)
    waits: int  # requests that waited and are done waiting (served, timed out, or left)
    wait_seconds: float  # their waits, summed
    longest_wait: float  # s: the longest of them
    recent_waits: tuple[float, ...]  # s: the last RECENT_WAITS of them, oldest first
