"""Coarse deadlines for the many waits of a server: one task cancels the scopes whose time
passed, in slots of ``GRAIN`` seconds, never early and at most a slot late.

A connection waits for each request's head within a deadline. A trio deadline set and cleared
a request costs the run loop's deadline heap a push, a lazy removal and its pruning (about 4.6
µs a request, issue 38), and a kept-alive connection's 30 s wait leaves its entry there long
after the head came; a WebSocket's keepalive deadline moves at each of its peer's pings. Filed
here instead, a wait costs a set's ``add`` and ``discard``; the sweeper wakes every ``GRAIN`` s
while anything is filed, and not at all while nothing is.
"""

from __future__ import annotations

import math

import trio

GRAIN = 0.5  # s: a deadline fires within this after its time
SHARE = 8  # a wait is never late by more than this share of it: the grain is finer for short ones


def grain_for(*waits: float) -> float:
    """The grain for deadlines this far apart: ``GRAIN``, finer when the shortest of them (0:
    none) is under ``SHARE`` grains (a test's keepalive of 0.1 s)."""
    return min([GRAIN, *(wait / SHARE for wait in waits if wait > 0)])


class Sweeper:
    """Cancel scopes filed with their deadline (``file``, ``unfile``), cancelled once it
    passed by ``run``, the one task that sweeps them."""

    __slots__ = ("grain", "_slots", "_filed")

    def __init__(self, grain: float = GRAIN) -> None:
        self.grain = grain
        self._slots: dict[int, set[trio.CancelScope]] = {}  # slot → the scopes due by its end
        self._filed: trio.Event | None = None  # ``run`` waits on it while nothing is filed

    def file(self, scope: trio.CancelScope, at: float) -> int:
        """Cancel ``scope`` once the trio clock passes ``at`` (within ``grain``); the slot it
        is filed in, for ``unfile`` (-1 for ``inf``: never, nothing filed)."""
        if at == math.inf:
            return -1
        slot = math.ceil(at / self.grain)
        scopes = self._slots.get(slot)
        if scopes is None:
            self._slots[slot] = scopes = set()
            filed = self._filed
            if filed is not None:
                self._filed = None
                filed.set()
        scopes.add(scope)
        return slot

    def sooner(self, scope: trio.CancelScope, slot: int, at: float) -> int:
        """``scope``, filed in ``slot``, cancelled at ``at`` instead if that is sooner; its
        slot now."""
        if at == math.inf or math.ceil(at / self.grain) >= slot >= 0:
            return slot
        return self.move(scope, slot, at)

    def move(self, scope: trio.CancelScope, slot: int, at: float) -> int:
        """``scope``, filed in ``slot``, cancelled at ``at`` instead; its slot now."""
        if at != math.inf and math.ceil(at / self.grain) == slot:
            return slot  # the same slot: nothing to move
        self.unfile(scope, slot)
        return self.file(scope, at)

    def unfile(self, scope: trio.CancelScope, slot: int) -> None:
        """``scope`` no longer has the deadline it was filed with in ``slot``."""
        scopes = self._slots.get(slot)
        if scopes is not None:
            scopes.discard(scope)

    def sweep(self, now: float) -> int:
        """Cancel the scopes whose slot ended by ``now``; how many were."""
        last = math.floor(now / self.grain)
        due = [slot for slot in self._slots if slot <= last]
        cancelled = 0
        for slot in due:
            for scope in self._slots.pop(slot):
                scope.cancel()
                cancelled += 1
        return cancelled

    async def run(self) -> None:
        """Sweep every ``grain`` s while anything is filed; until cancelled."""
        while True:
            if not self._slots:
                self._filed = filed = trio.Event()
                await filed.wait()
            await trio.sleep(self.grain)
            self.sweep(trio.current_time())
