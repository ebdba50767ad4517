"""The hub store's per-turn calls, µs each: SQLite's statements run on the trio thread (the hub's
way) against the same store run in a worker thread (``trio.to_thread.run_sync``), and the
write-behind batch of usage rows (what a turn pays now, what a batch costs, the crash window);
then PostgreSQL's, driven from trio through libpq's non-blocking calls (the hub's way) against
libpq's blocking calls in a worker thread (``bench/store_postgres.py``).

    python -m bench.store_calls                   # 5 alternating rounds of 2000 calls each
    python -m bench.store_calls --rounds 9 --calls 5000 --kills 10
    python -m bench.store_calls --postgres postgresql://USER:PASSWORD@HOST/DB   # a server of yours
    python -m bench.store_calls --no-sqlite       # PostgreSQL's only

Each round measures every call both ways, one after the other (the order alternates between
rounds); the medians of the rounds are printed, with wall and CPU time per call (CPU: the whole
process, both threads). The database is a real file in a temporary directory (WAL,
synchronous=NORMAL, as the hub's). Nothing goes over the network.

The crash window is measured too: a child process runs the store's writer and ends a turn every
millisecond (its row stamped with the wall clock); it is SIGKILLed at a random moment, and the
turns it lost are those that ended after the newest row in the database."""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import trio

from gateway.hub.store import BATCH_INTERVAL, BATCH_ROWS, Store, StoredSession, UsageRecord
from gateway.hub.store.sqlite import SqliteStore

KEYS = 10  # active API keys in the store (check_api_key compares against each)


def _record(n: int) -> UsageRecord:
    return UsageRecord(
        "id-alice", "alice", f"s{n % 8}", "chat", "m", True, "ok", "r-1", "j-1", 12, 34, 0.1, 1.0
    )


async def _per_call(call: Callable[[int], Awaitable[object]], n: int) -> tuple[float, float]:
    """µs of wall and of process CPU per call, over ``n`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        await call(i)
    return (
        (time.perf_counter() - wall) / n * 1e6,
        (time.process_time() - cpu) / n * 1e6,
    )


async def _calls(store: Store, key: str) -> dict[str, Callable[[int], Awaitable[object]]]:
    now = time.time()

    async def add_usage(i: int) -> None:
        await store.add_usage(_record(i), now + i * 1e-3)  # one row, written now

    async def check_api_key(i: int) -> object:
        return await store.check_api_key(key)

    async def save_session(i: int) -> None:
        await store.save_session(StoredSession("alice", f"s{i % 8}", "acme", "chat", f"j{i}"))

    return {
        "add_usage": add_usage,
        "check_api_key": check_api_key,
        "save_session": save_session,
    }


async def main(rounds: int, calls: int) -> None:
    results: dict[str, dict[str, list[tuple[float, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        stores: dict[str, Store] = {
            "trio thread": SqliteStore(pathlib.Path(tmp) / "direct"),
            "worker thread": SqliteStore(pathlib.Path(tmp) / "thread", in_thread=True),
        }
        keys = {}
        for way, store in stores.items():
            for k in range(KEYS):
                key = await store.create_api_key(f"k{k}", "acme/chat")
            keys[way] = key
        ways = list(stores)
        for r in range(rounds):
            for way in ways if r % 2 == 0 else ways[::-1]:
                for name, call in (await _calls(stores[way], keys[way])).items():
                    results.setdefault(name, {}).setdefault(way, []).append(
                        await _per_call(call, calls)
                    )

        # the write-behind batch: what the turn pays, and a batch's write per row
        store = stores["trio thread"]
        now = time.time()
        queue_costs: list[float] = []
        batch_costs: dict[int, list[float]] = {}
        for _ in range(rounds):
            t = time.perf_counter()
            for i in range(calls):
                store.queue_usage(_record(i), now + i * 1e-3)
            queue_costs.append((time.perf_counter() - t) / calls * 1e6)
            await store.flush_usage()
            for size in (1, 32, BATCH_ROWS):
                for i in range(size):
                    store.queue_usage(_record(i), now + i * 1e-3)
                t = time.perf_counter()
                await store.flush_usage()
                batch_costs.setdefault(size, []).append((time.perf_counter() - t) * 1e6)
        for opened in stores.values():
            await opened.close()

    print(f"{rounds} alternating rounds of {calls} calls; median µs per call (wall / CPU)")
    print(f"{'call':<16}{'trio thread':>22}{'worker thread':>22}{'ratio (wall)':>14}")
    for name, by_way in results.items():
        cells = []
        for way in ways:
            wall = statistics.median(w for w, _ in by_way[way])
            cpu = statistics.median(c for _, c in by_way[way])
            cells.append((wall, cpu))
        ratio = cells[1][0] / cells[0][0]
        print(
            f"{name:<16}"
            + "".join(f"{f'{w:.1f} / {c:.1f}':>22}" for w, c in cells)
            + f"{ratio:>13.1f}x"
        )
    print(f"queue_usage (the turn's path now): {statistics.median(queue_costs):.2f} µs per turn")
    for size, costs in batch_costs.items():
        median = statistics.median(costs)
        print(f"a batch of {size:>3} rows written: {median:.0f} µs ({median / size:.1f} µs a row)")
    worst = statistics.median(batch_costs[BATCH_ROWS]) / 1e6
    print(
        f"crash window: a row is written at most {BATCH_INTERVAL:g} s after its turn ended "
        f"(or at once when {BATCH_ROWS} wait) plus its batch's write (here at most "
        f"{worst * 1e3:.1f} ms): at most {BATCH_INTERVAL + worst:.3f} s of ended turns lost"
    )


async def _child(place: pathlib.Path) -> None:
    """Turns ending every millisecond, written by the store's writer, until killed."""
    store = SqliteStore(place)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        print("ready", flush=True)
        n = 0
        while True:
            store.queue_usage(_record(n), time.time())
            n += 1
            await trio.sleep(0.001)


async def _newest(place: pathlib.Path) -> tuple[float, int]:
    """The time of the newest usage row in the store at ``place``, and how many rows it holds."""
    store = SqliteStore(place)
    rows = await store.usage_rows()
    await store.close()
    return max(r["at"] for r in rows), len(rows)


def crash_windows(kills: int) -> None:
    """SIGKILL the child ``kills`` times; print the span of ended turns each kill lost."""
    lost: list[float] = []
    counts: list[int] = []
    for _ in range(kills):
        with tempfile.TemporaryDirectory(prefix="store-crash-") as tmp:
            place = pathlib.Path(tmp)
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.store_calls", "--child", str(place)],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.getcwd()},
            )
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            time.sleep(random.uniform(0.5, 1.0))
            child.send_signal(signal.SIGKILL)
            killed_at = time.time()
            child.wait()

            last, count = trio.run(_newest, place)
            lost.append(killed_at - last)
            counts.append(count)
    print(
        f"{kills} SIGKILLs of a writer ending a turn every ms: ended turns lost over the last "
        f"{statistics.median(lost) * 1e3:.0f} ms (median), {max(lost) * 1e3:.0f} ms (worst); "
        f"{min(counts)}-{max(counts)} rows kept each time"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument(
        "--postgres",
        metavar="URL",
        help="an empty database to measure PostgreSQL on (default: a throwaway server, as the "
        "tests start, when PostgreSQL is installed)",
    )
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL's figures only")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite's figures only")
    parser.add_argument("--child", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        trio.run(_child, args.child)
    else:
        if not args.no_sqlite:
            trio.run(main, args.rounds, args.calls)
            crash_windows(args.kills)
        if not args.no_postgres:
            from bench import store_postgres

            store_postgres.run(args.rounds, args.calls, args.postgres)
