"""Graceful shutdown under load: `alp-gateway run` gets SIGTERM while 20 turns stream in 4 sessions;
a stop with the Server gone is short and says once what it lost; a Server gone for minutes is
said once a minute."""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ADMIN,
    EXE,
    OWNER,
    PROJECT,
    inbox,
    open_chat,
    open_request,
    request_frame,
    runner_config,
    runner_env,
    send,
)

from gateway.hub import Hub, ServerChannel, open_hub
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator

SESSIONS, TURNS, CHUNKS, INTERVAL = 4, 5, 30, 0.1
GRACE = 20.0


@dataclass
class Turn:
    """One turn's frames as the Server received them."""

    job_id: str
    request_id: str
    frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        out = ""
        for f in self.frames:
            if f["type"] == "chat.completion.chunk":
                for choice in f["chunk"].get("choices", []):
                    out += choice.get("delta", {}).get("content") or ""
        return out


async def _collect(ch: ServerChannel, turn: Turn, rx: trio.MemoryReceiveChannel[Any]) -> None:
    async with rx:
        async for text, _ in rx:
            frame = json.loads(text)
            turn.frames.append(frame)
            if frame["type"] in ("chat.completion.done", "chat.completion.error"):
                return


async def _collect_end(ch: ServerChannel, into: list[dict[str, Any]]) -> None:
    while True:
        try:
            text, _ = await inbox(ch).recv()
        except trio.EndOfChannel:
            return
        frame = json.loads(text)
        if frame.get("type") == "chat.end":
            into.append(frame)
            return


async def test_sigterm_under_load_drains_every_turn_and_session(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    server, url = hub
    log_path = tmp_path / "runner.log"
    with log_path.open("wb") as log:
        proc = await trio.lowlevel.open_process(
            [
                EXE,
                "run",
                "--project",
                f"{OWNER}/{PROJECT}",
                "--state-dir",
                str(tmp_path / "s"),
                "--grace",
                str(GRACE),
            ],
            env=runner_env(url, sim.url),
            stdout=log,
            stderr=log,
        )
    turns: list[Turn] = []
    ends: dict[str, list[dict[str, Any]]] = {}
    jobs = []
    try:
        async with trio.open_nursery() as nursery:
            for _ in range(SESSIONS):
                job, ch = await open_chat(server, within=30)
                jobs.append(job)
                ends[job.id] = []
                nursery.start_soon(_collect_end, ch, ends[job.id])
                for t in range(TURNS):
                    turn = Turn(job.id, f"t{t}")
                    turns.append(turn)
                    nursery.start_soon(_collect, ch, turn, open_request(ch, turn.request_id))
                    sim_options = {"chunks": CHUNKS, "interval": INTERVAL}
                    await send(ch, request_frame(job.id, turn.request_id, sim=sim_options))
            with trio.fail_after(30):  # every turn is streaming
                for n in range(1, SESSIONS * TURNS + 1):
                    await (await sim.wait_for_streams(n)).wait_sent(1)
            in_flight = sum(not s.finished.is_set() for s in sim.streams)
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(GRACE + 15):  # a hang guard: the turns end well within GRACE
                code = await proc.wait()
            # the collectors end with the channels
            nursery.cancel_scope.deadline = trio.current_time() + 10
    finally:
        if proc.returncode is None:
            proc.kill()
    log_text = log_path.read_text()
    assert code == 0, log_text
    assert in_flight >= 1
    # no turn was cut at the grace: each ends with done and its whole text (below)
    expected = "".join(f"tok{i} " for i in range(CHUNKS))
    for turn in turns:  # each turn finished normally, whole
        assert turn.frames and turn.frames[-1]["type"] == "chat.completion.done", (turn, log_text)
        assert turn.text == expected
    assert all(s.completed for s in sim.streams) and len(sim.streams) == SESSIONS * TURNS
    for job in jobs:  # each session was ended by the runner, then reported exactly once
        assert ends[job.id] == [
            {"type": "chat.end", "jobId": job.id, "reason": "runner shutting down"}
        ]
        finals = [r for r in job.reports if r.get("status") == "completed"]
        assert len(finals) == 1 and finals[0]["conclusion"] == "success", job.reports


@contextmanager
def records(level: int) -> Iterator[list[logging.LogRecord]]:
    """The log records of ``level`` and above while the block runs."""
    kept: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = kept.append  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield kept
    finally:
        root.removeHandler(handler)


@pytest.mark.parametrize("when", ["redialling", "reporting"])
async def test_a_stop_with_the_server_gone_is_short_and_says_once_what_it_lost(
    autojump_clock: trio.testing.MockClock, sim: Simulator, tmp_path: Path, when: str
) -> None:
    """Issue 31 point 6: three sessions, no turn in flight, then the Server goes away. The stop
    comes while their channels are being redialled, or once they gave up and their final
    reports are being retried: either way it takes at most 2 s and logs one WARNING line (it
    used to take about 31 s: eight report attempts each, and an ERROR line per job)."""
    window = 60.0 if when == "redialling" else 1.0
    stopped = trio.Event()
    async with trio.open_nursery() as nursery:
        async with open_hub(Hub(admin_token=ADMIN)) as (hub, url):
            runner = Runner(runner_config(url, sim.url, tmp_path, reconnect_window=window))

            async def run() -> None:
                await runner.run()
                stopped.set()

            nursery.start_soon(run)
            with trio.fail_after(10):
                await runner.first_poll.wait()
            for _ in range(3):
                await open_chat(hub)
        # the hub is gone: its listener and every connection closed
        runner._wake.set()  # poll now
        with trio.fail_after(10):
            await runner.counters.wait("poll_errors", 1)
        if when == "reporting":  # past the reconnect window (the clock's time, not real time)
            await trio.sleep(window + 0.2)
            assert len(runner._reporting) == 3 and not runner.sessions
        else:
            assert len(runner.sessions) == 3 and not runner._reporting
        began = trio.current_time()
        with records(logging.WARNING) as said:
            runner.begin_shutdown()
            with trio.fail_after(30):
                await stopped.wait()
        took = trio.current_time() - began
    assert took <= 2.0, took
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]
    line = said[0].getMessage()
    assert line.startswith("stopped without the final report of 3 job(s) ("), line
    assert "was unreachable (connection refused" in line and "ends them itself" in line
    assert runner.counters.get("reports_lost") == 3


async def test_a_server_gone_for_minutes_is_said_once_a_minute_not_at_every_poll(
    autojump_clock: trio.testing.MockClock, sim: Simulator, tmp_path: Path
) -> None:
    """The runner polls an unreachable Server every 1.5 s at most (so that it is back at once
    after a restart), but a hub down for the night must not fill the log with a WARNING per
    poll: the first failure is said, then one line a minute saying how many in a row."""
    async with trio.open_nursery() as nursery:
        async with open_hub(Hub(admin_token=ADMIN)) as (_hub, url):
            runner = Runner(runner_config(url, sim.url, tmp_path))
            nursery.start_soon(runner.run)
            with trio.fail_after(10):
                await runner.first_poll.wait()
        with records(logging.WARNING) as said:
            runner._wake.set()  # poll now: the hub is gone
            with trio.fail_after(10):
                await runner.counters.wait("poll_errors", 1)
            await trio.sleep(150)  # the clock's seconds
        failed = runner.counters.get("poll_errors")
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in said if r.getMessage().startswith("poll failed")]
    assert failed >= 100  # it kept polling at most 1.5 s apart
    assert len(lines) == 3, lines  # at once, then after one and two minutes
    assert "connection refused" in lines[0]
    assert "in a row" in lines[1] and "in a row" in lines[2], lines


async def test_a_clean_stop_withdraws_chat_llm_in_a_last_poll(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """Issue 36, point 1: a runner that stops cleanly says so to the Server, with a last poll
    that no longer advertises chat-llm:v1 (the protocol's capability withdrawn): the hub takes
    no new job to it from then on, instead of counting on it until ``offline_after``."""
    server, url = hub
    runner = Runner(runner_config(url, sim.url, tmp_path / "state"))
    with trio.fail_after(30):  # a hang guard only
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run)
            await runner.first_poll.wait()
            assert runner.registration is not None
            state = server.board.runners[runner.registration.id]
            assert state.capabilities == frozenset({"chat-llm:v1"})
            runner.begin_shutdown()
    assert state.capabilities == frozenset()  # withdrawn by its last poll
    assert server.board.alive(runner.registration.id)  # a sign of life: not a runner gone dark
