"""The one signal loop of every command: SIGINT/SIGTERM once to stop gently, again to stop now."""

from __future__ import annotations

import signal
from collections.abc import Callable

import trio

SIGNAL_ECHO = 0.5  # s: the same signal again this soon is one signal delivered twice


async def watch_signals(
    first: Callable[[int], None],
    again: Callable[[int], None] | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call ``first(signum)`` on the first SIGINT/SIGTERM, then ``again(signum)`` on the next
    one and return (without ``again``: return after the first). Start it with
    ``nursery.start``: the signals are caught from the moment it has started.

    The same signal again within half a second counts as the first one: a frozen binary's
    launcher forwards a signal its process group also received, so a single
    ``kill -TERM -PGID`` (or systemd's default KillMode) arrives twice."""
    seen: tuple[int, float] | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
        task_status.started()
        async for signum in received:
            now = trio.current_time()
            if seen is None:
                seen = (signum, now)
                first(signum)
                if again is None:
                    return
            elif signum == seen[0] and now - seen[1] < SIGNAL_ECHO:
                continue
            else:
                assert again is not None  # returned after the first signal otherwise
                again(signum)
                return
