"""The priority bench (issue 35, point 3): an interactive key's queue wait while a background
key's 64 concurrent streams saturate every runner, against the same without the flood, and the
background key's throughput meanwhile (it must stay above zero: promotion, no starvation).

One process, on loopback: a hub (SQLite in memory), the simulator, and runners (the project's
own) whose capacity (``--capacity`` sessions each) the flood fills. Each turn is a session of
its own (a new session needs a runner's slot: that is what the queue orders); a session's job
ends ``--idle`` s after its turn, freeing the slot. The interactive key sends one turn at a time
(``--turns`` of them); its wait is the time to its answer's first chunk (the simulator answers
at once, so that is the hub's queue and dispatch). A third round floods with the classes off (both keys standard:
the plain fair queue), for comparison. Run::

    python -m bench.priority                     # 1 runner of 4 slots, 64 background streams
    python -m bench.priority --runners 2 --capacity 2 --turns 60
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.common import percentile
from gateway.config import Config
from gateway.hub import Hub, open_hub
from gateway.hub.money import KeyBudget
from gateway.runner.supervisor import Runner
from gateway.sim import open_sim

ADMIN = "alpa_bench_admin_credential"
BACKEND_KEY = "sk-bench-backend"
OWNER, PROJECT = "acme", "chat"
_ids = itertools.count()


def _runner_config(hub_url: str, sim_url: str, state: Path, n: int, capacity: int) -> Config:
    base = Config(
        server=hub_url,
        server_explicit=True,
        project=f"{OWNER}/{PROJECT}",
        state_dir=state / f"runner{n}",
        backend=(sim_url,),
        backend_key=BACKEND_KEY,
        model="sim-model",
        user_token=ADMIN,
        name=f"bench-runner-{n}",
        poll_interval=10.0,
    )
    return replace(base, max_sessions=capacity)


def _body(chunks: int, interval: float) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
        "sim": {"chunks": chunks, "interval": interval},
    }


async def _turn(http: httpx.AsyncClient, key: str, body: dict[str, Any]) -> tuple[int, float]:
    """One streamed turn in a session of its own: (status, seconds to its first chunk)."""
    headers = {"Authorization": f"Bearer {key}", "X-Chat-Session": f"s{next(_ids)}"}
    start = time.perf_counter()
    first = float("nan")
    async with http.stream("POST", "/v1/chat/completions", headers=headers, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and first != first:
                first = time.perf_counter() - start
    return r.status_code, first


async def _round(
    args: argparse.Namespace, url: str, keys: dict[str, str], flood: bool
) -> dict[str, Any]:
    """The interactive key's ``--turns`` one at a time, with the background flood or without."""
    waits: list[float] = []
    background = {"turns": 0, "errors": 0}
    limits = httpx.Limits(max_connections=args.background + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        async with trio.open_nursery() as nursery:
            if flood:

                async def stream_forever() -> None:
                    body = _body(args.chunks, args.interval)
                    while True:
                        status, _first = await _turn(http, keys["background"], body)
                        background["turns" if status == 200 else "errors"] += 1
                        if status != 200:  # counted by status; a pause, not a hot loop
                            name = f"status {status}"
                            background[name] = background.get(name, 0) + 1
                            await trio.sleep(0.05)

                for _ in range(args.background):
                    nursery.start_soon(stream_forever)
                await trio.sleep(args.warmup)  # every slot taken, the queue full of the flood
            started = time.perf_counter()
            counted = background["turns"]
            for _ in range(args.turns):
                status, first = await _turn(http, keys["interactive"], _body(4, 0.0))
                if status == 200:
                    waits.append(first)
                await trio.sleep(args.gap)
            elapsed = time.perf_counter() - started
            done = background["turns"] - counted
            nursery.cancel_scope.cancel()
    return {
        "flood": flood,
        "interactive_turns": len(waits),
        "wait_p50_ms": round((percentile(waits, 50) or 0) * 1000, 1),
        "wait_p99_ms": round((percentile(waits, 99) or 0) * 1000, 1),
        "background_turns_per_s": round(done / elapsed, 2) if flood else None,
        "background_errors": background["errors"] if flood else None,
        "background_statuses": {k: v for k, v in background.items() if k.startswith("status")},
    }


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    hub = Hub(
        admin_token=ADMIN,
        session_idle_timeout=args.idle,
        max_sessions_per_key=4 * args.background,
        queue_length=4 * args.background,
        queue_wait=600.0,
        priority_promote_after=args.promote_after,
    )
    results = []
    async with open_sim(require_key=BACKEND_KEY) as sim, open_hub(hub) as (_hub, url):
        keys = {}
        for name in ("interactive", "background"):
            keys[name] = await hub.keys.create(name, f"{OWNER}/{PROJECT}")
            await hub.keys.set_budget(name, KeyBudget(priority=name))
        with tempfile.TemporaryDirectory() as state:
            async with trio.open_nursery() as nursery:
                runners = [
                    Runner(_runner_config(url, sim.url, Path(state), n, args.capacity))
                    for n in range(args.runners)
                ]
                for runner in runners:
                    nursery.start_soon(runner.run)
                for runner in runners:
                    await runner.first_poll.wait()
                for flood, classes in ((False, True), (True, True), (True, False)):
                    for name in keys:  # classes off: both keys standard (the plain fair queue)
                        priority = name if classes else "standard"
                        await hub.keys.set_budget(name, KeyBudget(priority=priority))
                    results.append({**await _round(args, url, keys, flood), "classes": classes})
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                    await trio.sleep(2 * args.idle + 1)  # the flood's sessions end
                nursery.cancel_scope.cancel()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.priority", description=__doc__)
    parser.add_argument("--runners", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=4, help="sessions a runner serves")
    parser.add_argument("--background", type=int, default=64, help="the flood's streams")
    parser.add_argument("--chunks", type=int, default=50, help="tokens of a background turn")
    parser.add_argument("--interval", type=float, default=0.01, help="s between its tokens")
    parser.add_argument("--turns", type=int, default=40, help="the interactive key's turns")
    parser.add_argument("--gap", type=float, default=0.1, help="s between them")
    parser.add_argument("--idle", type=float, default=0.2, help="session_idle_timeout (s)")
    parser.add_argument("--warmup", type=float, default=3.0, help="s of flood before measuring")
    parser.add_argument("--promote-after", type=float, default=30.0)
    args = parser.parse_args(argv)
    results = trio.run(_main, args)
    quiet, flooded, plain = results
    print(
        f"interactive queue wait (time to first chunk), {args.runners} runner(s) x "
        f"{args.capacity} slots, {args.turns} turns:\n"
        f"  without the flood: p50 {quiet['wait_p50_ms']} ms, p99 {quiet['wait_p99_ms']} ms\n"
        f"  with {args.background} background streams: p50 {flooded['wait_p50_ms']} ms, "
        f"p99 {flooded['wait_p99_ms']} ms\n"
        f"  the same, classes off (both keys standard): p50 {plain['wait_p50_ms']} ms, "
        f"p99 {plain['wait_p99_ms']} ms\n"
        f"  background throughput meanwhile: {flooded['background_turns_per_s']} turns/s "
        f"({flooded['background_errors']} errors; {plain['background_turns_per_s']} with classes "
        "off)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
