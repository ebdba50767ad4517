"""A front-door turn's states (each final one with the outcome it records) and the exceptions its
task raises when its channel ends under it. Pure: no trio."""

from __future__ import annotations

import enum


class State(enum.Enum):
    """Where a turn is. A final state carries the outcome its usage row and metrics record, and
    whether the client is owed an error event (its answer was cut)."""

    WAITING = ("waiting", "", False)  # admitted; looking for a channel (queue, dial, redial)
    SENT = ("sent", "", False)  # its request is on a channel; no chunk yet
    ANSWERING = ("answering", "", False)  # chunks came (to the client, or gathered)
    # its channel went mid-answer: it waits for the redial (resume) or another runner (continued)
    SUSPENDED = ("suspended", "", False)
    DONE = ("done", "ok", True)  # the runner finished it
    FAILED = ("failed", "error", True)  # the runner (its backend) reported an error
    LOST = ("lost", "lost", True)  # its channel was lost mid-answer
    CLIENT_GONE = ("client_gone", "client_gone", True)  # the client left before the end
    OVERRUN = ("overrun", "client_gone", True)  # the client read too slowly (backlog bound)
    REFUSED = ("refused", "refused", True)  # answered with an error before a runner served it
    CUT = ("cut", "cut", True)  # the hub stopped under it

    def __init__(self, label: str, outcome: str, final: bool) -> None:
        self.label = label
        self.outcome = outcome
        self.final = final


class TurnLost(Exception):
    """The turn's channel ended before its client got any of the answer: it can be served again
    (the same job redialled, or another runner)."""


class TurnSuspended(Exception):
    """The turn's channel ended mid-answer: the turn waits to be resumed on the job's redialled
    channel, or continued on another runner (``Serving``)."""


__all__ = ["State", "TurnLost", "TurnSuspended"]
