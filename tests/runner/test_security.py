"""Secrets stay where they belong: not in what the Server receives, not in logs, not in frames."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest
import trio
from helpers import (
    ADMIN,
    BACKEND_KEY,
    RecordingProxy,
    Turns,
    open_chat,
    request_frame,
    runner_config,
    running,
    send,
)

from gateway.hub import Hub
from gateway.observe import Redactor, setup_logging
from gateway.runner.state import StateError, StateStore
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator


async def test_no_secret_reaches_the_server_or_a_log_line(
    heartbeats_wanted: None, hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    out = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    setup_logging("DEBUG", "text", stream=out)  # the production log pipeline, at its most verbose
    try:
        await _exercise(hub, sim, tmp_path, out)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


async def _exercise(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path, out: io.StringIO) -> None:
    port = int(hub[1].rsplit(":", 1)[1])
    async with trio.open_nursery() as nursery:
        proxy: RecordingProxy = await nursery.start(RecordingProxy(port).serve)
        config = runner_config(
            f"http://127.0.0.1:{proxy.port}",
            sim.url,
            tmp_path,
            verbose_frames=True,
            heartbeat_interval=0.2,
            log_level="DEBUG",
        )
        async with running(config) as runner:
            job, ch = await open_chat(hub[0])
            await send(ch, request_frame(job.id, "ok", sim={"chunks": 3}))
            await send(ch, request_frame(job.id, "fail", sim={"fault": "500"}))
            await send(
                ch, request_frame(job.id, "cut", sim={"fault": "disconnect", "fault_after": 1})
            )
            await send(ch, {"type": "chat.models.request", "requestId": "m"})
            # a frame from the Server that carries a credential-looking field, logged verbosely
            await send(
                ch, request_frame(job.id, "k", sim={"chunks": 1}, api_key="sk-caller-secret")
            )
            turns = Turns(ch)
            await turns.until("ok", "fail", "cut", "m", "k", errors={"fail", "cut"})
            with trio.fail_after(5):
                await runner.counters.wait("heartbeats", 1)
            await send(ch, {"type": "chat.end"})
            with trio.fail_after(5):
                await job.completed.wait()
            assert runner.registration is not None
            runner_token = runner.registration.token
        nursery.cancel_scope.cancel()
    sent = proxy.received()
    assert b"chat.completion.chunk" in sent  # the recording saw the channel traffic
    assert BACKEND_KEY.encode() not in sent
    assert ADMIN.encode() not in sent[sent.index(b"runners/jobs") :]  # used only to register
    lines = out.getvalue()
    assert "→" in lines and "←" in lines  # verbose frames were logged
    for secret in (BACKEND_KEY, ADMIN, runner_token, "sk-caller-secret"):
        assert secret not in lines, secret
    assert runner_token.encode() in sent  # it authenticates the runner, as it must


def test_redactor_masks_and_cuts() -> None:
    r = Redactor(["s3cret-value"], limit=60)
    text = r('{"authorization": "Bearer abc", "x": "s3cret-value", "token": "t1"} ' + "y" * 100)
    assert "s3cret" not in text and "abc" not in text and '"t1"' not in text
    assert text.endswith("chars)")
    assert "token=[redacted]" in r("wss://h/ws?jobId=1&token=alpr_xyz")


def test_state_file_readable_by_others_is_refused_at_start(tmp_path: Path) -> None:
    config = runner_config("http://127.0.0.1:9", "http://127.0.0.1:9/v1", tmp_path)
    Runner(config).store.save(
        __import__("gateway.runner.state", fromlist=["SavedRegistration"]).SavedRegistration(
            "id", "n", "alpr_t", "http://127.0.0.1:9", "acme", "chat"
        )
    )
    os.chmod(tmp_path / "registration.json", 0o640)
    with pytest.raises(StateError, match="readable by others"):
        trio.run(Runner(config).run)
    assert StateStore(tmp_path).path.exists()


async def test_error_frames_and_reports_hold_no_secret(
    hub: tuple[Hub, str], sim: Simulator, runner: Runner
) -> None:
    job, ch = await open_chat(hub[0])
    await send(ch, request_frame(job.id, "e", sim={"fault": "500"}))
    turns = Turns(ch)
    await turns.until("e", errors={"e"})
    await send(ch, {"type": "chat.end"})
    with trio.fail_after(5):
        await job.completed.wait()
    everything = json.dumps(turns.of("e")) + json.dumps(job.reports) + json.dumps(job.last_progress)
    assert BACKEND_KEY not in everything
