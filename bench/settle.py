"""What a team's turn pays for its usage row written before its last byte (issue 36 point 2).

A replica of a team settles each turn as it ends (``ReplicaLimits.settle``: the turn released and
its row and hourly totals written, one statement) and only then writes the answer's last bytes:
the client's end of the turn waits for that one round trip to PostgreSQL. Before, the release
and the row were written behind the turn (batched), so nothing waited. Measured here: that
statement's wall time from trio through the store's pool (the added latency of a turn's end),
next to the admission the turn already paid (``alp_admit_recorded``, which now also keeps the
turn's record) and to the batched release (what it replaces), on a throwaway PostgreSQL
(``tests/support/pgserver.py``) on this machine.

    python -m bench.settle                  # 5 rounds of 500 turns
    python -m bench.settle --rounds 3 --turns 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import msgspec
import trio

from gateway.hub.replicas.store.base import Release
from gateway.hub.store import KeyLimits, UsageRecord, open_store

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import pgserver  # noqa: E402  (the tests' throwaway PostgreSQL)

NO_LIMITS = (None, None, None, None)


async def _round(url: str, turns: int, tag: str) -> dict[str, list[float]]:
    store = open_store(url)
    team = store.team("bench")
    await store.create_api_key(f"k{tag}", "acme/chat", KeyLimits())
    times: dict[str, list[float]] = {"admit": [], "settle": [], "release (batched)": []}
    try:
        for n in range(turns):
            turn = f"{tag}-{n}"
            cut = UsageRecord("kid", f"k{tag}", f"s{n % 8}", "chat", "m", True, "cut")
            ok = UsageRecord(
                "kid", f"k{tag}", f"s{n % 8}", "chat", "m", True, "ok", "r", "j", 12, 34
            )
            t0 = time.perf_counter()
            await team.admit(
                turn,
                "kid",
                f"k{tag}",
                cut.session,
                0,
                NO_LIMITS,
                0,
                5.0,
                msgspec.json.encode(cut).decode(),
            )
            t1 = time.perf_counter()
            release = Release(turn, "kid", f"k{tag}", cut.session, 46)
            if n % 2:
                await team.settle(release, ok, time.time())
                times["settle"].append(time.perf_counter() - t1)
            else:
                await team.release([release])
                store.queue_usage(ok, time.time())
                times["release (batched)"].append(time.perf_counter() - t1)
            times["admit"].append(t1 - t0)
        await store.flush_usage()
    finally:
        await store.close()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=500)
    args = parser.parse_args(argv)
    server = pgserver.start_or_skip()
    try:
        url = server.database()
        medians: dict[str, list[float]] = {}
        p99: dict[str, list[float]] = {}
        for r in range(args.rounds):
            found = trio.run(_round, url, args.turns, str(r))
            for name, values in found.items():
                values.sort()
                medians.setdefault(name, []).append(statistics.median(values))
                p99.setdefault(name, []).append(values[int(len(values) * 0.99) - 1])
        print(
            f"{args.rounds} rounds of {args.turns} turns, PostgreSQL on loopback (ms, median of rounds)"
        )
        for name in medians:
            print(
                f"  {name:<20} median {statistics.median(medians[name]) * 1e3:6.3f}"
                f"  p99 {statistics.median(p99[name]) * 1e3:6.3f}"
            )
    finally:
        server.destroy()


if __name__ == "__main__":
    main()
