"""The server's coarse deadlines (``gateway.wire.sweeper``): a filed scope is cancelled once its
time passed, never before and at most a slot after; unfiled or moved sooner as a head wait
does; the sweeping task asleep while nothing is filed."""

from __future__ import annotations

import math

import trio
import trio.testing

from gateway.wire.sweeper import GRAIN, SHARE, Sweeper, grain_for


class Counting(Sweeper):
    """A sweeper that counts its sweeps (its wakes)."""

    __slots__ = ("sweeps",)

    def __init__(self) -> None:
        super().__init__()
        self.sweeps = 0

    def sweep(self, now: float) -> int:
        self.sweeps += 1
        return super().sweep(now)


async def test_a_filed_scope_is_cancelled_after_its_time_never_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sweeper = Sweeper()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sweeper.run)
        for wait in (0.1, 3.0, 7.25):
            start = trio.current_time()
            with trio.CancelScope() as scope:
                sweeper.file(scope, start + wait)
                await trio.sleep_forever()
            assert scope.cancelled_caught
            assert wait <= trio.current_time() - start <= wait + GRAIN
        nursery.cancel_scope.cancel()


async def test_an_unfiled_scope_is_left_alone_and_a_sooner_time_moves_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sweeper = Sweeper()
    now = trio.current_time()
    kept, moved, later = trio.CancelScope(), trio.CancelScope(), trio.CancelScope()
    slot = sweeper.file(kept, now + 5)
    sweeper.unfile(kept, slot)
    moved_slot = sweeper.file(moved, now + 30)
    moved_slot = sweeper.sooner(moved, moved_slot, now + 10)
    later_slot = sweeper.file(later, now + 10)
    assert sweeper.sooner(later, later_slot, now + 20) == later_slot  # later: not moved
    assert sweeper.sweep(now + 9.9) == 0
    assert sweeper.sweep(now + 10 + GRAIN) == 2
    assert moved.cancel_called and later.cancel_called and not kept.cancel_called
    assert sweeper.sweep(now + 100) == 0  # the first filing of ``moved`` was taken back
    assert sweeper.file(kept, math.inf) == -1  # never: nothing filed
    sweeper.unfile(kept, -1)
    assert sweeper.sweep(now + 1e9) == 0


async def test_the_sweeper_sleeps_while_nothing_is_filed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hub with no head awaited costs its sweeper no wake; one deadline costs it a wake a
    ``GRAIN`` until it passed, then none again."""
    sweeper = Counting()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sweeper.run)
        await trio.sleep(1000)
        assert sweeper.sweeps == 0
        with trio.CancelScope() as scope:
            sweeper.file(scope, trio.current_time() + 2)
            await trio.sleep_forever()
        woke = sweeper.sweeps
        assert 2 / GRAIN <= woke <= 2 / GRAIN + 2
        await trio.sleep(1000)
        assert sweeper.sweeps == woke
        nursery.cancel_scope.cancel()


def test_the_grain_is_finer_for_short_waits() -> None:
    """A wait is late by at most a ``SHARE``th of it: the hub's defaults sweep every ``GRAIN``,
    a keepalive of 0.1 s (the tests') every 12.5 ms; a wait of 0 (none) does not count."""
    assert grain_for(10.0, 20.0, 20.0) == GRAIN
    assert grain_for(10.0, 0.1, 0.1) == 0.1 / SHARE
    assert grain_for(0.0, 0.0) == GRAIN
    assert Sweeper(grain_for(2.0)).grain == 2.0 / SHARE
