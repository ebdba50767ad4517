"""Where a chunk's latency goes inside the runner: the runner with stamps, for the bench only.

Not part of the gateway: ``python -m bench --probe`` runs the runner as
``python -m bench.tailprobe run ...``, which patches it (never the code on main) to stamp, with
``time.perf_counter()`` (CLOCK_MONOTONIC, the clock the simulator's ``sent_at`` and the sink's
receive stamps use, so the three line up across processes):

- every chunk: the start of the ``pump`` that read it (≈ its backend read) and the moment its
  frame was offered to the channel (after the write), keyed by the bench's tag and the token;
- every poller pass: when it began, how long it took, how many turns it pumped;
- every garbage collection: its generation, when it began, how long it took, what it collected;
- every trio task step longer than ``LONG_STEP``: its task and how long it ran.

The stamps cost the runner CPU: its CPU and latency figures in a probed run are not the
runner's. ``SIGUSR1`` writes what was stamped since the last one to ``$BENCH_TAILPROBE`` (JSON)
and starts afresh; the bench sends it after each measurement and joins it with the simulator's
``sent_at`` and the sink's receive stamps (``bench.run.Bench._probe``).
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import sys
import time
from array import array
from collections import Counter
from typing import Any

import trio

from gateway.runner import channel as channel_mod
from gateway.runner import poller as poller_mod
from gateway.runner import relay as relay_mod
from gateway.wire import wsclient

LONG_STEP = 0.0005  # s: task steps at least this long are listed
_TOK = b'"content":"tok'
_TAG = re.compile(rb"bench-tag-([A-Za-z0-9_.-]+)")
clock = time.perf_counter


class Probe:
    def __init__(self) -> None:
        self.reset()
        self.tags: dict[str, str] = {}  # request id -> bench tag
        self.turns: list[str] = []  # the tags of the turns relayed; chunk_turn indexes it
        self.pump_at = 0.0  # when the pump in progress began
        self.pumps = 0  # in the pass in progress
        self._gc_at = 0.0
        self._gc_cpu = 0.0
        self.gc_heap: tuple[int, list[tuple[int, str]]] = (0, [])

    def reset(self) -> None:
        # arrays, not lists of tuples: a stamp allocates no object the collector tracks, so
        # the probe does not change how often it runs
        self.chunk_turn = array("l")
        self.chunk_tok = array("l")
        self.chunk_pump = array("d")  # when the pump that read it began
        self.chunk_offered = array("d")  # when its frame was offered (written)
        self.pass_at = array("d")
        self.pass_took = array("d")
        self.pass_pumps = array("l")
        self.pass_cpu = array("d")  # the pass's CPU time: less than its time when preempted
        self.counts = {"room": 0, "offers": 0, "behind_a_write": 0}
        # generation, began, seconds, collected, CPU seconds (less than seconds: it was preempted)
        self.gcs: list[tuple[int, float, float, int, float]] = []
        # BENCH_GC_WHAT: each full collection's time, CPU time, what it found, the heap before
        self.gc_found: list[
            tuple[float, float, list[tuple[str, int]], tuple[int, list[tuple[int, str]]]]
        ] = []
        self.steps: list[tuple[str, float, float]] = []  # task, began, seconds (long ones)
        self.step_total: dict[str, list[float]] = {}  # task name -> [steps, seconds]

    def dump(self, *_: Any) -> None:
        path = os.environ.get("BENCH_TAILPROBE")
        if not path:
            return
        data = {
            "chunks": [
                (self.turns[t], tok, pump, offered)
                for t, tok, pump, offered in zip(
                    self.chunk_turn,
                    self.chunk_tok,
                    self.chunk_pump,
                    self.chunk_offered,
                    strict=False,
                )
            ],
            "passes": list(
                zip(self.pass_at, self.pass_took, self.pass_pumps, self.pass_cpu, strict=False)
            ),
            "counts": self.counts,
            "gcs": self.gcs,
            "gc_found": self.gc_found,
            "steps": self.steps,
            "step_total": self.step_total,
            "gc_counts": gc.get_count(),
            "gc_threshold": gc.get_threshold(),
            "gc_stats": gc.get_stats(),
            "gc_frozen": gc.get_freeze_count(),
            "gc_tracked": len(gc.get_objects()),
        }
        if os.environ.get("BENCH_GC_WHAT"):  # what a full collection of this heap costs now
            at, cpu = clock(), time.thread_time()
            gc.collect()
            data["full_collect_ms"] = ((clock() - at) * 1e3, (time.thread_time() - cpu) * 1e3)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        self.reset()

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_at = clock()
            self._gc_cpu = time.thread_time()
            if info["generation"] == 2 and os.environ.get("BENCH_GC_WHAT"):
                gc.set_debug(gc.DEBUG_SAVEALL)  # what a full collection finds: kept, counted
                objs = gc.get_objects()
                big = sorted(
                    ((len(o), type(o).__qualname__) for o in objs if isinstance(o, list | dict)),
                    reverse=True,
                )[:5]
                self.gc_heap = (len(objs), big)
                del objs
                self._gc_at = clock()
                self._gc_cpu = time.thread_time()
        else:
            now = clock()
            cpu = time.thread_time() - self._gc_cpu
            took = now - self._gc_at
            if gc.get_debug() & gc.DEBUG_SAVEALL:
                gc.set_debug(0)
                kinds = Counter(type(o).__qualname__ for o in gc.garbage)
                self.gc_found.append((took, cpu, kinds.most_common(12), self.gc_heap))
                gc.garbage.clear()
            self.gcs.append((info["generation"], self._gc_at, took, info["collected"], cpu))


PROBE = Probe()


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self._at = clock()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._at = clock()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = clock() - self._at
        name = task.name.rsplit(".", 1)[-1]
        total = PROBE.step_total.setdefault(name, [0, 0.0])
        total[0] += 1
        total[1] += took
        if took >= LONG_STEP:
            PROBE.steps.append((name, self._at, took))


def _gc_setting() -> None:
    """``$BENCH_GC``, an experiment: ``off``, ``freeze`` (what is alive once the poller starts
    goes to the permanent generation) or ``t0=N`` (the first generation's threshold), joined by
    commas."""
    for part in filter(None, os.environ.get("BENCH_GC", "").split(",")):
        if part == "off":
            gc.disable()
        elif part.startswith("t0="):
            gc.set_threshold(int(part[3:]), *gc.get_threshold()[1:])
        elif part != "freeze":
            raise SystemExit(f"BENCH_GC: unknown setting {part!r}")


def apply() -> None:
    _gc_setting()
    freeze = "freeze" in os.environ.get("BENCH_GC", "").split(",")
    if not os.environ.get("BENCH_TAILPROBE"):  # a GC experiment alone: no stamps
        if freeze:
            run0 = poller_mod.Poller.run

            async def _frozen(self: Any) -> None:
                gc.collect()
                gc.freeze()
                await run0(self)

            poller_mod.Poller.run = _frozen  # type: ignore[method-assign]
        return
    gc.callbacks.append(PROBE.on_gc)
    signal.signal(signal.SIGUSR1, PROBE.dump)

    start_turn = channel_mod.Channel._start_turn

    def _start_turn(self: Any, frame: Any) -> None:
        found = _TAG.search(bytes(frame.body))
        if found:
            PROBE.tags[frame.requestId] = found.group(1).decode()
        start_turn(self, frame)

    channel_mod.Channel._start_turn = _start_turn  # type: ignore[method-assign]

    init = relay_mod.SSERelay.__init__

    def __init__(self: Any, response: Any, **kw: Any) -> None:
        offer, offer_batch = kw["offer"], kw["offer_batch"]
        probe = PROBE
        turns = probe.turns
        turn = len(turns)
        turns.append(probe.tags.get(kw["request_id"], kw["request_id"]))

        def stamped(frames: list[bytes], at: float) -> None:
            for frame in frames:
                i = frame.find(_TOK)
                if i < 0:
                    continue
                j = i + len(_TOK)
                probe.chunk_turn.append(turn)
                probe.chunk_tok.append(int(frame[j : frame.find(b'"', j)]))
                probe.chunk_pump.append(probe.pump_at)
                probe.chunk_offered.append(at)

        def offer_one(frame: bytes) -> bool:
            room = offer(frame)
            stamped([frame], clock())
            return bool(room)

        def offer_many(frames: list[bytes]) -> bool:
            room = offer_batch(frames)
            stamped(frames, clock())
            return bool(room)

        kw["offer"], kw["offer_batch"] = offer_one, offer_many
        init(self, response, **kw)

    relay_mod.SSERelay.__init__ = __init__  # type: ignore[method-assign]

    pump = relay_mod.SSERelay.pump

    def _pump(self: Any) -> int:
        PROBE.pump_at = clock()
        PROBE.pumps += 1
        state = int(pump(self))
        if state == poller_mod.ROOM:
            PROBE.counts["room"] += 1
        return state

    relay_mod.SSERelay.pump = _pump  # type: ignore[method-assign]

    pump_ready = poller_mod.Poller._pump_ready

    def _pump_ready(self: Any) -> None:
        PROBE.pumps = 0
        began = clock()
        cpu = time.thread_time()
        pump_ready(self)
        PROBE.pass_at.append(began)
        PROBE.pass_took.append(clock() - began)
        PROBE.pass_cpu.append(time.thread_time() - cpu)
        PROBE.pass_pumps.append(PROBE.pumps)

    poller_mod.Poller._pump_ready = _pump_ready  # type: ignore[method-assign]

    ws_offer = wsclient.WebSocket._offer

    def _offer(self: Any, data: bytes) -> bool:
        counts = PROBE.counts
        counts["offers"] += 1
        if self._writing:  # joins the write in progress: goes out when the socket has room
            counts["behind_a_write"] += 1
        return bool(ws_offer(self, data))

    wsclient.WebSocket._offer = _offer  # type: ignore[method-assign]

    run = poller_mod.Poller.run

    async def _run(self: Any) -> None:
        if freeze:
            gc.collect()
            gc.freeze()
        trio.lowlevel.add_instrument(_Steps())
        await run(self)

    poller_mod.Poller.run = _run  # type: ignore[method-assign]


if __name__ == "__main__":
    apply()
    from gateway.cli import main

    sys.exit(main(sys.argv[1:]))
