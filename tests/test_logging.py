"""`--log-format json`: one JSON object per line, for the formatter alone and for a real runner process."""

from __future__ import annotations

import io
import json
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from helpers import (
    ADMIN,
    BACKEND_KEY,
    EXE,
    OWNER,
    PROJECT,
    Turns,
    clean_env,
    open_chat,
    request_frame,
)

from gateway.hub import Hub
from gateway.observe import setup_logging
from gateway.sim import Simulator

FIELDS = {"ts", "level", "logger", "msg"}


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def json_lines(text: str) -> list[dict[str, object]]:
    lines = text.splitlines()
    assert lines, "no log output"
    entries = [json.loads(line) for line in lines]  # each line alone is one JSON document
    for entry in entries:
        assert isinstance(entry, dict) and FIELDS <= entry.keys(), entry
    return entries


def test_json_format_is_one_object_per_line(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("DEBUG", "json", stream=out)
    log = logging.getLogger("gateway.test")
    log.info("plain")
    log.warning('two\nlines, "quotes", tabs\t and ünïcödé ✓')
    try:
        raise ValueError("boom\nwith a second line")
    except ValueError:
        log.exception("failed: %s", "details")
    log.debug("with a bearer token: Authorization: Bearer sk-abc123")
    entries = json_lines(out.getvalue())
    assert len(entries) == 4
    assert entries[0]["level"] == "info" and entries[0]["logger"] == "gateway.test"
    assert entries[1]["msg"] == 'two\nlines, "quotes", tabs\t and ünïcödé ✓'
    assert entries[2]["level"] == "error" and "ValueError: boom" in str(entries[2]["exc"])
    assert str(entries[0]["ts"]).endswith("Z")
    assert "sk-abc123" not in out.getvalue()


async def test_runner_process_logs_json_lines(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    log_path = tmp_path / "runner.log"
    env = clean_env()
    env.update(
        AGENTICS_SERVER=hub[1],
        CHAT_LLM_BACKEND_URL=sim.url,
        CHAT_LLM_BACKEND_KEY=BACKEND_KEY,
        CHAT_LLM_MODEL="sim-model",
        AGENTICS_USER_TOKEN=ADMIN,
    )
    with log_path.open("wb") as log:
        proc = await trio.lowlevel.open_process(
            [
                EXE,
                "run",
                "--project",
                f"{OWNER}/{PROJECT}",
                "--state-dir",
                str(tmp_path / "s"),
                "--log-format",
                "json",
                "--log-level",
                "DEBUG",
            ],
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            job, ch = await open_chat(hub[0], within=20)
            await ch.send(request_frame(job.id, "t", sim={"chunks": 3}))
            await Turns(ch).until("t")
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(20):
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert code == 0
    text = log_path.read_text()
    entries = json_lines(text)
    messages = [str(e["msg"]) for e in entries]
    assert any(m.startswith("registered as runner") for m in messages)
    assert any(m.startswith("session start") for m in messages)
    assert any(m.startswith("session end") for m in messages)
    assert messages[-1] == "runner stopped"
    saved = json.loads((tmp_path / "s" / "registration.json").read_text())
    (registration,) = saved["registrations"]
    token = registration["token"]
    for secret in (BACKEND_KEY, ADMIN, token):
        assert secret not in text
