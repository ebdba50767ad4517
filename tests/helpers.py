"""Test helpers: runner configs, a running runner, chat sessions on the hub, frame collection."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio

from gateway.config import Config
from gateway.hub import Hub, ServerChannel
from gateway.runner import Runner

ADMIN = "alpa_test_admin_credential"
BACKEND_KEY = "sk-backend-very-secret-4242"
OWNER, PROJECT = "acme", "chat"
CHAT_DEFINITION = {"jobType": "chat_llm", "needs": ["chat-llm:v1"]}


def runner_config(server: str, backend: str | None, state_dir: Path, **overrides: Any) -> Config:
    base = Config(
        server=server,
        server_explicit=True,
        project=f"{OWNER}/{PROJECT}",
        state_dir=state_dir,
        backend=backend,
        backend_key=BACKEND_KEY,
        model="sim-model",
        user_token=ADMIN,
        name="test-runner",
        poll_interval=10.0,
        reconnect_window=10.0,
        grace=5.0,
        connect_timeout=5.0,
    )
    return replace(base, **overrides)


@asynccontextmanager
async def running(config: Config) -> AsyncIterator[Runner]:
    """A Runner serving in the background; cancelled (not drained) when the block ends."""
    runner = Runner(config)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run)
        with trio.fail_after(10):
            await runner.first_poll.wait()
        yield runner
        nursery.cancel_scope.cancel()


async def open_chat(hub: Hub, within: float = 10) -> tuple[Any, ServerChannel]:
    """Queue a Kind B job and wait for the runner's channel."""
    job = hub.enqueue_job(OWNER, PROJECT, ["chat-llm:v1"], dict(CHAT_DEFINITION))
    channel = await hub.wait_channel(job.id, within)
    assert channel is not None, "the runner did not open the chat channel"
    return job, channel


def request_frame(job_id: str, request_id: str, sim: dict[str, Any] | None = None, **body: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    payload.update(body)
    if sim is not None:
        payload["sim"] = sim
    return {"type": "chat.completion.request", "jobId": job_id, "requestId": request_id, "body": payload}


class Turns:
    """Reads a channel's inbox and sorts frames by requestId, with receive times."""

    def __init__(self, channel: ServerChannel) -> None:
        self.channel = channel
        self.frames: dict[str, list[tuple[dict[str, Any], str, float]]] = {}
        self.other: list[dict[str, Any]] = []

    def finished(self, request_id: str) -> bool:
        return any(
            f["type"] in ("chat.completion.done", "chat.completion.error", "chat.models.response")
            for f, _, _ in self.frames.get(request_id, [])
        )

    async def until(self, *request_ids: str, within: float = 15) -> None:
        with trio.fail_after(within):
            while not all(self.finished(r) for r in request_ids):
                await self.next()

    async def next(self) -> dict[str, Any]:
        text, at = await self.channel.recv()
        frame = json.loads(text)
        rid = frame.get("requestId")
        if rid is None:
            self.other.append(frame)
        else:
            self.frames.setdefault(rid, []).append((frame, text, at))
        return frame

    def of(self, request_id: str) -> list[dict[str, Any]]:
        return [f for f, _, _ in self.frames.get(request_id, [])]

    def chunks(self, request_id: str) -> list[dict[str, Any]]:
        return [f["chunk"] for f in self.of(request_id) if f["type"] == "chat.completion.chunk"]

    def last(self, request_id: str) -> dict[str, Any]:
        return self.of(request_id)[-1]


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
