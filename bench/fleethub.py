"""The hub alone in a process for ``bench.fleet``, on SQLite in a scratch directory: prints one
JSON line (its URL, admin credential, a front-door key) and serves until killed.

Run as a script (``python bench/fleethub.py DATA_DIR``) with ``PYTHONPATH`` at the checkout
whose hub is measured: it imports nothing of ``bench``, so another checkout's hub runs it too.
"""

from __future__ import annotations

import json
import sys

import trio

from gateway.hub import Hub, serve_hub

ADMIN = "alpa_bench_fleet_admin_credential"


async def main() -> None:
    data_dir = sys.argv[1]
    # every runner's connections and every client's fit (the bench measures costs, not caps)
    hub = Hub(data_dir, admin_token=ADMIN, max_connections=60_000, max_sessions_per_key=1_000_000)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_hub, hub)
        key = await hub.keys.create("bench-fleet")
        print(json.dumps({"url": url, "admin": ADMIN, "key": key}), flush=True)


if __name__ == "__main__":
    trio.run(main)
