"""Log lines: `--log-format json` one JSON object per line, for the formatter alone and for a real
runner process; the hub's process writes every line in the log format."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import subprocess
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
    send,
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
            await send(ch, request_frame(job.id, "t", sim={"chunks": 3}))
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


TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (DEBUG|INFO|WARNING|ERROR) +\S")


async def _hub_process(data: Path, *args: str, **env: str) -> tuple[int, str, str]:
    """``alp-gateway hub`` on a free port until it says it listens, then SIGTERM: its exit
    status, stdout and stderr."""
    proc = await trio.lowlevel.open_process(
        [EXE, "hub", "--listen", "127.0.0.1:0", "--data", str(data), *args],
        env=clean_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    err = b""
    try:
        with trio.fail_after(30):
            while b"hub listening on" not in err or not err.endswith(b"\n"):
                chunk = await proc.stderr.receive_some()
                assert chunk, f"the hub exited: {err!r}"
                err += chunk
            proc.send_signal(signal.SIGTERM)
            while chunk := await proc.stderr.receive_some():
                err += chunk
            out = b""
            while chunk := await proc.stdout.receive_some():
                out += chunk
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return code, out.decode(), err.decode()


async def test_the_hub_writes_every_line_in_the_log_format(tmp_path: Path) -> None:
    """Issue 31, point 11: the hub's start and stop lines were printed without a timestamp among
    log lines with one. Now stderr is log lines only, in the runner's formats; stdout holds the
    admin credential, printed once, and nothing else."""
    code, out, err = await _hub_process(tmp_path / "hub")
    assert code == 0
    lines = err.splitlines()
    assert all(TEXT_LINE.match(line) for line in lines), lines
    messages = [line.split(maxsplit=2)[2] for line in lines]
    assert messages[0].startswith("file limit ")  # how many connections it can hold (issue 39)
    assert messages[1].startswith("status page: http://127.0.0.1:")
    assert messages[2].startswith("hub listening on http://127.0.0.1:")
    assert "hub stopping" in messages
    token = (tmp_path / "hub" / "admin-token").read_text().strip()
    assert out.splitlines()[0].startswith("admin token (") and out.splitlines()[1] == f"  {token}"
    assert len(out.splitlines()) == 2 and token not in err

    code, out, err = await _hub_process(tmp_path / "hub", ALP_GATEWAY_LOG_FORMAT="json")
    assert code == 0 and out == ""  # the credential is shown once only
    messages = [str(e["msg"]) for e in json_lines(err)]
    assert messages[2].startswith("hub listening on http://") and "hub stopping" in messages
