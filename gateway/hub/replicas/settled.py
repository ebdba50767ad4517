"""A team replica's front-door turn: its answer's last write held until its usage row is in the store.

A replica can be lost for good (SIGKILLed, its pod moved): a row still in its memory or its
local journal would be lost with it. So a team's turn is settled (released and its row written,
one statement: ``ReplicaLimits.settle``) as it ends, and only then does its client get the answer's
last write (the end of a stream with its ``[DONE]``, a whole answer, an error after part of
one): a client that got a turn whole finds it in the ledger whatever becomes of the replica
after. The writes before the last go out at once, as any turn's; the hold costs the client one
store round trip at the end of the turn (bench/settle.py measures it).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from gateway.hub.turn import Turn
from gateway.wire.errors import Headers


class SettledTurn(Turn):
    """A ``Turn`` whose last write waits, from ``hold()`` to ``release_held()``."""

    __slots__ = ("_holding", "_held")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._holding = False  # admitted, not released: an end written now is held
        self._held: partial[None] | None = None

    def hold(self) -> None:
        """From now on (its admission), the answer's last write waits for ``release_held``."""
        self._holding = True

    def release_held(self) -> None:
        """Its row is written (or given up on): the held last write goes out now."""
        self._holding = False
        held, self._held = self._held, None
        if held is not None:
            held()

    def _write(self, data: bytes, end: bool = False) -> None:
        if end and self._holding and self._held is None:
            if self.first_token is None:  # as the write would have set it
                self.first_token = trio.current_time()
            self._held = partial(Turn._write, self, data, True)
            return
        Turn._write(self, data, end)

    def _whole(self, status: int, body: bytes, headers: Headers) -> None:
        if self._holding and self._held is None and not self.resp.started:
            self._held = partial(Turn._whole, self, status, body, headers)
            return
        Turn._whole(self, status, body, headers)
