"""Session limits from the Chat Job's agentDefinition (idleTimeoutMinutes, maxTimeoutMinutes),
on trio's autojump clock: a real hub, simulator and runner in-process, minutes pass at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from helpers import ADMIN, OWNER, PROJECT, LogCapture, Turns, request_frame, running, send
from helpers import runner_config as _runner_config

from gateway.config import Config
from gateway.hub import Hub, open_hub
from gateway.runner.alp import OfferedJob
from gateway.runner.session import ChatJob
from gateway.sim import Simulator


# Hours pass at once here: keepalive is off on both ends (its own tests run on real time), so no
# ping's answer is ever judged against a clock that jumps while the answer is on its way.
@pytest.fixture
async def hub() -> Any:
    async with open_hub(Hub(admin_token=ADMIN, ping_interval=0.0)) as pair:
        yield pair


def runner_config(server: str, backend: str | None, state_dir: Path, **overrides: Any) -> Config:
    return _runner_config(server, backend, state_dir, ping_interval=0.0, **overrides)


async def _chat(hub: Hub, **definition: Any) -> tuple[Any, Any]:
    job = await hub.board.enqueue(
        OWNER,
        PROJECT,
        ["chat-llm:v1"],
        {"jobType": "chat_llm", "needs": ["chat-llm:v1"], **definition},
    )
    channel = await hub.channels.wait(job.id, 30)
    assert channel is not None, "the runner did not open the chat channel"
    return job, channel


async def _chat_end(turns: Turns) -> tuple[dict[str, Any], float]:
    """The runner's chat.end frame and when it came."""
    while True:
        frame = await turns.next()
        if frame["type"] == "chat.end":
            return frame, trio.current_time()


async def test_idle_limit_ends_the_session_after_the_last_turn(
    autojump_clock: trio.testing.MockClock, hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path)) as runner:
        job, ch = await _chat(hub[0], idleTimeoutMinutes=2)
        turns = Turns(ch)
        await trio.sleep(90)  # idle 1.5 min: still open
        await send(ch, request_frame(job.id, "t1", sim={"chunks": 30, "interval": 1.0}))
        await turns.until("t1", within=120)  # 30 s of generation: in flight is not idle
        ended = trio.current_time()
        end, at = await _chat_end(turns)
        assert end["reason"] == "session idle for 2 min (idleTimeoutMinutes)"
        assert at - ended == pytest.approx(120, abs=1)  # two minutes after the turn ended
        with trio.fail_after(30):
            await runner.counters.wait("sessions_ended", 1)
        assert job.conclusion == "success"
        assert runner.counters.get("reports_success") == 1  # one report
        assert runner.counters.get("turns_done") == 1


async def test_max_limit_gives_in_flight_turns_the_grace_then_ends(
    autojump_clock: trio.testing.MockClock, hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    config = runner_config(hub[1], sim.url, tmp_path, grace=10.0)
    async with running(config) as runner:
        job, ch = await _chat(hub[0], maxTimeoutMinutes=1, idleTimeoutMinutes="soon")
        started = trio.current_time()
        turns = Turns(ch)
        # one turn ends within the grace (at ~63 s), one would take 1000 s
        await send(ch, request_frame(job.id, "short", sim={"chunks": 63, "interval": 1.0}))
        await send(ch, request_frame(job.id, "long", sim={"chunks": 1000, "interval": 1.0}))
        await turns.until("short", "long", errors={"long"}, within=120)
        reason = "session reached its time limit of 1 min (maxTimeoutMinutes)"
        assert turns.last("long")["error"] == reason
        end, at = await _chat_end(turns)
        assert end["reason"] == reason
        assert at - started == pytest.approx(70, abs=2)  # the limit, then the 10 s grace
        with trio.fail_after(30):
            await runner.counters.wait("sessions_ended", 1)
        assert job.conclusion == "success"
        assert runner.counters.get("reports_success") == 1
        assert runner.counters.get("turns_done") == 1
        assert runner.counters.get("turns_cancelled") == 1


async def test_a_turn_arriving_after_the_limit_is_refused_with_the_reason(
    autojump_clock: trio.testing.MockClock, hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path, grace=30.0)) as runner:
        job, ch = await _chat(hub[0], maxTimeoutMinutes=0.5)
        turns = Turns(ch)
        await send(ch, request_frame(job.id, "long", sim={"chunks": 50, "interval": 1.0}))
        await trio.sleep(40)  # past the limit: winding down, "long" in its grace
        await send(ch, request_frame(job.id, "late", sim={"chunks": 1}))
        await turns.until("late", "long", errors={"late"}, within=120)
        reason = "session reached its time limit of 0.5 min (maxTimeoutMinutes)"
        assert turns.last("late")["error"] == reason
        end, _ = await _chat_end(turns)
        assert end["reason"] == reason
        with trio.fail_after(30):
            await runner.counters.wait("sessions_ended", 1)
        assert runner.counters.get("reports_success") == 1


async def test_absent_or_invalid_limits_mean_none_and_invalid_is_logged_once(
    autojump_clock: trio.testing.MockClock,
    hub: tuple[Hub, str],
    sim: Simulator,
    tmp_path: Path,
    logs: LogCapture,
) -> None:
    async with running(runner_config(hub[1], sim.url, tmp_path)) as runner:
        job, ch = await _chat(hub[0], idleTimeoutMinutes=-5, maxTimeoutMinutes=True)
        turns = Turns(ch)
        await send(ch, request_frame(job.id, "t1", sim={"chunks": 2}))
        await turns.until("t1")
        await trio.sleep(6 * 3600)  # six hours: no limit applies
        assert list(runner.sessions) == [job.id]
        await send(ch, request_frame(job.id, "t2", sim={"chunks": 2}))
        await turns.until("t2")
        assert not any(f["type"] == "chat.end" for f in turns.other)
        assert job.conclusion is None
    warned = [line for line in logs.lines if "not a positive number of minutes" in line]
    assert len(warned) == 2
    assert any("idleTimeoutMinutes is -5" in line for line in warned)
    assert any("maxTimeoutMinutes is True" in line for line in warned)


def chat_job(job: dict[str, Any], run_id: str) -> ChatJob:
    """The ``ChatJob`` a claimed job offered as ``job`` (a poll's JSON, as decoded) becomes."""
    return ChatJob.of(msgspec.convert(job, OfferedJob), run_id)


@pytest.mark.parametrize(
    ("definition", "idle", "total"),
    [
        ({}, None, None),
        ({"idleTimeoutMinutes": 5}, 300.0, None),
        ({"maxTimeoutMinutes": 1.5, "idleTimeoutMinutes": None}, None, 90.0),
        ({"idleTimeoutMinutes": "5", "maxTimeoutMinutes": 0}, None, None),
        ({"idleTimeoutMinutes": float("inf"), "maxTimeoutMinutes": [1]}, None, None),
    ],
)
def test_limits_parsed_from_the_agent_definition(
    definition: dict[str, Any], idle: float | None, total: float | None
) -> None:
    chat = chat_job({"id": "j1", "agentDefinition": definition}, "r1")
    assert (chat.idle_timeout, chat.max_timeout) == (idle, total)


def test_job_traceparent_kept_only_when_well_formed() -> None:
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert chat_job({"id": "j", "agentDefinition": {"traceparent": good}}, "r").traceparent == good
    assert chat_job({"id": "j", "agentDefinition": {"traceparent": "x"}}, "r").traceparent is None
    assert chat_job({"id": "j", "agentDefinition": None}, "r").traceparent is None
