"""Measure start-up time, process start → first poll at the hub, for the frozen binary and from source.

    python packaging/startup_time.py [--binary dist/alp-gateway] [--runs 10]

Starts a hub and the backend simulator in this process, then launches `alp-gateway run` (the
binary, then `python -m gateway run`) again and again against them, timestamping the launch and the
first `POST …/runners/jobs` the hub receives. One unmeasured warm-up run per command registers the
runner and warms the page cache, so the figures are for a restart with a saved registration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from gateway.hub import App, Hub, serve_hub
from gateway.sim import serve_sim

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "bench/startup"


class PollClock:
    """Wraps the hub's handler (``App``) to note when the next poll request arrives."""

    def __init__(self, hub: Hub) -> None:
        self.app = App(hub)
        self.arrived = trio.Event()
        self.at = 0.0

    async def http(self, req: Any) -> None:
        if req.scope["path"].endswith("/runners/jobs") and not self.arrived.is_set():
            self.at = time.perf_counter()
            self.arrived.set()
        await self.app.http(req)

    async def websocket(self, req: Any) -> None:
        await self.app.websocket(req)


async def one_run(command: list[str], env: dict[str, str], clock: PollClock) -> float:
    clock.arrived = trio.Event()
    started = time.perf_counter()
    proc = await trio.lowlevel.open_process(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(60):
            await clock.arrived.wait()
        return clock.at - started
    finally:
        proc.terminate()
        with trio.move_on_after(20):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {}
    async with trio.open_nursery() as nursery:
        sim = await nursery.start(serve_sim)
        hub = Hub(None)
        clock = PollClock(hub)
        hub_url: str = await nursery.start(partial(serve_hub, hub, app=clock))
        for label, prefix in args.commands.items():
            with tempfile.TemporaryDirectory(prefix="alp-startup-") as state:
                env = {
                    k: v
                    for k, v in os.environ.items()
                    if not k.startswith(("AGENTICS_", "CHAT_LLM_", "ALP_"))
                }
                env.update(
                    AGENTICS_SERVER=hub_url,
                    AGENTICS_USER_TOKEN=hub.admin_token,
                    CHAT_LLM_BACKEND_URL=sim.url,
                    CHAT_LLM_MODEL="sim-model",
                    ALP_GATEWAY_STATE_DIR=state,
                    ALP_PROJECT=PROJECT,
                    ALP_GATEWAY_LOG_LEVEL="WARNING",
                )
                command = [*prefix, "run"]
                await one_run(command, env, clock)  # warm-up: registers, fills the page cache
                results[label] = [await one_run(command, env, clock) for _ in range(args.runs)]
        nursery.cancel_scope.cancel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", type=Path, default=ROOT / "dist" / "alp-gateway")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    args.commands = {"binary": [str(args.binary)], "source": [sys.executable, "-m", "gateway"]}
    if not args.binary.is_file():
        print(f"no binary at {args.binary}: measuring from source only", file=sys.stderr)
        del args.commands["binary"]
    results = trio.run(measure, args)
    print(
        f"start-up, process start → first poll at the hub ({args.runs} runs each, after a warm-up):"
    )
    for label, times in results.items():
        ms = sorted(t * 1000 for t in times)
        print(
            f"  {label:<7} median {statistics.median(ms):6.0f} ms   min {ms[0]:6.0f} ms   max {ms[-1]:6.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
