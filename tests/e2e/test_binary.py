"""The frozen one-file executable itself (packaging/build.sh): version, demo, hub, sim, run and status.

Runs against ``$ALP_GATEWAY_BINARY`` (default ``dist/alp-gateway``) and is skipped when it is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from helpers import (
    ADMIN,
    BACKEND_KEY,
    OWNER,
    PROJECT,
    Turns,
    clean_env,
    open_chat,
    request_frame,
    runner_env,
    send,
)
from otlp_receiver import open_receiver

from gateway import __version__
from gateway.hub import Hub, open_hub
from gateway.sim import Simulator

ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("ALP_GATEWAY_BINARY") or ROOT / "dist" / "alp-gateway")

pytestmark = pytest.mark.skipif(
    not (BINARY.is_file() and os.access(BINARY, os.X_OK)),
    reason=f"no executable at {BINARY}: build it with packaging/build.sh (or set ALP_GATEWAY_BINARY)",
)


async def binary(*args: str, within: float = 60) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(within):
        return await trio.run_process(
            [str(BINARY), *args],
            env=clean_env(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


async def test_version() -> None:
    result = await binary("--version")
    assert result.returncode == 0
    assert result.stdout.decode().strip() == f"alp-gateway {__version__}"


async def test_demo_with_the_simulator() -> None:
    result = await binary("demo", "--sim")
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "tok0 tok1" in out and "time to first token" in out


def _x86_64() -> bool:
    with BINARY.open("rb") as f:
        header = f.read(20)
    return header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 62


def test_its_size_is_the_one_the_docs_state() -> None:
    """README.md and packaging/DEPLOY.md state the x86_64 binary's size (tests/test_docs.py holds
    them to one figure): within 1 MB of this binary's, in MB or MiB."""
    from test_docs import DEPLOY, README, stated_binary_sizes

    if not _x86_64():
        pytest.skip(f"{BINARY} is not an x86_64 ELF: the docs state the x86_64 binary's size")
    size = BINARY.stat().st_size
    for stated in stated_binary_sizes(README) + stated_binary_sizes(DEPLOY):
        assert min(abs(stated - size / 1e6), abs(stated - size / 2**20)) <= 1, (
            f"the docs say {stated} MB; {BINARY} is {size} bytes ({size / 1e6:.2f} MB): "
            "update README.md and packaging/DEPLOY.md"
        )


async def test_hub_and_sim_subcommands_are_inside() -> None:
    for command in ("hub", "sim"):
        result = await binary(command, "--help")
        assert result.returncode == 0 and f"alp-gateway {command}" in result.stdout.decode()


async def test_run_serves_a_turn_and_status_reads_it(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    proc = await trio.lowlevel.open_process(
        [
            str(BINARY),
            "run",
            "--project",
            f"{OWNER}/{PROJECT}",
            "--state-dir",
            str(tmp_path / "s"),
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        env=runner_env(hub[1], sim.url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    log = b""
    try:
        assert proc.stderr is not None
        with trio.fail_after(30):  # the runner says where its metrics server listens
            while (found := re.search(rb"health and metrics on (http://\S+)/healthz", log)) is None:
                data = await proc.stderr.receive_some(65536)
                assert data, f"the binary exited early: {log.decode()}"
                log += data
        url = found.group(1).decode()
        job, ch = await open_chat(hub[0], within=20)
        await send(ch, request_frame(job.id, "t", sim={"chunks": 3}))
        turns = Turns(ch)
        await turns.until("t")
        assert turns.last("t")["type"] == "chat.completion.done"
        result = await binary("status", "--metrics-url", url)
        out = result.stdout.decode()
        assert result.returncode == 0, out + result.stderr.decode()
        assert "healthy: ok" in out and "1 done" in out
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(20):
            while data := await proc.stderr.receive_some(65536):
                log += data
            assert await proc.wait() == 0, log.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert BACKEND_KEY.encode() not in log and ADMIN.encode() not in log


async def test_the_binary_traces(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path) -> None:
    """The OpenTelemetry SDK and exporter are inside: a turn's spans reach a real receiver."""
    async with open_receiver() as receiver:
        proc = await trio.lowlevel.open_process(
            [str(BINARY), "run", "--project", f"{OWNER}/{PROJECT}", "--state-dir", str(tmp_path)],
            env=runner_env(
                hub[1],
                sim.url,
                ALP_GATEWAY_OTLP_ENDPOINT=receiver.url,
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            job, ch = await open_chat(hub[0], within=30)
            await send(ch, request_frame(job.id, "t", sim={"chunks": 3}))
            await Turns(ch).until("t")
            proc.send_signal(signal.SIGTERM)  # the session ends; the exporter is flushed at exit
            with trio.fail_after(30):
                assert await proc.wait() == 0
                spans = await receiver.wait_for(2)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    names = sorted(s.name for s in spans)
    assert names == ["chat sim-model", "chat_llm session"]
    session = next(s for s in spans if s.name == "chat_llm session")
    turn = next(s for s in spans if s.name == "chat sim-model")
    assert turn.parent_span_id == session.span_id
    assert session.resource["service.name"] == "alp-gateway"
    sent = sim.requests[-1].headers["traceparent"].split("-")
    assert sent[:3] == ["00", turn.trace_id, turn.span_id]  # the flags: sampled (+ random)


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(
    not _can_unshare_mounts(), reason="needs `unshare -m` (root) to hide the system CAs"
)
async def test_finds_the_ca_bundle_of_another_distribution(tmp_path: Path) -> None:
    """The bundled libssl looks for CAs where the build machine keeps them (Debian: /usr/lib/ssl ->
    /etc/ssl/certs). In a mount namespace with those gone and the only bundle at Alpine's
    /etc/ssl/cert.pem, the binary's runtime hook still finds it and registers over TLS."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    cert, key, ca_pem = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_pem))
    script = (
        'mount -t tmpfs tmpfs /etc/ssl && cp "$CA" /etc/ssl/cert.pem && exec "$BINARY" register '
        '--server "$SERVER" --project "$PROJECT" --state-dir "$STATE"'
    )
    async with open_hub(Hub(admin_token=ADMIN), certfile=cert, keyfile=key) as (_hub, url):
        assert url.startswith("https://")
        env = {k: v for k, v in clean_env().items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
        env.update(
            CA=str(ca_pem),
            BINARY=str(BINARY),
            SERVER=url,
            PROJECT=f"{OWNER}/{PROJECT}",
            STATE=str(tmp_path / "state"),
            AGENTICS_USER_TOKEN=ADMIN,
        )
        with trio.fail_after(30):
            result = await trio.run_process(
                ["unshare", "-m", "sh", "-c", script],
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.startswith(b"registered runner ")


async def test_the_binary_hub_serves_its_status_page(tmp_path: Path) -> None:
    """The page's files are inside the binary (the spec's datas): / and its script and style."""
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                [str(BINARY), "hub", "--data", str(tmp_path / "hub"), "--listen", "127.0.0.1:0"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,  # its log lines; the test is over before a pipe fills
                env=clean_env(),
                check=False,
            )
        )
        try:
            assert proc.stderr is not None
            out = b""
            with trio.fail_after(60):
                while (found := re.search(rb"hub listening on (\S+)\n", out)) is None:
                    data = await proc.stderr.receive_some()
                    assert data, f"the hub exited: {out!r}"
                    out += data
            url = found.group(1).decode()
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                page = await client.get("/")
                assert page.status_code == 200 and b"ALP hub" in page.content
                assert "default-src 'self'" in page.headers["content-security-policy"]
                for asset in ("/page/app.js", "/page/style.css"):
                    assert (await client.get(asset)).status_code == 200, asset
                assert (await client.get("/metrics")).status_code == 401
        finally:
            proc.terminate()


async def test_the_binary_hub_keeps_its_store_on_postgresql(tmp_path: Path) -> None:
    """No libpq is inside the binary (issue 37 point 8): a hub given ``--store postgresql://``
    loads the system's (Debian's libpq5) through psycopg's pure-Python layer, migrates the store
    and answers for it (``hub doctor`` connects, finds the schema current)."""
    import pgserver

    server = pgserver.start_or_skip()
    try:
        url = server.database()
        hub = ("hub", "--data", str(tmp_path / "hub"), "--store", url)
        made = await binary(*hub, "keys", "create", "--create", "pg-binary")
        assert made.returncode == 0, (made.stdout + made.stderr).decode()
        migrated = await binary(*hub, "doctor")
        out = (migrated.stdout + migrated.stderr).decode()
        assert migrated.returncode == 0, out
        assert url.split("@")[0].split(":")[-1] not in out  # the password never shown
    finally:
        server.destroy()


def _stated_unpacked_mb() -> list[float]:
    """Every 'unpacks N MB' DEPLOY.md states for the x86_64 binary's unpacked directory."""
    text = (ROOT / "packaging" / "DEPLOY.md").read_text()
    return [
        float(m)
        for m in re.findall(r"unpacked at each start into `\$TMPDIR` \| (\d+(?:\.\d+)?) MB", text)
    ]


async def test_what_it_unpacks_is_what_the_docs_state(tmp_path: Path) -> None:
    """DEPLOY.md states what each process unpacks into $TMPDIR (a container's /tmp is sized for
    two): within 2 MB of what this binary unpacks, measured while its hub runs."""
    stated = _stated_unpacked_mb()
    assert len(stated) == 1, stated
    if not _x86_64():
        pytest.skip(f"{BINARY} is not an x86_64 ELF: the docs state the x86_64 binary's figures")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                [str(BINARY), "hub", "--data", str(tmp_path / "hub"), "--listen", "127.0.0.1:0"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=clean_env(TMPDIR=str(tmp)),
                check=False,
            )
        )
        try:
            assert proc.stderr is not None
            out = b""
            with trio.fail_after(60):
                while b"hub listening on" not in out:
                    data = await proc.stderr.receive_some()
                    assert data, f"the hub exited: {out!r}"
                    out += data
            (unpacked,) = tmp.glob("_MEI*")
            size = sum(f.stat().st_size for f in unpacked.rglob("*") if f.is_file())
            assert not [f for f in unpacked.rglob("libpq*")], "a libpq was unpacked"
            assert abs(size / 1e6 - stated[0]) <= 2, (
                f"DEPLOY.md says it unpacks {stated[0]} MB; this binary unpacked {size / 1e6:.1f} MB"
            )
        finally:
            proc.terminate()
