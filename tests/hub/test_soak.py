"""Soak: many turns over many sessions with random cancels and channel drops.

Asserts every turn ends exactly once (done, error, or lost with a dropped channel), no chunk is lost,
duplicated or reordered, every job gets exactly one final report, memory stays flat and the runner's
task count returns to its baseline. The CI form is short; the long form (10,000 turns over 50
sessions) is ``ALP_SOAK=long pytest tests/hub/test_soak.py -s``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
from pathlib import Path
from typing import Any

import trio
import trio.testing
from helpers import (
    ADMIN,
    CHAT_DEFINITION,
    OWNER,
    PROJECT,
    inbox,
    request_frame,
    runner_config,
    running,
    send,
)

from gateway.hub import Hub, ServerChannel, open_hub
from gateway.runner.supervisor import Runner
from gateway.sim import open_sim

LONG = os.environ.get("ALP_SOAK") == "long"
SESSIONS = 50 if LONG else 20
TURNS = 10_000 if LONG else 2_000
P_CANCEL, P_DROP = 0.05, 0.005
TERMINAL = ("chat.completion.done", "chat.completion.error")


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def count_tasks(nursery: trio.Nursery) -> int:
    total = 0
    for task in nursery.child_tasks:
        total += 1
        for child in task.child_nurseries:
            total += count_tasks(child)
    return total


class Tally:
    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {"done": 0, "error": 0, "cancelled": 0, "dropped": 0}
        self.chunks = 0
        self.finished = 0
        self.warm = trio.Event()
        self.problems: list[str] = []


def tokens(frames: list[dict[str, Any]]) -> list[int]:
    seq = []
    for frame in frames:
        if frame["type"] != "chat.completion.chunk":
            continue
        for choice in frame["chunk"].get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                seq.append(int(content[3:].strip()))
    return seq


async def drive(
    hub: Hub, job: Any, turns: int, rng: random.Random, tally: Tally, warm_at: int
) -> None:
    ch: ServerChannel | None = await hub.channels.wait(job.id, 15)
    assert ch is not None
    for k in range(turns):
        rid = f"{job.id[:8]}-{k}"
        n = rng.randint(1, 12)
        roll = rng.random()
        cancel, drop = roll < P_CANCEL, P_CANCEL <= roll < P_CANCEL + P_DROP
        await send(ch, request_frame(job.id, rid, sim={"chunks": n}))
        frames: list[dict[str, Any]] = []
        outcome = ""
        with trio.fail_after(30):
            while not outcome:
                try:
                    text, _ = await inbox(ch).recv()
                except trio.EndOfChannel:
                    outcome = "dropped"
                    break
                frame = json.loads(text)
                if frame.get("requestId") != rid:
                    tally.problems.append(f"{rid}: a frame for another turn: {text[:120]}")
                    continue
                frames.append(frame)
                if frame["type"] in TERMINAL:
                    error = frame.get("error")
                    outcome = (
                        "done"
                        if error is None
                        else "cancelled"
                        if error == "cancelled"
                        else "error"
                    )
                elif len(frames) == 1 and cancel:
                    await send(
                        ch, {"type": "chat.completion.cancel", "jobId": job.id, "requestId": rid}
                    )
                elif len(frames) == 1 and drop:
                    await ch.close(1011)
        seq = tokens(frames)
        if seq != list(range(len(seq))):
            tally.problems.append(f"{rid}: tokens out of order or duplicated: {seq}")
        if outcome == "done" and seq != list(range(n)):
            tally.problems.append(f"{rid}: done with {len(seq)} of {n} tokens")
        if outcome == "error":
            tally.problems.append(f"{rid}: unexpected error {frames[-1]}")
        if sum(f["type"] in TERMINAL for f in frames) > 1:
            tally.problems.append(f"{rid}: more than one terminal frame")
        tally.outcomes[outcome] += 1
        tally.chunks += len(seq)
        tally.finished += 1
        if tally.finished >= warm_at:
            tally.warm.set()
        if outcome == "dropped":
            new = await hub.channels.wait(job.id, 15)
            assert new is not None and new is not ch, "the runner did not redial"
            ch = new


async def test_soak(tmp_path: Path) -> None:
    rng = random.Random(1234)
    tally = Tally()
    async with open_sim() as sim, open_hub(Hub(admin_token=ADMIN)) as (hub, url):
        sim.record = False  # the simulator keeps nothing, so memory measures the runner's path
        config = runner_config(
            url, sim.url, tmp_path, max_sessions=SESSIONS + 1, reconnect_window=30.0
        )
        async with running(config) as runner:
            jobs = [
                await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
                for _ in range(SESSIONS)
            ]
            for job in jobs:
                assert await hub.channels.wait(job.id, 20) is not None
            with trio.fail_after(10):
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # every session settled
            baseline_tasks = runner_tasks(runner)
            start = trio.current_time()
            rss: dict[str, int] = {}
            async with trio.open_nursery() as nursery:
                for job in jobs:
                    nursery.start_soon(
                        drive,
                        hub,
                        job,
                        TURNS // SESSIONS,
                        random.Random(rng.random()),
                        tally,
                        TURNS // 5,
                    )

                async def sample_warm() -> None:
                    await tally.warm.wait()
                    gc.collect()
                    rss["warm"] = rss_kib()

                nursery.start_soon(sample_warm)
            elapsed = trio.current_time() - start
            gc.collect()
            rss["end"] = rss_kib()
            with trio.fail_after(10):
                # let cancelled turns unwind
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            end_tasks = runner_tasks(runner)
            for job in jobs:
                await hub.channels.end_job(job.id, "soak over")
            with trio.fail_after(20):
                for job in jobs:
                    await job.completed.wait()
    print(
        f"\nsoak: {tally.finished} turns over {SESSIONS} sessions in {elapsed:.1f} s, "
        f"{tally.chunks} chunks, outcomes {tally.outcomes}, RSS warm {rss['warm']} KiB -> end "
        f"{rss['end']} KiB, runner tasks {baseline_tasks} -> {end_tasks}"
    )
    assert not tally.problems, tally.problems[:10]
    assert tally.finished == TURNS // SESSIONS * SESSIONS
    assert tally.outcomes["cancelled"] > 0 and tally.outcomes["dropped"] > 0
    assert end_tasks == baseline_tasks
    assert rss["end"] <= rss["warm"] * 1.10, rss
    for job in jobs:
        finals = [r for r in job.reports if r.get("status") == "completed"]
        assert len(finals) == 1 and finals[0]["conclusion"] == "success", job.reports


def runner_tasks(runner: Runner) -> int:
    return count_tasks(runner._sessions_nursery)
