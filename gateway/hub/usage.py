"""The hub's book of turns: which are in flight now, and (to come) what each key used."""

from __future__ import annotations

from gateway.hub.turns import TurnRecord


class UsageBook:
    """Every front-door turn passes here: ``admit`` before it is served (a limit refuses it with
    an HTTPError), ``started`` once it is, ``ended`` when it is over, whatever the outcome."""

    def __init__(self) -> None:
        self.in_flight: dict[int, TurnRecord] = {}

    def admit(self, record: TurnRecord) -> None:
        """Raise HTTPError (429) when the turn would pass one of its key's limits."""

    def started(self, record: TurnRecord) -> None:
        self.in_flight[id(record)] = record

    def ended(self, record: TurnRecord) -> None:
        self.in_flight.pop(id(record), None)
