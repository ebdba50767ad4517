"""A front-door turn's states and the one table of their moves (each final state with its outcome).
The one move that holds a turn to the table, and the exceptions its task raises when its channel
ends under it, are here too. Pure: no trio.

h11's ``_state.py`` is the model: the moves are data (``NEXT``), checked in one place
(``TurnState._move``); a move the table lacks is a bug in the hub, refused with ``BadMove``
rather than written. A final state has no move out: the first one a turn reaches is its outcome.
"""

from __future__ import annotations

import enum
from operator import attrgetter
from typing import TYPE_CHECKING


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

    moves: tuple[State, ...]  # the states it may move to (``NEXT``), for ``TurnState._move``

    def __init__(self, label: str, outcome: str, final: bool) -> None:
        self.label = label
        self.outcome = outcome
        self.final = final


# Ends a turn may reach wherever it is: the hub stops (or its key is revoked), its client leaves,
# or reads too slowly (a keepalive or an error event is a write too).
_ANYWHERE = (State.CUT, State.CLIENT_GONE, State.OVERRUN)

# From each state, the states a turn may move to; a final state has none.
NEXT: dict[State, frozenset[State]] = {
    # a channel found: its request sent (only a turn none of whose answer was gathered or
    # written waits: a continuation goes on ``ANSWERING``); or an error before any runner had
    # it (a limit, no runner: refused), or after runners had it (lost too often, a runner that
    # cannot serve it: failed)
    State.WAITING: frozenset({State.SENT, State.REFUSED, State.FAILED, *_ANYWHERE}),
    # the first chunk (or write) came; or the channel went before it did (waiting again);
    # or the runner ended it (done, or failed: its error, an empty or too large answer)
    State.SENT: frozenset({State.WAITING, State.ANSWERING, State.DONE, State.FAILED, *_ANYWHERE}),
    # its channel went: mid-answer (suspended: resumed or continued next), or with nothing
    # sent to its client (a non-streamed turn's gathered chunks: waiting again); or its end
    State.ANSWERING: frozenset(
        {State.WAITING, State.SUSPENDED, State.DONE, State.FAILED, State.LOST, *_ANYWHERE}
    ),
    # resumed on the redialled channel or continued on another runner (answering again); or
    # neither (lost); or the runner's last frames on the channel it is leaving
    State.SUSPENDED: frozenset({State.ANSWERING, State.DONE, State.FAILED, State.LOST, *_ANYWHERE}),
    **{state: frozenset() for state in State if state.final},
}
for _at, _to in NEXT.items():  # a tuple's ``in`` hashes nothing (an Enum's hash is Python)
    _at.moves = tuple(state for state in State if state in _to)
del _at, _to


class BadMove(Exception):
    """A move the table (``NEXT``) lacks: a bug in the hub, never a client's or a runner's doing."""

    def __init__(self, turn: object, current: State, to: State) -> None:
        allowed = ", ".join(s.label for s in current.moves) or "none, it has ended"
        super().__init__(
            f"{turn!r}: no move from {current.label} to {to.label} (from {current.label}: {allowed})"
        )
        self.current = current
        self.to = to


class TurnState:
    """What moves a turn: its state, read-only from outside (``state``), changed only by
    ``_move``. A turn starts ``WAITING`` (its constructor sets ``_state``, not a move)."""

    __slots__ = ("_state",)

    _state: State

    if TYPE_CHECKING:

        @property
        def state(self) -> State: ...

    else:
        # read-only; a getter that runs no Python frame (read on every turn's path)
        state = property(attrgetter("_state"), doc="Where the turn is (``State``).")

    def _move(self, to: State) -> None:
        """The one place a turn's state changes: to a state ``NEXT`` allows from where it is,
        else ``BadMove`` (and the state stays)."""
        current = self._state
        if to not in current.moves:
            raise BadMove(self, current, to)
        self._state = to


class TurnLost(Exception):
    """The turn's channel ended before its client got any of the answer: it can be served again
    (the same job redialled, or another runner)."""


class TurnSuspended(Exception):
    """The turn's channel ended mid-answer: the turn waits to be resumed on the job's redialled
    channel, or continued on another runner (``Serving``)."""


__all__ = ["NEXT", "BadMove", "State", "TurnLost", "TurnState", "TurnSuspended"]
