"""The PostgreSQL store's per-turn calls, µs each, both ways: libpq's non-blocking calls driven
from trio (``TrioConnection``: the hub's way) and libpq's blocking calls in a worker thread
(``ThreadConnection``, one ``trio.to_thread.run_sync`` hop per call); ``bench/store_calls.py``
runs it after SQLite's figures.

Each round measures every call both ways, one after the other (the order alternates between
rounds); the medians of the rounds are printed: wall and CPU time per call of the hub's process
(CPU: the whole process, every thread), and the database server's CPU per call (its backends'
counters, when the server runs on this machine). The calls: ``check_api_key`` (10 active keys),
``save_session``, ``add_usage`` (one row written now), a usage batch of 32 rows (``flush_usage``,
what the writer does), each one call after another; then 16 tasks calling ``check_api_key`` and
``save_session`` at once through a pool of 4 connections (a loaded hub). The server is a
throwaway one (``tests/support/pgserver.py``, on loopback) unless ``--postgres URL`` names one."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import trio

from bench.common import cpu_seconds
from gateway.hub.store import Store, StoredSession, UsageRecord
from gateway.hub.store.postgres import PostgresStore
from gateway.hub.store.postgres_io import APPLICATION

KEYS = 10
BATCH = 32
TASKS = 16
POOL = 4
WAYS = ("trio, non-blocking", "worker thread")

Call = Callable[[int], Awaitable[object]]


def _record(n: int) -> UsageRecord:
    return UsageRecord(
        "id-alice", "alice", f"s{n % 8}", "chat", "m", True, "ok", "r-1", "j-1", 12, 34, 0.1, 1.0
    )


def _backends(url: str) -> list[int]:
    """The server processes serving the store's connections to ``url``'s database (none when
    the server is not on this machine)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s",
            (APPLICATION,),
        ).fetchall()
    return [pid for (pid,) in rows if Path(f"/proc/{pid}").exists()]


async def _per_call(
    call: Call, n: int, backends: list[int], tasks: int = 1
) -> tuple[float, float, float]:
    """µs of wall, of the process's CPU and of the server's CPU per call, over ``n`` calls
    (made by ``tasks`` tasks at once)."""
    server = sum(cpu_seconds(pid) for pid in backends)
    wall, cpu = time.perf_counter(), time.process_time()

    async def share(first: int) -> None:
        for i in range(first, n, tasks):
            await call(i)

    async with trio.open_nursery() as nursery:
        for t in range(tasks):
            nursery.start_soon(share, t)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    server = sum(cpu_seconds(pid) for pid in backends) - server
    return wall / n * 1e6, cpu / n * 1e6, server / n * 1e6


def _calls(store: Store, key: str) -> dict[str, tuple[Call, int, int]]:
    """Each measured call: (the call, how many calls one counts as, tasks at once)."""
    now = time.time()

    async def check_api_key(i: int) -> object:
        return await store.check_api_key(key)

    async def save_session(i: int) -> None:
        await store.save_session(StoredSession("alice", f"s{i % 8}", "acme", "chat", f"j{i}"))

    async def add_usage(i: int) -> None:
        await store.add_usage(_record(i), now + i * 1e-3)

    async def batch(i: int) -> None:
        for n in range(BATCH):
            store.queue_usage(_record(n), now + i + n * 1e-3)
        await store.flush_usage()

    async def both(i: int) -> None:
        await (check_api_key if i % 2 else save_session)(i)

    return {
        "check_api_key": (check_api_key, 1, 1),
        "save_session": (save_session, 1, 1),
        "add_usage": (add_usage, 1, 1),
        f"usage batch ({BATCH} rows)": (batch, BATCH, 1),
        f"{TASKS} tasks, pool {POOL}": (both, 1, TASKS),
    }


async def _measure(rounds: int, calls: int, urls: dict[str, str]) -> None:
    stores = {
        way: PostgresStore(urls[way], pool_size=POOL, in_thread=way == WAYS[1]) for way in WAYS
    }
    keys = {}
    for way, store in stores.items():
        for k in range(KEYS):
            keys[way] = await store.create_api_key(f"{way[:5]}-k{k}", "acme/chat")
    backends = {way: _backends(urls[way]) for way in WAYS}
    results: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            for name, (call, weight, tasks) in _calls(stores[way], keys[way]).items():
                n = calls // weight
                if tasks > 1 and r == 0:  # the pool's other connections, opened before
                    await _per_call(call, POOL * 4, [], tasks)
                    backends[way] = _backends(urls[way])
                figures = await _per_call(call, n, backends[way], tasks)  # per batch: per call
                results.setdefault(name, {}).setdefault(way, []).append(figures)
    for store in stores.values():
        await store.close()

    local = all(backends.values())
    print(
        f"\nPostgreSQL: {rounds} alternating rounds of {calls} calls; median µs per call "
        "(wall / hub CPU" + (" / server CPU)" if local else ")")
    )
    print(f"{'call':<26}" + "".join(f"{way:>28}" for way in WAYS) + f"{'ratio (wall)':>14}")
    for name, by_way in results.items():
        cells = []
        for way in WAYS:
            figures = by_way[way]
            cells.append(tuple(statistics.median(f[i] for f in figures) for i in range(3)))
        shown = [f"{w:.0f} / {c:.0f}" + (f" / {s:.0f}" if local else "") for w, c, s in cells]
        ratio = cells[1][0] / cells[0][0]
        print(f"{name:<26}" + "".join(f"{text:>28}" for text in shown) + f"{ratio:>13.2f}x")
    print(
        f"(a usage batch's figures are per batch of {BATCH} rows; {TASKS} tasks at once: wall "
        "per call is the inverse of the throughput)"
    )


def run(rounds: int, calls: int, url: str | None) -> None:
    """Measure on ``url`` (an empty database), else on a throwaway server of this machine's
    PostgreSQL; say so and return when there is none."""
    server = None
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
        import pgserver

        path = pgserver.bin_dir()
        if path is None:
            print("\nPostgreSQL: not installed here (apt-get install postgresql); not measured")
            return
        server = pgserver.PgServer(path)
        server.start()
        urls = {way: server.database() for way in WAYS}
    else:
        urls = dict.fromkeys(WAYS, url)
    try:
        trio.run(_measure, rounds, calls, urls)
    finally:
        if server is not None:
            server.destroy()
