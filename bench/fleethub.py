"""The hub alone in a process for ``bench.fleet``, on SQLite in a scratch directory: prints one
JSON line (its URL, admin credential, a front-door key) and serves until killed.

Run as a script (``python bench/fleethub.py DATA_DIR``) with ``PYTHONPATH`` at the checkout
whose hub is measured: it imports nothing of ``bench``, so another checkout's hub runs it too.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import trio

from gateway.hub import Hub, serve_hub

ADMIN = "alpa_bench_fleet_admin_credential"


def _log_full_collections() -> None:
    """With ``FLEET_HUB_GC`` set: one stderr line per full collection (``gc full`` when it ended
    on the system's monotonic clock, its CPU and wall ms, what it collected), so that the bench
    tells a phase's CPU that a collection of the grown heap took from the phase's own."""
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[:] = [time.thread_time(), time.perf_counter()]
        elif started:
            cpu = 1e3 * (time.thread_time() - started[0])
            wall = 1e3 * (time.perf_counter() - started[1])
            print(
                f"gc full {time.monotonic():.3f} {cpu:.1f} {wall:.1f} {info.get('collected', 0)}",
                file=sys.stderr,
                flush=True,
            )

    gc.callbacks.append(callback)


async def main() -> None:
    data_dir = sys.argv[1]
    # every runner's connections and every client's fit (the bench measures costs, not caps)
    hub = Hub(data_dir, admin_token=ADMIN, max_connections=60_000, max_sessions_per_key=1_000_000)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_hub, hub)
        key = await hub.keys.create("bench-fleet")
        print(json.dumps({"url": url, "admin": ADMIN, "key": key}), flush=True)


if __name__ == "__main__":
    if os.environ.get("FLEET_HUB_GC"):
        _log_full_collections()
    # as ``alp-gateway hub`` does before it serves (gateway/hub/cli.py), so that the bench's hub
    # collects its garbage as the shipped one does (a checkout without gateway/heap.py: as its did)
    try:
        from gateway.heap import HUB_YOUNG, settle
    except ImportError:
        gc.collect()
        gc.freeze()
    else:
        settle(HUB_YOUNG)
    trio.run(main)
