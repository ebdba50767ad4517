"""``python -m bench.resumemem``: what keeping a turn's frames costs in memory (issue 27 point 1's
bound, and the hub's kept chunks of point 2), measured as resident memory of real processes.

- **The runner holding dropped channels** (``--runner``): ``--sessions`` sessions (one Chat
  Channel each) stream long answers (``--chunk-size``-byte tokens, ``--interval`` apart) through
  one runner; once each client has read ``WARM`` content deltas the hub is stopped (SIGSTOP: every
  path to it goes silent, a redial gets no answer), so each channel is found dead by the pings
  and its turn goes on into the resume buffer, until ``resume_buffer`` of it is kept and the turn
  is cancelled. The runner's RSS is sampled every 50 ms for ``--hold`` s; the figures are its
  peak over its RSS while streaming (``added``) and over its RSS idle (``over_idle``), for each
  ``--resume-buffer`` value given (0: no resume, the turns cancelled at the drop). What the
  buffers may hold: sessions × resume_buffer × 9/8 (an eighth more of frames let go).
- **The hub keeping streamed turns' chunks** (``--hub``): the same turns through this checkout's
  hub and ``--base-tree``'s (one that kept nothing), its RSS peak while they stream over its RSS
  before them. The bound: ``max_body`` (16 MiB) per streamed turn in flight.

Prints the figures and writes JSON (``--out``, default ``bench/results-resumemem.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import trio

from bench.common import machine, rss_bytes
from bench.faultclient import turn
from bench.faultrig import Rig, RunnerProc

WARM = 20  # content deltas each client reads before the measurement
MIB = 1 << 20


async def _peak(pid: int, seconds: float) -> int:
    peak = 0
    with trio.move_on_after(seconds):
        while True:
            peak = max(peak, rss_bytes(pid))
            await trio.sleep(0.05)
    return peak


async def _streams(
    rig: Rig, args: argparse.Namespace, tag: str, nursery: trio.Nursery
) -> trio.Event:
    """``--sessions`` long turns started in ``nursery``; the event is set once each has read
    ``WARM`` content deltas."""
    warm = trio.Event()
    count = [0]
    sim = {"chunks": args.chunks, "interval": args.interval, "chunk_size": args.chunk_size}

    def on_delta(n: int) -> None:
        if n == WARM:
            count[0] += 1
            if count[0] == args.sessions:
                warm.set()

    extra = {"sim": sim}
    for i in range(args.sessions):
        nursery.start_soon(
            partial(turn, rig.hub_port, rig.key, "chat", f"{tag}-{i}", "hi", 120, on_delta, extra)
        )
    return warm


async def runner_case(args: argparse.Namespace, buffer: int, tmp: Path) -> dict[str, Any]:
    async with trio.open_nursery() as nursery:
        rig = Rig(
            tmp,
            nursery,
            tree=None,
            chunks=8,
            interval=0.0,
            ping=args.ping,
            runner_extra=("--resume-buffer", str(buffer), "--max-sessions", str(args.sessions + 8)),
        )
        try:
            sim = await rig.start_sim()
            await rig.start_hub()
            runner: RunnerProc = await rig.start_runner([sim], metrics=True)
            pid = runner.child.pid
            idle = rss_bytes(pid)
            async with trio.open_nursery() as clients:
                warm = await _streams(rig, args, f"buf{buffer}", clients)
                with trio.fail_after(60):
                    await warm.wait()
                streaming = await _peak(pid, 0.5)
                assert rig.hub is not None
                os.kill(rig.hub.pid, signal.SIGSTOP)
                try:
                    dropped = await _peak(pid, args.hold)
                    metrics = await rig.runner_metrics(runner)
                finally:
                    os.kill(rig.hub.pid, signal.SIGCONT)
                clients.cancel_scope.cancel()
            cancelled = next(
                (
                    float(line.split()[1])
                    for line in metrics.splitlines()
                    if line.startswith("alp_gateway_turns_total") and 'outcome="cancelled"' in line
                ),
                None,
            )
        finally:
            await rig.stop()
            nursery.cancel_scope.cancel()
    return {
        "resume_buffer": buffer,
        "rss_idle_mib": round(idle / MIB, 1),
        "rss_streaming_mib": round(streaming / MIB, 1),
        "rss_dropped_peak_mib": round(dropped / MIB, 1),
        "added_mib": round((dropped - streaming) / MIB, 1),
        "over_idle_mib": round((dropped - idle) / MIB, 1),
        "bound_mib": round(args.sessions * buffer * 9 / 8 / MIB, 1),
        "turns_cancelled": cancelled,
    }


async def hub_case(args: argparse.Namespace, tree: Path | None, tmp: Path) -> dict[str, Any]:
    async with trio.open_nursery() as nursery:
        rig = Rig(
            tmp,
            nursery,
            tree=tree,
            chunks=8,
            interval=0.0,
            ping=args.ping,
            runner_extra=("--max-sessions", str(args.sessions + 8)),
        )
        try:
            sim = await rig.start_sim()
            await rig.start_hub()
            await rig.start_runner([sim])
            assert rig.hub is not None
            pid = rig.hub.pid
            # one turn first, so that what the first turn allocates once is not counted
            await turn(rig.hub_port, rig.key, "chat", "warm", "hi", 60)
            before = await _peak(pid, 0.5)
            answer_mib = args.chunks * (args.chunk_size + 1) / MIB
            async with trio.open_nursery() as clients:
                await _streams(rig, args, "hub", clients)
                # the peak comes as the answers near their end: sampled over all of them
                during = await _peak(pid, args.chunks * args.interval + 5)
                clients.cancel_scope.cancel()
        finally:
            await rig.stop()
            nursery.cancel_scope.cancel()
    return {
        "tree": str(tree) if tree else "this checkout",
        "rss_before_mib": round(before / MIB, 1),
        "rss_peak_mib": round(during / MIB, 1),
        "added_mib": round((during - before) / MIB, 1),
        "answers_mib": round(args.sessions * answer_mib, 1),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            k: getattr(args, k)
            for k in ("sessions", "chunks", "chunk_size", "interval", "ping", "hold")
        },
        "runner": [],
        "hub": [],
    }
    tmp = Path(tempfile.mkdtemp(prefix="alp-resumemem-"))
    try:
        if args.runner:
            for buffer in args.resume_buffer:
                found = await runner_case(args, buffer, tmp / f"runner-{buffer}")
                print(f"  runner, resume_buffer {buffer}: {found}", flush=True)
                out["runner"].append(found)
        if args.hub:
            trees: list[Path | None] = [None]
            if args.base_tree:
                trees.append(Path(args.base_tree))
            for tree in trees:
                found = await hub_case(args, tree, tmp / f"hub-{len(out['hub'])}")
                print(f"  hub: {found}", flush=True)
                out["hub"].append(found)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.resumemem", description=__doc__)
    parser.add_argument("--sessions", type=int, default=16, help="sessions streaming (16)")
    parser.add_argument("--chunks", type=int, default=3000, help="tokens an answer (3000)")
    parser.add_argument("--chunk-size", type=int, default=1000, help="bytes a token (1000)")
    parser.add_argument("--interval", type=float, default=0.002, help="s between tokens (0.002)")
    parser.add_argument("--ping", type=float, default=0.5, help="hub's and runner's ping (0.5)")
    parser.add_argument("--hold", type=float, default=5.0, help="s the hub is stopped (5)")
    parser.add_argument(
        "--resume-buffer",
        default="0,1048576",
        help="runner resume_buffer values to try, comma-separated (0,1048576)",
    )
    parser.add_argument("--no-runner", dest="runner", action="store_false")
    parser.add_argument("--no-hub", dest="hub", action="store_false")
    parser.add_argument("--base-tree", help="a checkout whose hub to measure beside this one's")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results-resumemem.json"), help="JSON output"
    )
    args = parser.parse_args(argv)
    args.resume_buffer = [int(x) for x in args.resume_buffer.split(",") if x]
    results = trio.run(main_async, args)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
