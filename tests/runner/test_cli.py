"""The installed ``alp-gateway`` command as a subprocess: register, run, signals, one-line errors."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import trio
from faultproxy import fault_proxy
from helpers import (
    ADMIN,
    BACKEND_KEY,
    EXE,
    OWNER,
    PROJECT,
    LogCapture,
    RecordingProxy,
    Turns,
    clean_env,
    open_chat,
    request_frame,
    runner_config,
    runner_env,
    running,
    send,
)

from gateway.hub import Hub, open_hub
from gateway.runner.session import RUNNER_STOPPED
from gateway.runner.state import StateStore
from gateway.runner.supervisor import Runner, RunnerExit
from gateway.sim import Simulator


async def cli(*args: str, **extra_env: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [EXE, *args],
        env=clean_env(**extra_env),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_version() -> None:
    result = await cli("--version")
    assert result.returncode == 0 and result.stdout.startswith(b"alp-gateway ")


async def test_help_points_only_at_what_every_install_has() -> None:
    """``--config``'s help says how a setting is written in the file instead of naming
    ``config/*.example.toml``, which pip and binary installs lack (issue 31, point 9's kin)."""
    for command in (("run",), ("hub",), ("doctor",)):
        result = await cli(*command, "--help")
        text = result.stdout.decode()
        assert result.returncode == 0 and "--config FILE" in text, text
        assert "example.toml" not in text, command
        assert "with underscores" in " ".join(text.split()), command


async def test_register_saves_owner_only_state(hub: tuple[Hub, str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = await cli(
        "register",
        "--server",
        hub[1],
        "--project",
        f"{OWNER}/{PROJECT}",
        "--state-dir",
        str(state),
        "--name",
        "box1",
        "--labels",
        "gpu,linux",
        AGENTICS_USER_TOKEN=ADMIN,
    )
    assert result.returncode == 0, result.stderr
    (saved,) = json.loads((state / "registration.json").read_text())["registrations"]
    assert saved["name"] == "box1" and saved["server"] == hub[1] and saved["token"]
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "registration.json").stat().st_mode) == 0o600
    assert saved["token"].encode() not in result.stdout + result.stderr


async def test_register_falls_back_to_spec_path(tmp_path: Path) -> None:
    async with open_hub(Hub(admin_token=ADMIN, register_paths=("runners/register",))) as (_, url):
        result = await cli(
            "register",
            "--server",
            url,
            "--project",
            "o/p",
            "--state-dir",
            str(tmp_path),
            "--user-token",
            ADMIN,
        )
    assert result.returncode == 0, result.stderr


async def test_register_refused_is_one_line(hub: tuple[Hub, str], tmp_path: Path) -> None:
    result = await cli(
        "register",
        "--server",
        hub[1],
        "--project",
        "o/p",
        "--state-dir",
        str(tmp_path),
        AGENTICS_USER_TOKEN="wrong",
    )
    assert result.returncode != 0
    err = result.stderr.decode().strip()
    assert "user credential" in err and "\n" not in err and "Traceback" not in err


async def test_run_without_registration_says_what_to_do(tmp_path: Path) -> None:
    result = await cli(
        "run",
        "--server",
        "127.0.0.1:9",
        "--project",
        "o/p",
        "--state-dir",
        str(tmp_path),
        "--backend",
        "http://127.0.0.1:9/v1",
    )
    assert result.returncode == 2
    err = result.stderr.decode().strip()
    assert "alp-gateway register" in err and "\n" not in err


async def test_invalid_setting_is_one_line(tmp_path: Path) -> None:
    result = await cli("run", "--project", "o/p", "--poll-interval", "-3")
    err = result.stderr.decode().strip()
    assert result.returncode == 2 and "poll-interval" in err and "\n" not in err
    result = await cli("run", "--project", "o/p", CHAT_LLM_BACKEND_URL="not a url")
    err = result.stderr.decode().strip()
    assert result.returncode == 2 and "CHAT_LLM_BACKEND_URL" in err and "\n" not in err


async def test_run_serves_then_sigterm_drains(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
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
                "--log-level",
                "DEBUG",
            ],
            env=runner_env(hub[1], sim.url),
            stdout=log,
            stderr=log,
        )
        try:
            job, ch = await open_chat(hub[0], within=20)
            await send(ch, request_frame(job.id, "t", sim={"chunks": 8, "interval": 0.05}))
            stream = await sim.wait_for_streams(1)
            await stream.wait_sent(2)
            proc.send_signal(signal.SIGTERM)
            # an echo (as a binary's launcher forwards it): still graceful
            proc.send_signal(signal.SIGTERM)
            turns = Turns(ch)
            with trio.fail_after(15):
                while not turns.other:
                    await turns.next()
            with trio.fail_after(15):
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    assert code == 0
    assert turns.last("t")["type"] == "chat.completion.done"
    assert turns.other[0]["reason"] == "runner shutting down"
    finals = [r for r in job.reports if r.get("status") == "completed"]
    assert len(finals) == 1 and finals[0]["conclusion"] == "success"
    text = log_path.read_text()
    assert "session start" in text and "session end" in text
    for secret in (BACKEND_KEY, ADMIN):
        assert secret not in text
    saved = json.loads((tmp_path / "s" / "registration.json").read_text())["registrations"]
    assert all(reg["token"] not in text for reg in saved)


async def test_a_second_run_on_a_live_runner_s_state_dir_is_refused_in_one_line(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """Issue 36 point 5: a second ``run`` (another backend) on the registration a live runner
    uses is refused at once, naming ``--state-dir``, and the first runs on; once the first is
    SIGKILLed, the kernel has let go of its lock and a new runner takes the directory."""
    state = tmp_path / "s"
    argv = [EXE, "run", "--project", f"{OWNER}/{PROJECT}", "--state-dir", str(state)]
    log_path = tmp_path / "runner.log"
    with log_path.open("wb") as log:
        first = await trio.lowlevel.open_process(
            argv, env=runner_env(hub[1], sim.url), stdout=log, stderr=log
        )
        try:
            await open_chat(hub[0], within=20)  # the first runner serves
            with trio.fail_after(30):
                second = await trio.run_process(
                    [*argv, "--backend", "http://127.0.0.1:9/v1"],
                    env=runner_env(hub[1], sim.url),
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            err = second.stderr.decode().strip()
            assert second.returncode == 2, err
            assert "--state-dir" in err and f"pid {first.pid}" in err and "\n" not in err, err
            assert "Traceback" not in err
            assert first.returncode is None  # the first runs on
            first.kill()
            await first.wait()
            third = await trio.lowlevel.open_process(
                argv, env=runner_env(hub[1], sim.url), stdout=log, stderr=log
            )
            try:
                await open_chat(hub[0], within=20)  # a killed runner's lock is gone with it
            finally:
                third.kill()
                await third.wait()
        finally:
            if first.returncode is None:
                first.kill()
                await first.wait()
    (saved,) = json.loads((state / "registration.json").read_text())["registrations"]
    assert saved["token"] not in err
    assert stat.S_IMODE((state / "runner.lock").stat().st_mode) == 0o600


async def test_revoked_token_exits_without_user_credential(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with fault_proxy(hub[1]) as proxy:  # the Server refuses the token on poll
        config = runner_config(proxy.url, sim.url, tmp_path)
        first = Runner(config)
        await first.register()
        proxy.faults["poll"] = [401]
        runner = Runner(runner_config(proxy.url, sim.url, tmp_path, user_token=None))
        try:
            with trio.fail_after(10):
                await runner.run()
        except RunnerExit as exc:
            assert exc.code == 3 and "refused the runner token" in str(exc)
        else:
            raise AssertionError("the runner went on with a refused token")


async def test_revoked_token_reregisters_with_user_credential(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    async with fault_proxy(hub[1]) as proxy, trio.open_nursery() as nursery:
        runner = Runner(runner_config(proxy.url, sim.url, tmp_path))
        nursery.start_soon(runner.run)
        with trio.fail_after(10):
            await runner.first_poll.wait()
        old = runner.registration
        proxy.faults["poll"] = [401]  # the Server refuses the token once
        runner._wake.set()
        with trio.fail_after(10):
            await runner.counters.wait("polls", runner.counters.get("polls") + 2)
        assert runner.registration is not old
        await open_chat(hub[0])
        nursery.cancel_scope.cancel()


async def test_a_refused_token_registers_again_at_the_server_it_polls(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """The saved registration names the Server; the configured one (not given explicitly, like
    the default agentics.dk) is another: registering again goes to the saved one."""
    async with fault_proxy(hub[1]) as proxy, trio.open_nursery() as nursery:
        await Runner(runner_config(proxy.url, sim.url, tmp_path)).register(wait_for_server=False)
        elsewhere = runner_config("http://127.0.0.1:9", sim.url, tmp_path, server_explicit=False)
        runner = Runner(elsewhere)
        nursery.start_soon(runner.run)
        with trio.fail_after(10):
            await runner.first_poll.wait()
        old = runner.registration
        proxy.faults["poll"] = [401]
        runner._wake.set()
        with trio.fail_after(10):
            await runner.counters.wait("polls", runner.counters.get("polls") + 2)
        assert runner.registration is not old and runner.registration is not None
        assert runner.registration.server == proxy.url
        assert runner.counters.get("registration_errors") == 0
        nursery.cancel_scope.cancel()


async def test_a_runner_token_goes_only_to_the_server_that_issued_it(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """Issue 31 point 5: the same project run against a second Server (behind a recording
    proxy: what that Server received) registers anew there with the user credential, or says in
    one line that it needs one; the first Server's token never reaches it, and the first
    registration is kept and used again at the first Server."""
    project = f"{OWNER}/{PROJECT}"
    first = await Runner(runner_config(hub[1], sim.url, tmp_path)).register(wait_for_server=False)
    async with open_hub(Hub(admin_token=ADMIN)) as (other, other_url), trio.open_nursery() as n:
        proxy: RecordingProxy = await n.start(
            RecordingProxy(int(other_url.rsplit(":", 1)[1])).serve
        )
        second = f"http://127.0.0.1:{proxy.port}"
        without = Runner(runner_config(second, sim.url, tmp_path, user_token=None))
        with pytest.raises(RunnerExit) as refused:
            await without.run()
        said = str(refused.value)
        assert refused.value.code == 2 and "\n" not in said
        assert said.startswith(f"no registration for {project} on {second} (registered on {hub[1]}")
        assert "user credential" in said and first.token not in said
        assert proxy.connections == []  # nothing at all went to the second Server
        async with running(runner_config(second, sim.url, tmp_path)) as runner:
            assert runner.registration is not None
            assert runner.registration.server == second and runner.registration.token != first.token
            await open_chat(other)  # it serves the second Server
        n.cancel_scope.cancel()
    received = proxy.received()
    assert b"/runners/jobs" in received and runner.registration.token.encode() in received
    assert first.token.encode() not in received
    store = StateStore(tmp_path)
    assert store.load(hub[1], project) == first  # kept as it was
    assert store.load(second, project) == runner.registration
    async with running(runner_config(hub[1], sim.url, tmp_path)) as again:
        assert again.registration == first  # the first Server's, not registered anew


async def test_second_signal_stops_at_once(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
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
                "60",
            ],
            env=runner_env(hub[1], sim.url),
            stdout=log,
            stderr=log,
        )
    try:
        with trio.fail_after(20):
            job, ch = await open_chat(hub[0], within=20)
            for rid in ("long", "long2"):
                slow = {"chunks": 1000, "interval": 0.05}
                await send(ch, request_frame(job.id, rid, sim=slow))
            streams = [await sim.wait_for_streams(n) for n in (1, 2)]
            for stream in streams:
                await stream.wait_sent(2)
        proc.send_signal(signal.SIGTERM)  # graceful: would wait up to 60 s for the turns
        turns = Turns(ch)
        with trio.fail_after(10):
            seen = len(turns.chunks("long"))
            while len(turns.chunks("long")) < seen + 3:  # still relaying after the first signal
                await turns.next()
        proc.send_signal(signal.SIGINT)
        # issue 31 point 12: each turn in flight is told the runner stopped, then the channel
        # ends with chat.end (the hub's client used to read that the channel was lost)
        with trio.fail_after(10):
            while not (turns.finished("long") and turns.finished("long2") and turns.other):
                await turns.next()
        with trio.fail_after(10):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    assert code == 130, log_path.read_text()
    for rid in ("long", "long2"):
        last = turns.last(rid)
        assert last["type"] == "chat.completion.error", last
        assert last["error"] == RUNNER_STOPPED and "stopped" in last["error"]
    assert [f["type"] for f in turns.other] == ["chat.end"]
    with trio.fail_after(5):
        for stream in streams:
            await stream.finished.wait()
    assert all(stream.client_closed for stream in streams)


async def test_sigterm_while_the_server_is_unreachable(tmp_path: Path) -> None:
    proc = await trio.lowlevel.open_process(
        [
            EXE,
            "run",
            "--project",
            "o/p",
            "--server",
            "127.0.0.1:9",
            "--state-dir",
            str(tmp_path),
            "--backend",
            "http://127.0.0.1:9/v1",
            "--user-token",
            "u",
        ],
        env=clean_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        with trio.fail_after(10):
            await proc.stderr.receive_some()  # it has started and logged its first failed attempt
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    assert code == 0


async def test_a_ca_file_that_is_missing_or_not_pem_is_one_line(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("this is not a certificate\n")
    common = ["--project", "o/p", "--state-dir", str(tmp_path / "s"), "--user-token", "u"]
    backend = ["--backend", "http://127.0.0.1:9/v1"]
    for ca, says in ((tmp_path / "missing.pem", "does not exist"), (not_pem, "no PEM certificate")):
        for command in (["run", *backend], ["register"]):
            result = await cli(*command, *common, "--ca-file", str(ca))
            err = result.stderr.decode().strip()
            assert result.returncode == 2, err
            assert err.startswith("alp-gateway: --ca-file") and says in err, err
            assert "\n" not in err and "Traceback" not in err
        result = await cli("doctor", *common, *backend, "--ca-file", str(ca))
        out = result.stdout.decode()
        assert result.returncode == 1 and "Traceback" not in result.stderr.decode()
        assert f"--ca-file: invalid value '{ca}': {ca}" in out and says in out, out


async def test_an_unknown_log_level_is_refused(tmp_path: Path) -> None:
    args = ["--project", "o/p", "--state-dir", str(tmp_path), "--backend", "http://127.0.0.1:9/v1"]
    result = await cli("run", *args, "--log-level", "verbose")
    err = result.stderr.decode().strip()
    assert result.returncode == 2 and "\n" not in err, err
    assert err == (
        "alp-gateway: --log-level: invalid value 'verbose': "
        "not a log level: use DEBUG, INFO, WARNING, ERROR"
    )
    result = await cli("run", *args, ALP_GATEWAY_LOG_LEVEL="loud")
    assert (
        result.returncode == 2 and b"ALP_GATEWAY_LOG_LEVEL: invalid value 'loud'" in result.stderr
    )


async def _free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _register_to(server: str, tmp_path: Path, token: str = ADMIN) -> tuple[int, str]:
    result = await cli(
        "register",
        *("--server", server, "--project", "o/p", "--state-dir", str(tmp_path)),
        AGENTICS_USER_TOKEN=token,
    )
    err = result.stderr.decode().strip()
    assert "\n" not in err and "Traceback" not in err, err
    return result.returncode, err


async def test_registration_errors_point_the_right_way(
    hub: tuple[Hub, str], tmp_path: Path
) -> None:
    url = hub[1]
    code, err = await _register_to(f"{url}/v1", tmp_path)
    assert code == 2 and "answered 404" in err, err
    assert f"POST {url}/v1/api/owners/o/projects/p/runners and POST " in err, err
    assert f"has a path (/v1): give the Server's root, --server {url} (without /v1" in err, err

    port = await _free_port()
    code, err = await _register_to(f"http://127.0.0.1:{port}", tmp_path)
    assert code == 1, err
    assert err.endswith(f"connection refused by 127.0.0.1:{port}: nothing listens there"), err
    assert "sub-exception" not in err and err.count("attempts") == 0, err

    code, err = await _register_to("http://no-such-host.invalid", tmp_path)
    assert code == 1 and "cannot resolve the host name 'no-such-host.invalid' (" in err, err
    assert "[Errno" not in err, err

    tls = "https://" + url.removeprefix("http://")
    code, err = await _register_to(tls, tmp_path)
    assert code == 2, err
    assert (
        err
        == f"alp-gateway: {tls}: the Server does not speak TLS: use {url} (http://, not https://)"
    )

    code, err = await _register_to(url, tmp_path, token="not-the-admin-token")
    assert code == 2 and "does not accept the user credential" in err, err
    assert "runner token" not in err, err
    code, err = await _register_to(url, tmp_path, token="alpr_a-runner-token")
    assert code == 2 and "the credential given is a runner token (alpr_…)" in err, err


async def test_run_waits_for_a_server_that_refuses_connections(
    tmp_path: Path, logs: LogCapture
) -> None:
    """``run`` registers against a Server that is not up yet (compose, Kubernetes): it retries,
    one clean line when the reason changes, until the Server answers or it is stopped."""
    port = await _free_port()
    runner = Runner(runner_config(f"http://127.0.0.1:{port}", None, tmp_path))
    stopped: list[RunnerExit] = []

    async def register() -> None:
        try:
            await runner.register()
        except RunnerExit as exc:
            stopped.append(exc)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(register)
            await runner.counters.wait("registration_errors", 2)
            runner.begin_shutdown()
    assert [(str(e), e.code) for e in stopped] == [("stopped before the runner could register", 0)]
    warned = [line for line in logs.lines if line.startswith("registration:")]
    assert warned[0] == (
        f"registration: POST http://127.0.0.1:{port}/api/owners/{OWNER}/projects/{PROJECT}/"
        f"runners: connection refused by 127.0.0.1:{port}: nothing listens there; "
        f"attempt 1, retrying in {warned[0].rsplit(' ', 2)[1]} s"
    ), warned


async def test_no_project_names_the_environment_variable(tmp_path: Path) -> None:
    for command in ("run", "register"):
        result = await cli(command, "--state-dir", str(tmp_path))
        err = result.stderr.decode().strip()
        assert result.returncode == 2 and err == (
            "alp-gateway: no project: give --project OWNER/PROJECT, or set ALP_PROJECT or "
            "AGENTICS_PROJECT in the environment (or project = in the config file)"
        ), err


async def test_a_stop_gives_up_final_reports_after_a_short_grace(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """The Server is gone (every job status answers 503) when SIGTERM ends a session: its final
    report is retried for a short grace only (it used to be ~15 s, or a second signal), and the
    stop says so in one WARNING line, with no ERROR line."""
    async with fault_proxy(hub[1]) as proxy:
        proxy.faults["status"] = [503] * 100
        log_path = tmp_path / "runner.log"
        with log_path.open("wb") as log:
            proc = await trio.lowlevel.open_process(
                [EXE, "run", "--project", f"{OWNER}/{PROJECT}", "--state-dir", str(tmp_path)],
                env=runner_env(proxy.url, sim.url),
                stdout=log,
                stderr=log,
            )
        try:
            with trio.fail_after(20):
                job, _ = await open_chat(hub[0], within=20)
                await proxy.wait_hits("status", 1)  # in_progress, refused
            proc.send_signal(signal.SIGTERM)  # the idle session ends; its report is retried
            with trio.fail_after(10):  # a hang guard: the grace is 1 s (the remaining
                code = await proc.wait()  # attempts' backoff alone is over 10 s)
        finally:
            if proc.returncode is None:
                proc.kill()
    text = log_path.read_text()
    assert code == 0, text
    assert len([h for h in proxy.hits if h.route == "status"]) >= 2  # the report was tried
    said = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    stop = [line for line in said if "stopped without the final report" in line]
    assert len(stop) == 1 and f"of 1 job(s) ({job.id})" in stop[0], said
    assert "Server answered 503" in stop[0]
    assert not [line for line in said if " ERROR " in line], said


async def test_a_mistyped_hub_flag_is_named_not_taken_for_a_command(tmp_path: Path) -> None:
    """Issue 31, point 4: argparse took the value after an unknown flag for a command's name
    (``invalid choice: '127.0.0.1:9999' (choose from 'keys', 'usage')``)."""
    data = tmp_path / "hub"
    for args, said in [
        (("--listn", "127.0.0.1:9999"), "unknown flag --listn (did you mean --listen?)"),
        (("--port", "9999"), "unknown flag --port (did you mean --listen HOST:PORT?)"),
        (("keys", "list", "--dta", "x"), "unknown flag --dta of `alp-gateway hub keys list`"),
        (
            ("serve",),
            "'serve' is not a command of `alp-gateway hub`"
            " (keys, usage, backup, restore, runners, prices, doctor)",
        ),
    ]:
        result = await cli("hub", *args, "--data", str(data))
        err = result.stderr.decode()
        assert result.returncode == 2 and err.startswith(f"alp-gateway hub: error: {said}"), err
        assert err.count("\n") == 1 and "invalid choice" not in err
    assert not data.exists()


async def test_a_postgresql_store_without_libpq_says_how_to_get_one() -> None:
    """psycopg is the pure-Python package (no libpq in the wheel or the one-file binary): with no
    libpq it can load (PSYCOPG_IMPL naming one that is not installed stands for a machine without
    libpq5), a hub on PostgreSQL says in one line how to get one, never the URL's password."""
    url = "postgresql://alp:not-this-password@127.0.0.1:1/alp"
    for command in (["hub", "--store", url, "doctor"], ["hub", "--store", url]):
        result = await cli(*command, PSYCOPG_IMPL="c")
        err = (result.stdout + result.stderr).decode()
        assert result.returncode != 0, err
        assert "apt-get install libpq5" in err and "alp-gateway[postgresql-binary]" in err, err
        assert "Traceback" not in err and "not-this-password" not in err, err
