"""The hub's counters of dead paths: keepalive pings, pong timeouts, dead channels, failovers."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("gateway.hub")


@dataclass
class HubCounters:
    """Counted since the hub started; ``GET /api/hub/counters`` lists them, each change is logged."""

    pings_sent: int = 0  # WebSocket pings sent on Chat Channels (the server's keepalive)
    pong_timeouts: int = 0  # channels silent past the ping timeout, closed with 1011
    channels_dead: int = 0  # channels that ended without a close handshake (or offline)
    failovers: int = 0  # turns moved to a new Chat Job because their session's channel was gone
    # of those: moved at once, another capable runner being free (no wait for the redial)
    failovers_immediate: int = 0
    redial_waits: int = 0  # turns that waited for a dropped channel's redial (no other runner free)
    ws_protocol_errors: int = 0  # WebSockets failed for a protocol violation (1002/1007/1009)
    connections_refused: int = 0  # connections refused past max_connections (or on EMFILE)
    turns_overrun: int = 0  # turns ended because their client read too slowly (backlog bound)
    queued: int = 0  # requests for a new session that waited in the queue (runners at capacity)
    queue_timeouts: int = 0  # of those: 503 queue_timeout (no runner took them within queue_wait)
    queue_full: int = 0  # requests refused at once with 503 queue_full (queue_length waiting)
    turns_resumed: int = 0  # turns whose channel dropped mid-answer, resumed on its redial
    turns_continued: int = 0  # turns continued on another runner (their runner or path gone)

    def as_json(self) -> dict[str, int]:
        """The counters by name, camelCase as the admin routes answer."""
        return {_camel(k): v for k, v in asdict(self).items()}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
