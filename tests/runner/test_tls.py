"""TLS to the Server: a hub with a self-signed certificate (``trustme``) is refused without the CA
and served with ``ca_file``; there is no way to turn verification off."""

from __future__ import annotations

import dataclasses
import re
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from pathlib import Path

import httpx
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

from gateway.config import SETTINGS, Config, load_config
from gateway.hub import App, Hub, open_hub
from gateway.ops.doctor import WARN, diagnose
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


# -- the hints (issue 37, point 4) --------------------------------------------------------------


def _pki_for(where: Path, *names: str) -> Pki:
    """A CA of its own and a server certificate naming ``names`` in its SAN."""
    ca = trustme.CA()
    issued = ca.issue_cert(*names)
    pki = Pki(where / "ca.pem", where / "server.pem", where / "server.key")
    where.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(pki.ca))
    pki.cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(pki.key))
    return pki


async def _refusal(url: str, sim: Simulator, tmp_path: Path, ca: Path) -> str:
    runner = Runner(runner_config(url, sim.url, tmp_path / "state", ca_file=ca))
    with trio.fail_after(20), pytest.raises(RunnerExit) as info:
        await runner.run()
    return str(info.value)


async def test_a_certificate_without_the_host_in_its_san_says_so(
    sim: Simulator, tmp_path: Path
) -> None:
    """The hub's certificate names only ``localhost``; the runner dials 127.0.0.1 with the right
    --ca-file: the refusal names the SAN, not --ca-file."""
    pki = _pki_for(tmp_path / "pki", "localhost")
    async with open_hub(Hub(admin_token=ADMIN), certfile=pki.cert, keyfile=pki.key) as (_, url):
        said = await _refusal(url, sim, tmp_path, pki.ca)
    assert "does not name 127.0.0.1 in its subjectAltName" in said, said
    assert "give it with --ca-file" not in said


async def test_a_certificate_of_another_ca_than_ca_file_says_ca_file_was_given(
    pki: Pki, sim: Simulator, tmp_path: Path
) -> None:
    other = _pki_for(tmp_path / "other", "127.0.0.1")
    async with open_hub(Hub(admin_token=ADMIN), certfile=pki.cert, keyfile=pki.key) as (_, url):
        said = await _refusal(url, sim, tmp_path, other.ca)
    assert f"though --ca-file {other.ca} was given" in said, said
    assert "give it with --ca-file" not in said


async def test_plain_http_to_the_tls_port_gets_one_400_saying_it_speaks_https(
    tls_hub: tuple[Hub, str, RequestLog],
) -> None:
    hub, url, requests = tls_hub
    port = int(url.rsplit(":", 1)[1])
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while data := await stream.receive_some(65536):
                answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower()
    assert b"this port speaks HTTPS" in body and answer.count(b"HTTP/1.1") == 1
    assert requests.requests == []  # nothing reached the hub's routes


async def test_a_bare_host_port_of_a_tls_hub_registers_over_https(
    tls_hub: tuple[Hub, str, RequestLog], sim: Simulator, pki: Pki, tmp_path: Path
) -> None:
    """``--server 127.0.0.1:PORT`` (a bare local host: http://) of a hub serving TLS: plain HTTP
    gets its 400, https:// is tried, the runner registers there and serves; its next start
    finds that registration."""
    hub, url, requests = tls_hub
    bare = url.removeprefix("https://")
    config = load_config(
        {"server": bare, "project": f"{OWNER}/{PROJECT}", "backend": [sim.url]},
        {"AGENTICS_USER_TOKEN": ADMIN, "ALP_GATEWAY_CA_FILE": str(pki.ca)},
        None,
    )
    config = dataclasses.replace(config, state_dir=tmp_path / "state")
    assert config.server == f"http://{bare}"
    async with running(config) as runner:
        assert runner.registration is not None and runner.registration.server == url
    again = Runner(dataclasses.replace(config, user_token=None))
    found = await again._ensure_registration()  # no user credential: it must be the saved one
    assert found.server == url and found.id == runner.registration.id


DEPLOY = Path(__file__).resolve().parents[2] / "packaging" / "DEPLOY.md"


def deploy_tls_recipe() -> str:
    """The ``sh`` block of DEPLOY.md's "TLS with your own CA"."""
    text = DEPLOY.read_text(encoding="utf-8")
    section = text[text.index("\n### TLS with your own CA\n") :]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


async def test_deploys_openssl_recipe_makes_a_certificate_runners_and_clients_trust(
    sim: Simulator, tmp_path: Path
) -> None:
    """DEPLOY.md's openssl commands, run as written (bash, in an empty directory): the hub
    serves their certificate, a runner given ``ca.pem`` registers and polls, and a client with
    ``ca.pem`` added to its CAs (httpx ``verify=``) gets the hub's answer."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl on this machine")
    where = tmp_path / "pki"
    where.mkdir()
    with trio.fail_after(60):
        await trio.run_process(
            ["bash", "-e", "-c", deploy_tls_recipe()], cwd=where, capture_stdout=True
        )
    ca, cert, key = where / "ca.pem", where / "hub.crt", where / "hub.key"
    async with open_hub(Hub(admin_token=ADMIN), certfile=cert, keyfile=key) as (_, url):
        async with running(runner_config(url, sim.url, tmp_path / "s", ca_file=ca)) as runner:
            assert runner.registration is not None and runner.registration.server == url
        context = ssl.create_default_context()  # as DEPLOY.md says: the CA added
        context.load_verify_locations(str(ca))
        async with httpx.AsyncClient(verify=context) as http:
            assert (await http.get(url + "/healthz")).status_code in (200, 503)


async def test_doctor_says_a_bare_host_port_speaks_https(
    tls_hub: tuple[Hub, str, RequestLog], sim: Simulator, tmp_path: Path
) -> None:
    _, url, _ = tls_hub
    bare = url.removeprefix("https://")
    config = load_config(
        {"server": bare, "project": f"{OWNER}/{PROJECT}", "backend": [sim.url]}, {}
    )
    config = dataclasses.replace(config, state_dir=tmp_path / "state")
    found = {c.name: c for c in await diagnose(config)}
    assert found["Server"].mark == WARN
    assert f"http://{bare} speaks HTTPS at that port" in found["Server"].detail
    assert f"--server {url}" in (found["Server"].hint or "")
