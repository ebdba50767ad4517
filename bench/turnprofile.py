"""Where one short turn's CPU goes in the hub and in the runner: ``python -m bench.turnprofile``.

Sets up the bench's ``e2e`` path (simulator, hub, runner; or ``e2e-base`` with ``--base-tree``),
keeps a steady open-loop load of short turns (``bench/reqload.py``: 20-token answers from 64
clients over 8 sessions, ``--rate`` turns/s, well under what the path sustains, so nothing
queues) and samples the hub and the runner with ``py-spy record`` at once for ``--seconds``.
Each process's CPU per turn over the same window comes from its /proc counters; each sample is
put in the part of the turn its deepest frame of ours (or of h11, httptools) belongs to, trio's
scheduler when there is none (``HUB_PARTS``, ``RUNNER_PARTS``), and a part's µs per turn is its share of the
process's samples times the process's CPU per turn (kernel time included: a send is counted in
the part that sent). py-spy leaves out the samples where a thread waits (epoll), so the shares
are of the time on CPU. Writes ``bench/profiles/turn-<proc>-<kind><suffix>.txt`` (the parts,
then self and inclusive time per function) and the collapsed stacks next to it (gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from bench import hubproc, reqload
from bench.profile import _name
from bench.run import Bench, parse_args

OUT = Path(__file__).parent / "profiles"
_LINE = re.compile(r"^(.*) (\d+)$")

HTTP_PARSE = "HTTP: request head and body (h11, or httptools)"
# (part, module path prefix, function names or None for any): the deepest frame of a sample that
# matches a rule names its part; the order of the rules only breaks ties within one frame
HUB_PARTS: list[tuple[str, str, tuple[str, ...] | None]] = [
    (HTTP_PARSE, "h11/", None),
    (HTTP_PARSE, "httptools/", None),
    (HTTP_PARSE, "gateway/wire/httpparse.py", None),  # httptools' callbacks (llhttp is C)
    (HTTP_PARSE, "gateway/wire/httpconn.py", ("next_event", "_fill", "read_body")),
    (
        "HTTP connection loop and request object",
        "gateway/wire/httpconn.py",
        ("serve", "_next_head", "_request", "_scope", "_declared_length", "_head_begun"),
    ),
    (
        "HTTP connection loop and request object",
        "gateway/wire/http.py",
        ("body", "receive", "__init__"),
    ),
    (
        "request JSON (parse, usage option)",
        "gateway/hub/frontdoor/shapes.py",
        ("parse_chat_request",),
    ),
    (
        "request JSON (parse, usage option)",
        "gateway/hub/frontdoor/dialects.py",
        ("chat_turn", "with_model"),
    ),
    ("key lookup", "gateway/hub/frontdoor/door.py", ("_key", "check_key")),
    ("key lookup", "gateway/hub/http.py", ("bearer", "header")),
    ("key lookup", "gateway/hub/store.py", ("check_api_key",)),
    ("model check", "gateway/hub/frontdoor/door.py", ("_model_for",)),
    ("model check", "gateway/hub/frontdoor/models.py", None),
    ("limits (admit)", "gateway/hub/usage.py", ("admit", "limits", "_state", "expire", "started")),
    ("session lookup and lock", "gateway/hub/frontdoor/sessions.py", None),
    ("queue", "gateway/hub/frontdoor/queue.py", None),
    ("job board", "gateway/hub/board.py", None),
    ("request frame (encode)", "gateway/hub/frontdoor/relay.py", ("request_frame",)),
    ("request frame (encode)", "gateway/wire/protocol.py", None),
    ("request frame write (channel send)", "gateway/hub/channel.py", ("send",)),
    (
        "request frame write (channel send)",
        "gateway/wire/wsserver.py",
        ("send_text", "send_message", "_write", "flush"),
    ),
    ("channel reader: the runner's frames", "gateway/hub/channel.py", None),
    ("channel reader: the runner's frames", "gateway/wire/wsframes.py", None),
    ("channel reader: the runner's frames", "gateway/wire/wsconn.py", None),
    ("channel reader: the runner's frames", "gateway/wire/wsserver.py", ("run", "_read", "_hand")),
    (
        "the answer: fold and wait (non-streamed)",
        "gateway/hub/frontdoor/relay.py",
        ("relay_whole", "next_reply"),
    ),
    (
        "the answer: fold and wait (non-streamed)",
        "gateway/hub/frontdoor/shapes.py",
        ("whole_completion",),
    ),
    ("the answer: stream sink and flush (streamed)", "gateway/hub/frontdoor/relay.py", None),
    ("the answer: stream sink and flush (streamed)", "gateway/hub/frontdoor/chunks.py", None),
    ("the answer's write (head, body, socket)", "gateway/wire/http.py", None),
    ("usage record and its SQLite write", "gateway/hub/usage.py", None),
    ("usage record and its SQLite write", "gateway/hub/store.py", ("add_usage", "prune_usage")),
    ("usage record and its SQLite write", "gateway/hub/turns.py", None),
    ("metrics", "gateway/hub/hubmetrics.py", None),
    ("metrics", "gateway/hub/counters.py", None),
    (
        "turn scaffolding (_serve, _turn, _attempt: nursery, scopes)",
        "gateway/hub/frontdoor/door.py",
        None,
    ),
    ("hub app routing", "gateway/hub/app.py", None),
    # the hub laid out by role (issue 26): the same parts in today's modules
    ("key lookup", "gateway/hub/keys.py", None),
    ("model check", "gateway/hub/models.py", None),
    (
        "limits (admit)",
        "gateway/hub/accounting.py",
        ("admit", "limits", "_state", "expire", "reservation", "_read_day"),
    ),
    ("session lookup and lock", "gateway/hub/sessions.py", None),
    ("usage record and its SQLite write", "gateway/hub/accounting.py", None),
    ("usage record and its SQLite write", "gateway/hub/store/", None),
    ("metrics", "gateway/hub/metrics.py", None),
    ("metrics", "gateway/observe.py", None),
    (
        "the answer: fold and wait (non-streamed)",
        "gateway/hub/turn.py",
        ("_answer_whole", "_whole"),
    ),
    ("the answer: fold and wait (non-streamed)", "gateway/hub/frontdoor/dialects.py", ("fold",)),
    (
        "the answer: stream sink and flush (streamed)",
        "gateway/hub/turn.py",
        ("chunk", "flush", "reply", "_done", "_write", "_usage_only"),
    ),
    ("turn scaffolding (_serve, _turn, _attempt: nursery, scopes)", "gateway/hub/serving.py", None),
    ("turn scaffolding (_serve, _turn, _attempt: nursery, scopes)", "gateway/hub/turn.py", None),
    (
        "turn scaffolding (_serve, _turn, _attempt: nursery, scopes)",
        "gateway/hub/dispatcher.py",
        None,
    ),
    # the front door by layer (issue 38): the translations in gateway/apis/, the routes beside
    # the runner API (the rules above still read a tree from before the move)
    ("request JSON (parse, usage option)", "gateway/apis/shapes.py", ("parse_chat_request",)),
    ("request JSON (parse, usage option)", "gateway/apis/dialects.py", ("chat_turn", "with_model")),
    ("key lookup", "gateway/hub/frontdoor.py", ("_key", "check_key")),
    ("model check", "gateway/hub/frontdoor.py", ("_model_for",)),
    ("the answer: fold and wait (non-streamed)", "gateway/apis/shapes.py", ("whole_completion",)),
    ("the answer: fold and wait (non-streamed)", "gateway/apis/dialects.py", ("fold",)),
    ("the answer: stream sink and flush (streamed)", "gateway/apis/chunks.py", None),
    (
        "turn scaffolding (_serve, _turn, _attempt: nursery, scopes)",
        "gateway/hub/frontdoor.py",
        None,
    ),
    # modules named for what they hold (issue 38): the catalog, the routes' kit
    ("key lookup", "gateway/hub/routekit.py", ("bearer", "header")),
    ("model check", "gateway/hub/catalog.py", None),
    # the turn's task parked while the runner answers (a wake: a reschedule, no cancel scope)
    ("turn scaffolding (_serve, _turn, _attempt: nursery, scopes)", "gateway/wire/park.py", None),
    ("trio: tasks, scopes, scheduling", "trio/", None),
    ("trio: tasks, scopes, scheduling", "outcome/", None),
]
RUNNER_PARTS: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("h11: the backend's answer", "h11/", None),
    (
        "channel: frames in (read, decode, dispatch)",
        "gateway/wire/wsclient.py",
        ("_read", "run", "reader", "receive", "frames"),
    ),
    (
        "channel: frames in (read, decode, dispatch)",
        "gateway/wire/wsframes.py",
        ("feed", "_parse", "unmask"),  # FrameReader's (ClientFramer.frames is frames out)
    ),
    ("channel: frames out (encode, mask, write)", "gateway/wire/wsclient.py", None),
    ("channel: frames out (encode, mask, write)", "gateway/wire/wsframes.py", None),
    ("channel: frames in (read, decode, dispatch)", "gateway/wire/wsconn.py", None),
    ("request frame decode and turn start", "gateway/runner/channel.py", None),
    ("request frame decode and turn start", "gateway/runner/session.py", None),
    ("request frame decode and turn start", "gateway/wire/protocol.py", None),
    ("request frame decode and turn start", "gateway/runner/turns.py", ("start", "__contains__")),
    ("turn (route, slot, request, end)", "gateway/runner/turns.py", None),
    ("turn (route, slot, request, end)", "gateway/runner/turn.py", None),
    ("turn (route, slot, request, end)", "gateway/runner/forward.py", None),
    ("turn (route, slot, request, end)", "gateway/runner/backends.py", None),
    ("turn (route, slot, request, end)", "gateway/runner/backend.py", None),
    ("turn (route, slot, request, end)", "gateway/observe.py", None),
    ("backend HTTP client (connection, head, send)", "gateway/wire/http1.py", None),
    ("backend HTTP client (connection, head, send)", "gateway/wire/proxy.py", None),
    ("relay: the answer into frames (SSE, poller, pump)", "gateway/runner/relay.py", None),
    ("relay: the answer into frames (SSE, poller, pump)", "gateway/runner/poller.py", None),
    ("relay: the answer into frames (SSE, poller, pump)", "gateway/wire/stream.py", None),
    ("relay: the answer into frames (SSE, poller, pump)", "gateway/wire/sse.py", None),
    ("metrics and state", "gateway/ops/", None),
    ("metrics and state", "gateway/state.py", None),
    ("trio: tasks, scopes, scheduling", "trio/", None),
    ("trio: tasks, scopes, scheduling", "outcome/", None),
]
OTHER = "other (interpreter, start-up code, unattributed)"
TRIO = "trio: tasks, scopes, scheduling"
IDLE = "waiting in epoll (not counted)"
# the epoll wait: py-spy counts some of it as on CPU here; left out of the shares
WAITING = ("EpollIOManager.get_events", "EpollIOManager._epoll_wait")
# a socket write or read is counted in the part that called it (the request frame, the answer)
TRANSPARENT = ("gateway/wire/netio.py",)


def _split(frame: str) -> tuple[str, str]:
    """``func (path)`` → (func, path)."""
    name = _name(frame)
    func, _, rest = name.partition(" (")
    return func, rest.rstrip(")")


def _part(stack: list[str], rules: list[tuple[str, str, tuple[str, ...] | None]]) -> str:
    """The part of the deepest frame of ours (or h11's) on the stack; trio's own only when the
    stack holds none (its scheduler between tasks): trio code run on behalf of ours (a nursery
    opened, a checkpoint) counts in the part that ran it."""
    frames = [_split(frame) for frame in reversed(stack)]
    if frames and frames[0][0] in WAITING:
        return IDLE
    frames = [(func, path) for func, path in frames if not path.startswith(TRANSPARENT)]
    for trio_pass in (False, True):
        for func, path in frames:
            method = func.rsplit(".", 1)[-1]  # py-spy names methods Class.method
            for part, prefix, funcs in rules:
                if (part == TRIO) != trio_pass:
                    continue
                if path.startswith(prefix) and (funcs is None or method in funcs):
                    return part
    return OTHER


def parts(collapsed: Path, rules: list[tuple[str, str, tuple[str, ...] | None]]) -> Counter[str]:
    """Samples per part of the turn."""
    out: Counter[str] = Counter()
    for line in collapsed.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            out[_part(m.group(1).split(";"), rules)] += int(m.group(2))
    return out


def again(suffix: str) -> None:
    """The summaries rebuilt from the stacks and figures a run left (after a change of rules)."""
    for figures_file in sorted(OUT.glob(f"turn-*{suffix}.json")):
        proc, kind, cpu_us, turns, rate, seconds = json.loads(figures_file.read_text())
        collapsed = figures_file.with_suffix(".collapsed")
        text = report(proc, kind, collapsed, cpu_us, turns, rate, seconds)
        figures_file.with_suffix(".txt").write_text(text + "\n")
        print(text.split("\n\n")[0] + "\n" + text.split("\n\n")[1] + "\n")


def report(
    proc: str, kind: str, collapsed: Path, cpu_us: float, turns: int, rate: float, seconds: float
) -> str:
    from bench.profile import summarise

    rules = HUB_PARTS if proc == "hub" else RUNNER_PARTS
    counts = parts(collapsed, rules)
    waiting = counts.pop(IDLE, 0)
    total = sum(counts.values()) or 1
    order = list(dict.fromkeys(p for p, _, _ in rules)) + [OTHER]
    lines = [
        f"{proc} process, {kind} short turns ({reqload.TOKENS}-token answers), "
        f"{reqload.CLIENTS} clients over {reqload.SESSIONS} sessions at {rate:g} turns/s for "
        f"{seconds:g} s: {turns} turns, {cpu_us:.1f} µs of {proc} CPU per turn "
        f"({total} samples on CPU, {waiting} more in the epoll wait left out); a write's "
        "part includes its send(), the kernel's loopback delivery",
        "",
        "part of the turn                                               µs/turn   share",
    ]
    for part in order:
        if counts.get(part):
            share = counts[part] / total
            lines.append(f"  {part:60} {share * cpu_us:7.1f}  {share:6.1%}")
    lines += ["", summarise(collapsed, 30)]
    return "\n".join(lines)


def cpu_line(
    args: argparse.Namespace,
    kind: str,
    done: int,
    procs: dict[str, Any],
    cpu0: dict[str, float],
    cpu1: dict[str, float],
) -> str:
    """``--cpu-only``'s one line: each process's CPU per turn over the window, hub/runner."""
    per = {p: (cpu1[p] - cpu0[p]) / max(done, 1) * 1e6 for p in procs}
    parts = [f"{p} {us:.1f} µs" for p, us in per.items()]
    if per.get("runner"):
        parts.append(f"hub/runner {per['hub'] / per['runner']:.3f}")
    without = f", the hub without its {args.hub_without}" if args.hub_without else ""
    return f"{kind}: {done} turns at {args.rate:g}/s{without}: " + ", ".join(parts)


async def main(args: argparse.Namespace) -> None:
    extra = ["--base-tree", args.base_tree] if args.base_tree else []
    bench_args = parse_args(["--quick", "--no-scale", "--paths", args.path, *extra])
    bench = Bench(bench_args)
    OUT.mkdir(exist_ok=True)
    try:
        async with trio.open_nursery() as nursery:
            await bench.setup(nursery)
            path = bench.paths[args.path]
            procs = {proc: child for proc, (child, _) in path.procs.items()}
            await bench.sim.rpc("opts", opts={"chunks": reqload.TOKENS, "interval": 0.0})
            turns = reqload.Turns(path)  # type: ignore[arg-type]
            await turns.check()
            for kind in args.kinds.split(","):
                await turns.warm(kind, reqload.CLIENTS)
                raws = {p: OUT / f"turn-{p}-{kind}{args.suffix}.collapsed" for p in procs}
                spies = []
                for proc, child in procs.items():
                    if args.cpu_only:
                        break
                    spies.append(
                        await trio.lowlevel.open_process(
                            [
                                args.py_spy,
                                "record",
                                "--pid",
                                str(child.pid),
                                "--duration",
                                str(args.seconds),
                                "--rate",
                                str(args.sample_rate),
                                "--format",
                                "raw",
                                "--output",
                                str(raws[proc]),
                                "--nonblocking",
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
                if spies:
                    await trio.sleep(1.0)  # py-spy attached
                cpu0 = {p: c.cpu() for p, c in procs.items()}

                async def run(j: int, due: float, kind: str = kind) -> reqload.Shot:
                    return await turns.run(kind, j, due)

                shots, _t0, _end = await reqload.open_loop(
                    run, args.rate, args.seconds - 2.0, reqload.CLIENTS
                )
                cpu1 = {p: c.cpu() for p, c in procs.items()}
                for spy in spies:
                    await spy.wait()
                done = [s for s in shots if s.error is None]
                if len(done) < len(shots):
                    bad = next(s for s in shots if s.error is not None)
                    print(f"  {len(shots) - len(done)} turns failed, e.g. {bad.error}")
                if args.cpu_only:
                    print(cpu_line(args, kind, len(done), procs, cpu0, cpu1))
                    continue
                for proc in procs:
                    cpu_us = (cpu1[proc] - cpu0[proc]) / max(len(done), 1) * 1e6
                    figures = [proc, kind, cpu_us, len(done), args.rate, args.seconds - 2.0]
                    raws[proc].with_suffix(".json").write_text(json.dumps(figures))
                    text = report(proc, kind, raws[proc], *figures[2:])
                    if args.base_tree:
                        text = f"(the hub and runner of {args.base_tree})\n" + text
                    if args.hub_without:
                        text = f"(the hub without its {args.hub_without})\n" + text
                    name = f"turn-{proc}-{kind}{args.suffix}.txt"
                    (OUT / name).write_text(text + "\n")
                    print(text.split("\n\n")[0] + "\n" + text.split("\n\n")[1] + "\n")
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            for c in reversed(bench.children):
                await c.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.turnprofile", description=__doc__)
    parser.add_argument("--path", choices=["e2e", "e2e-base"], default="e2e")
    parser.add_argument("--base-tree", default="", help="the checkout of the path e2e-base")
    parser.add_argument(
        "--kinds",
        default="whole,stream",
        help="whole, stream, or both as whole,stream (the default)",
    )
    parser.add_argument("--rate", type=float, default=500.0, help="turns/s (500)")
    parser.add_argument("--seconds", type=int, default=22, help="py-spy's window (22 s)")
    parser.add_argument("--sample-rate", type=int, default=500, help="py-spy samples/s (500)")
    parser.add_argument("--suffix", default="", help="appended to the output names (before/after)")
    parser.add_argument(
        "--py-spy",
        default=shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy",
    )
    parser.add_argument(
        "--again",
        action="store_true",
        help="no run: rebuild the summaries of --suffix from the stacks and figures kept",
    )
    parser.add_argument(
        "--cpu-only",
        action="store_true",
        help="no py-spy: each process's CPU per turn only, on one line per kind",
    )
    parser.add_argument(
        "--hub-without",
        default="",
        help="the hub serves without this per-turn bookkeeping (ledger, metrics or both, "
        "comma-separated: bench/hubproc.py), to measure what it costs",
    )
    cli = parser.parse_args()
    if cli.hub_without:
        unknown = set(cli.hub_without.split(",")) - set(hubproc.WITHOUT)
        if unknown:
            parser.error(
                f"--hub-without: {', '.join(sorted(unknown))} is none of "
                f"{', '.join(hubproc.WITHOUT)}"
            )
        os.environ["BENCH_HUB_WITHOUT"] = cli.hub_without
    if cli.again:
        again(cli.suffix)
    else:
        trio.run(main, cli)
