"""The whole path with real parts: openai client → hub front door → runner → simulator, and `demo`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import trio
from helpers import ADMIN, EXE, OWNER, PROJECT, runner_config, runner_env, running

from gateway.hub import Hub, open_hub
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture
async def path(sim: Simulator, tmp_path: Path) -> AsyncIterator[tuple[Hub, str, Runner]]:
    async with open_hub(Hub(runner_wait_timeout=10)) as (hub, url):
        config = runner_config(url, sim.url, tmp_path, user_token=hub.admin_token)
        async with running(config) as runner:
            yield hub, await hub.keys.create("e2e", f"{OWNER}/{PROJECT}"), runner


def client(
    hub_and_key: tuple[Hub, str, Runner], url: str, session: str = "s"
) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key=hub_and_key[1],
        max_retries=0,
        timeout=15,
        default_headers={"X-Chat-Session": session},
    )


def hub_url(runner: Runner) -> str:
    return runner.config.server


async def test_openai_stream_tool_calls_and_usage_intact(
    path: tuple[Hub, str, Runner], sim: Simulator
) -> None:
    oc = client(path, hub_url(path[2]))
    stream = await oc.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "x"}],
        tools=[TOOL],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"sim": {"tool_calls": True, "chunks": 4}},
    )
    chunks = [c async for c in stream]
    args = "".join(
        tc.function.arguments or ""
        for c in chunks
        if c.choices
        for tc in (c.choices[0].delta.tool_calls or [])
    )
    names = [
        tc.function.name
        for c in chunks
        if c.choices
        for tc in (c.choices[0].delta.tool_calls or [])
        if tc.function and tc.function.name
    ]
    assert names == ["lookup"]
    assert json.loads(args) == {"seq": "tok0 tok1 tok2 tok3 "}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # every chunk the client saw is the simulator's own payload, unchanged
    sent = [json.loads(p) for p in sim.streams[0].payloads if p != b"[DONE]"]
    assert [c.model_dump(exclude_unset=True) for c in chunks] == sent


async def test_openai_non_stream_and_models(path: tuple[Hub, str, Runner]) -> None:
    oc = client(path, hub_url(path[2]))
    reply = await oc.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "x"}],
        extra_body={"sim": {"chunks": 3}},
    )
    assert reply.choices[0].message.content == "tok0 tok1 tok2 "
    models = await oc.models.list()
    assert [m.id for m in models.data] == ["sim-model"]


async def test_backend_error_is_the_clients_own_error(path: tuple[Hub, str, Runner]) -> None:
    oc = client(path, hub_url(path[2]))
    with pytest.raises(openai.InternalServerError) as info:
        await oc.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            extra_body={"sim": {"fault": "500"}},
        )
    assert info.value.status_code == 502
    assert "backend returned 500" in str(info.value)


async def test_client_disconnect_stops_the_backend(
    path: tuple[Hub, str, Runner], sim: Simulator
) -> None:
    oc = client(path, hub_url(path[2]))
    stream = await oc.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        extra_body={"sim": {"chunks": 200, "interval": 0.05}},
    )
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()
    record = sim.streams[0]
    with trio.fail_after(5):
        await record.finished.wait()
    assert record.client_closed and not record.completed


async def test_two_sessions_two_jobs_interleaved(
    path: tuple[Hub, str, Runner], sim: Simulator
) -> None:
    url = hub_url(path[2])
    results: dict[str, str] = {}

    async def chat(session: str, chunks: int, interval: float) -> None:
        oc = client(path, url, session)
        stream = await oc.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": session}],
            stream=True,
            extra_body={"sim": {"chunks": chunks, "interval": interval}},
        )
        text = ""
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
        results[session] = text

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat, "a", 10, 0.03)
        nursery.start_soon(chat, "b", 10, 0.03)
    assert results["a"] == results["b"] == "".join(f"tok{i} " for i in range(10))
    assert len(path[2].sessions) == 2
    jobs = {j.id for j in await path[0].board.all_jobs.values() if j.claimed_by}
    assert len(jobs) == 2
    # both streams overlapped in time: neither waited for the other
    a, b = sim.streams[0], sim.streams[1]
    assert a.sent_at[0] < b.sent_at[-1] and b.sent_at[0] < a.sent_at[-1]


async def test_demo_subprocess_prints_the_reply() -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [EXE, "demo", "--sim"], capture_stdout=True, capture_stderr=True, check=False
        )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "tok0 tok1 tok2" in out and "time to first token" in out and "relay overhead" in out


async def test_models_from_the_first_call_with_no_session(sim: Simulator, tmp_path: Path) -> None:
    # a fresh hub, one real runner (the installed command), no chat session yet: the official
    # client's first models.list() is served by a short listing session, not answered []
    hub = Hub(admin_token=ADMIN, models_wait=60.0)  # bounds a slow start here, not a timing
    async with open_hub(hub) as (_, url):
        key = await hub.keys.create("models", f"{OWNER}/{PROJECT}")
        log_path = tmp_path / "runner.log"
        with log_path.open("wb") as log:
            proc = await trio.lowlevel.open_process(
                [EXE, "run", "--project", f"{OWNER}/{PROJECT}", "--state-dir", str(tmp_path / "s")],
                env=runner_env(url, sim.url),
                stdout=log,
                stderr=log,
            )
        try:
            oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=90)
            with trio.fail_after(90):
                # once the runner is up (the hub answers "no runner" at once before that)
                while not hub.board.availability(OWNER, PROJECT, "chat-llm:v1").free:
                    await hub.board.changes.wait()
                listed = await oc.models.list()
                one = await oc.models.retrieve("sim-model")
                (job,) = await hub.board.all_jobs.values()  # the listing session's job
                await job.completed.wait()  # ended with chat.end, reported by the runner
                again = await oc.models.list()  # from the runner's stored answer
        finally:
            proc.terminate()
            with trio.move_on_after(20):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
    assert [m.id for m in listed.data] == ["sim-model"], log_path.read_text()
    assert one.id == "sim-model" and one.object == "model"
    assert [m.id for m in again.data] == ["sim-model"] and await hub.board.all_jobs.count() == 1
    assert job.cancel_reason == "models listed" and job.conclusion == "success"
    assert hub.sessions.listing() == {}
