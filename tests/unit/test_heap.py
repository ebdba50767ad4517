"""``gateway.heap.settle``: what is alive moves to the permanent generation, and the hub's young
threshold is set (the older generations' kept), so a server's short-lived objects die young."""

from __future__ import annotations

import gc

from gateway.heap import HUB_YOUNG, settle


def test_settle_freezes_what_is_alive_and_sets_the_young_threshold() -> None:
    before = gc.get_threshold()
    kept = [[n] for n in range(1000)]  # tracked containers alive at the time
    try:
        settle(HUB_YOUNG)
        assert gc.get_freeze_count() >= len(kept)
        assert gc.get_threshold() == (HUB_YOUNG, before[1], before[2])
        settle()  # the runner's: the threshold left as it is
        assert gc.get_threshold()[0] == HUB_YOUNG
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert HUB_YOUNG > before[0]  # larger than CPython's default young threshold
