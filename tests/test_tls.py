"""TLS to the Server: a hub with a self-signed certificate (``trustme``) is refused without the CA
and served with ``ca_file``; there is no way to turn verification off."""

from __future__ import annotations

import re
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import trio
import trustme
from faultproxy import RequestLog
from helpers import (
    ADMIN,
    EXE,
    OWNER,
    PROJECT,
    Turns,
    clean_env,
    open_chat,
    request_frame,
    runner_config,
    running,
    send,
)

from gateway.config import SETTINGS, Config
from gateway.hub import App, Hub, open_hub
from gateway.runner.supervisor import Runner, RunnerExit
from gateway.sim import Simulator


@dataclass
class Pki:
    ca: Path  # the CA certificate the runner may be given (ca_file)
    cert: Path  # the Server's certificate chain (127.0.0.1, localhost)
    key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    pki = Pki(where / "ca.pem", where / "server.pem", where / "server.key")
    ca.cert_pem.write_to_path(str(pki.ca))
    pki.cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(pki.key))
    return pki


@pytest.fixture
async def tls_hub(pki: Pki) -> AsyncIterator[tuple[Hub, str, RequestLog]]:
    hub = Hub(admin_token=ADMIN)
    requests = RequestLog(App(hub))  # every request the hub's app is given
    async with open_hub(hub, certfile=pki.cert, keyfile=pki.key, app=requests) as (_, url):
        yield hub, url, requests


async def test_untrusted_server_certificate_is_refused(
    tls_hub: tuple[Hub, str, RequestLog], sim: Simulator, tmp_path: Path
) -> None:
    hub, url, requests = tls_hub
    assert url.startswith("https://")
    job = await hub.board.enqueue(OWNER, PROJECT, ["chat-llm:v1"], {"jobType": "chat_llm"})
    runner = Runner(runner_config(url, sim.url, tmp_path))  # no ca_file: system CAs only
    with trio.fail_after(20), pytest.raises(RunnerExit) as info:
        await runner.run()  # a certificate failure is not retried: it will not fix itself
    assert "certificate" in str(info.value) and "--ca-file" in str(info.value)
    assert runner.registration is None and not runner.first_poll.is_set()
    assert requests.requests == []  # no request got past the TLS handshake
    assert job.claimed_by is None and job.status == "queued"


async def test_private_ca_registers_claims_and_serves_over_wss(
    tls_hub: tuple[Hub, str, RequestLog], sim: Simulator, pki: Pki, tmp_path: Path
) -> None:
    hub, url, requests = tls_hub
    async with running(runner_config(url, sim.url, tmp_path, ca_file=pki.ca)) as runner:
        assert runner.registration is not None and runner.registration.server == url
        job, ch = await open_chat(hub)  # the channel is wss://: this port speaks only TLS
        await send(ch, request_frame(job.id, "r", sim={"chunks": 3}))
        turns = Turns(ch)
        await turns.until("r")
        assert turns.last("r")["type"] == "chat.completion.done"
        assert len(turns.chunks("r")) == len(sim.streams[0].payloads) - 1
    polls = f"/api/owners/{OWNER}/projects/{PROJECT}/runners/jobs"
    assert ("POST", polls) in requests.requests  # what the first test counts, counted


def test_no_setting_turns_verification_off() -> None:
    names = {s.key for s in SETTINGS} | {f.name for f in fields(Config)}
    suspicious = {n for n in names if any(w in n for w in ("insecure", "verify", "no_tls", "skip"))}
    assert suspicious == set()


# -- the command line: `alp-gateway hub --tls-cert/--tls-key`, `alp-gateway register` ----------


@pytest.fixture
async def hub_cli(pki: Pki, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """``alp-gateway hub --tls-cert --tls-key`` on a free port: (its https URL, admin token)."""
    proc = await trio.lowlevel.open_process(
        [
            EXE,
            "hub",
            "--listen",
            "127.0.0.1:0",
            "--data",
            str(tmp_path / "hub"),
            "--tls-cert",
            str(pki.cert),
            "--tls-key",
            str(pki.key),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=clean_env(),
    )
    listening = trio.Event()
    found: list[str] = []

    async def read_log() -> None:  # the log lines (stderr), read to the end: a full pipe stalls
        assert proc.stderr is not None
        seen = b""
        while data := await proc.stderr.receive_some():
            seen += data
            if not listening.is_set() and (url := re.search(rb"hub listening on (\S+)\n", seen)):
                found.append(url.group(1).decode())
                listening.set()
        listening.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(30):
                await listening.wait()
            assert found, "the hub exited"
            token = (tmp_path / "hub" / "admin-token").read_text().strip()
            try:
                yield found[0], token
            finally:
                proc.terminate()
    finally:
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()


async def _register(
    url: str, token: str, state: Path, *extra: str
) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [
            EXE,
            "register",
            "--server",
            url,
            "--project",
            f"{OWNER}/{PROJECT}",
            "--state-dir",
            str(state),
            "--user-token",
            token,
            *extra,
        ],
        env=clean_env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_cli_hub_over_tls_and_register_with_ca_file(
    hub_cli: tuple[str, str], pki: Pki, tmp_path: Path
) -> None:
    url, token = hub_cli
    assert url.startswith("https://127.0.0.1:")
    with trio.fail_after(30):
        result = await _register(url, token, tmp_path / "s", "--ca-file", str(pki.ca))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "s" / "registration.json").exists()


async def test_cli_register_without_ca_fails_naming_the_certificate(
    hub_cli: tuple[str, str], tmp_path: Path
) -> None:
    url, token = hub_cli
    proc = await trio.lowlevel.open_process(
        [
            EXE,
            "register",
            "--server",
            url,
            "--project",
            f"{OWNER}/{PROJECT}",
            "--state-dir",
            str(tmp_path / "s"),
            "--user-token",
            token,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=clean_env(),
    )
    assert proc.stderr is not None
    err = b""
    try:
        with trio.move_on_after(4):
            while data := await proc.stderr.receive_some():
                err += data
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = err.decode()
    assert proc.returncode not in (0, -9), text
    assert "certificate" in text.lower() and len(text.strip().splitlines()) == 1, text
