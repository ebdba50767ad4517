"""Where the runner's time goes: ``python -m bench.profile [--scenario lockstep] [--seconds 8]``.

Sets up the bench (simulator, hub, runner, lean sink), attaches ``py-spy record`` to one process
(``--proc``: the runner by default, or the hub with ``--path e2e``) and keeps one scenario running
on one path while it samples. Writes the collapsed stacks and a
summary (self and inclusive time per function) to ``bench/profiles/``; needs ``py-spy``
(``pip install -e '.[bench]'``) and the right to ptrace (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import trio

from bench.run import PATHS, Bench, Scenario, parse_args, scenarios

OUT = Path(__file__).parent / "profiles"
_LINE = re.compile(r"^(.*) (\d+)$")
_FRAME = re.compile(r"^(.*?) \((.*?)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    func, path = m.groups()
    path = re.sub(r"^.*/site-packages/", "", path)
    path = re.sub(r"^.*/(gateway|bench)/", r"\1/", path)
    return f"{func} ({path})"


def summarise(collapsed: Path, top: int = 35) -> str:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        stack, count = m.group(1).split(";"), int(m.group(2))
        names = [_name(f) for f in stack if f]
        if not names:
            continue
        total += count
        own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    lines = [f"{total} samples", "", "self time (leaf frame):"]
    lines += [f"  {c / total:6.1%}  {n}" for n, c in own.most_common(top)]
    lines += ["", "inclusive time (on the stack):"]
    lines += [f"  {c / total:6.1%}  {n}" for n, c in inclusive.most_common(top)]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    extra = ["--base-tree", args.base_tree] if args.base_tree else []
    extra += ["--tokens", str(args.tokens)] if args.tokens else []
    bench_args = parse_args(["--quick", "--no-scale", "--paths", args.path, *extra])
    bench_args.whatif_pool = args.whatif_pool
    bench = Bench(bench_args)
    sc = (
        Scenario("ttft", 1, 1, 1)
        if args.scenario == "ttft"
        else scenarios(bench_args)[args.scenario]
    )
    n, sessions, chunks, interval = sc.streams, sc.sessions, sc.chunks, sc.interval
    OUT.mkdir(exist_ok=True)
    raw = OUT / f"{args.path}-{args.proc}-{args.scenario}{args.suffix}.collapsed"
    try:
        async with trio.open_nursery() as nursery:
            await bench.setup(nursery)
            with trio.fail_after(90):
                await bench.litellm_ready.wait()
            path = bench.paths[args.path]
            target = {
                "runner": bench.runner,
                "hub": bench.hub,
                "sim": bench.sim,
                **{proc: child for proc, (child, _) in path.procs.items()},
            }[args.proc]
            await bench.sim.rpc(
                "opts", opts={"chunks": chunks, "interval": interval, "pace": sc.pace}
            )
            spy = await trio.lowlevel.open_process(
                [
                    args.py_spy,
                    "record",
                    "--pid",
                    str(target.pid),
                    "--duration",
                    str(args.seconds),
                    "--rate",
                    str(args.rate),
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            turns = 0
            while spy.returncode is None:
                with trio.move_on_after(0.05):
                    await spy.wait()
                out = await path.run(n, sessions, interval > 0, f"p{turns}", sc.stagger)
                turns += n
                if out.errors:
                    raise RuntimeError(out.errors[0])
            await spy.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for c in reversed(bench.children):
                await c.stop()
    text = (
        f"{args.proc} process, path {args.path}, scenario {args.scenario}: {turns} streams of "
        f"{chunks} chunks\n\n" + summarise(raw)
    )
    (OUT / f"{args.path}-{args.proc}-{args.scenario}{args.suffix}.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument(
        "--scenario",
        choices=["single", "c64", "c64s8", "spread", "lockstep", "ttft"],
        default="lockstep",
    )
    parser.add_argument("--path", choices=[p for p in PATHS if p != "direct"], default="runner")
    parser.add_argument(
        "--proc",
        choices=["runner", "hub", "floor", "peer", "litellm", "sim"],
        default="runner",
        help="the process to sample (the path's relay: runner, floor, peer, litellm)",
    )
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument(
        "--whatif-pool", action="store_true", help="the runner with bench/whatif_pool.py"
    )
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument(
        "--tokens", type=int, default=None, help="lockstep: tokens per stream (quick's 50)"
    )
    parser.add_argument(
        "--base-tree", default="", help="the checkout of the path e2e-base (python -m bench)"
    )
    parser.add_argument("--suffix", default="", help="appended to the output names (before/after)")
    parser.add_argument(
        "--py-spy",
        default=shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy",
    )
    trio.run(main, parser.parse_args())
