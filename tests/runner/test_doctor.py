"""``alp-gateway doctor`` against a real hub and simulators on loopback: healthy and broken setups."""

from __future__ import annotations

import io
import json
import logging
import textwrap
import tomllib
from pathlib import Path

import pytest
import trio
from helpers import ADMIN, BACKEND_KEY, EXE, OWNER, PROJECT, clean_env, runner_config, running

from gateway.config import BackendSpec, load_config
from gateway.hub import Hub
from gateway.ops import doctor
from gateway.ops.doctor import FAIL, OK, WARN, Check, diagnose, render, run_doctor
from gateway.runner.state import SavedRegistration, StateStore
from gateway.runner.supervisor import Runner
from gateway.sim import Simulator, open_sim


def table(checks: list[Check]) -> str:
    out = io.StringIO()
    render(checks, out)
    return out.getvalue()


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name.strip(): c for c in checks}


async def dead_port() -> int:
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_healthy_setup(hub: tuple[Hub, str], sim: Simulator, tmp_path: Path) -> None:
    config = runner_config(hub[1], sim.url, tmp_path / "state")
    reg = await Runner(config).register()
    checks = await diagnose(config, deep=True)
    text = table(checks)
    assert [c.mark for c in checks] == [OK] * len(checks), text
    found = by_name(checks)
    assert set(found) == {
        "configuration",
        "state file",
        "Server",
        "backend default",
        "default completion",
        "models",
    }
    assert "runner token accepted" in found["Server"].detail
    assert "models: sim-model" in found["backend default"].detail
    assert "one-token completion from sim-model in" in found["default completion"].detail
    assert "All required checks passed." in text
    deep = json.loads(sim.streams[-1].body)
    assert deep["max_tokens"] == 1 and deep["stream"] is False and deep["model"] == "sim-model"
    for secret in (BACKEND_KEY, ADMIN, reg.token):
        assert secret not in text
    assert await hub[0].board.all_jobs.count() == 0 or all(
        j.claimed_by is None for j in await hub[0].board.all_jobs.values()
    )


async def test_broken_setup_names_each_fault_and_its_fix(tmp_path: Path) -> None:
    async with open_sim(require_key="sk-right-key-1234", models=["qwen2.5:7b"]) as sim:
        state = tmp_path / "state"
        StateStore(state).save(
            SavedRegistration("r-1", "box", "tok-secret-5678", "http://x", OWNER, PROJECT)
        )
        (state / "registration.json").chmod(0o644)
        toml = tmp_path / "gw.toml"
        toml.write_text(
            f'server = "http://127.0.0.1:{await dead_port()}"\nproject = "{OWNER}/{PROJECT}"\n'
            f'state_dir = "{state}"\nmodel = "mistral:7b"\n'
            f'[[backend]]\nname = "gpu"\nurl = "{sim.url}"\nkey = "sk-wrong-key-0000"\n'
            f'[[backend]]\nname = "ollama"\nurl = "http://127.0.0.1:{await dead_port()}/v1"\n'
        )
        out = io.StringIO()
        code = await trio.to_thread.run_sync(lambda: run_doctor({}, {}, toml, out=out))
    text = out.getvalue()
    assert code == 1, text
    lines = text.splitlines()

    def row(name: str) -> str:
        return next(line for line in lines if line.strip().startswith(f"{FAIL}  {name}"))

    def hint_after(name: str) -> str:
        return lines[lines.index(row(name)) + 1]

    assert "mode 644" in row("state file") and "chmod 600" in hint_after("state file")
    assert "unreachable" in row("Server") and "--server" in hint_after("Server")
    assert "401" in row("backend gpu") and "key" in hint_after("backend gpu")
    assert "unreachable" in row("backend ollama") and "is the model server running" in hint_after(
        "backend ollama"
    )
    assert "no backend is up" in row("models")
    assert "5 required checks failed." in text
    for secret in ("sk-wrong-key-0000", "tok-secret-5678"):
        assert secret not in text


async def test_refused_token_and_unserved_default_model(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    StateStore(state).save(
        SavedRegistration("r-1", "box", "not-a-token-9999", hub[1], OWNER, PROJECT)
    )
    config = runner_config(
        hub[1],
        sim.url,
        state,
        model="mistral:7b",
        aliases={"gpt-4o": "llama3"},
        allowed_models=("sim-model", "phi3"),
    )
    checks = by_name(await diagnose(config))
    assert checks["Server"].mark == FAIL and "refused the runner token" in checks["Server"].detail
    assert "alp-gateway register" in (checks["Server"].hint or "")
    assert checks["default model"].mark == FAIL and "sim-model" in (
        checks["default model"].hint or ""
    )
    assert checks["aliases"].mark == WARN and "gpt-4o → llama3" in checks["aliases"].detail
    assert checks["allowlist"].mark == WARN and "phi3" in checks["allowlist"].detail
    assert checks["backend default"].mark == OK


async def test_unregistered_with_a_user_credential_is_only_a_warning(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    checks = by_name(await diagnose(runner_config(hub[1], sim.url, tmp_path / "fresh")))
    assert (
        checks["state file"].mark == WARN
        and "registers with the user credential" in checks["state file"].detail
    )
    assert checks["Server"].mark == OK and "not registered yet" in checks["Server"].detail
    no_user = runner_config(hub[1], sim.url, tmp_path / "fresh", user_token=None)
    checks = by_name(await diagnose(no_user))
    assert checks["state file"].mark == FAIL and "alp-gateway register" in (
        checks["state file"].hint or ""
    )


async def test_backend_without_model_list_and_declared_models(
    hub: tuple[Hub, str], tmp_path: Path
) -> None:
    async with open_sim(models=["a"]) as sim:
        specs = (BackendSpec("gpu", sim.url, models=("a", "b")),)
        config = runner_config(hub[1], None, tmp_path, backends=specs, model="a")
        checks = by_name(await diagnose(config))
    assert (
        checks["backend gpu"].mark == WARN
        and "declared but not listed: b" in checks["backend gpu"].detail
    )


async def test_no_backend_points_at_a_local_server(
    hub: tuple[Hub, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def found() -> list[tuple[str, str, list[str]]]:
        return [("Ollama", "http://127.0.0.1:11434/v1", ["qwen2.5:7b"])]

    monkeypatch.setattr(doctor, "discover_local", found)
    checks = by_name(await diagnose(runner_config(hub[1], None, tmp_path)))
    backend = checks["backend"]
    assert backend.mark == FAIL and "found Ollama at http://127.0.0.1:11434/v1" in backend.detail
    assert "--backend http://127.0.0.1:11434/v1" in (backend.hint or "")
    assert tomllib.loads(backend.snippet or "") == {
        "backend": [{"name": "ollama", "url": "http://127.0.0.1:11434/v1"}]
    }


@pytest.mark.parametrize(
    ("kind", "url", "name"),
    [
        ("alp-gateway sim", "http://127.0.0.1:8789/v1", "sim"),
        ("LM Studio", "http://127.0.0.1:1234/v1", "lm-studio"),
        ("llama.cpp", "http://127.0.0.1:8080/v1", "llama-cpp"),
    ],
)
async def test_no_backend_suggests_a_table_that_parses_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, url: str, name: str
) -> None:
    """Issue 31 point 9: the suggested ``[[backend]]`` table is TOML that parses (it was one
    line, and named ``alp-gatewaysim``), loads as the runner's configuration, and is printed
    whole: no pointer to ``config/alp-gateway.example.toml``, which pip and binary installs lack."""

    async def found() -> list[tuple[str, str, list[str]]]:
        return [(kind, url, ["m"])]

    monkeypatch.setattr(doctor, "discover_local", found)
    port = await dead_port()
    checks = await diagnose(runner_config(f"http://127.0.0.1:{port}", None, tmp_path))
    text = table(checks)
    lines = text.splitlines()
    hint = next(i for i, line in enumerate(lines) if "this table in a config file" in line)
    shown = textwrap.dedent("\n".join(lines[hint + 1 : hint + 4]))  # as printed, under the hint
    assert tomllib.loads(shown) == {"backend": [{"name": name, "url": url}]}
    config_file = tmp_path / "gateway.toml"
    config_file.write_text(shown)
    (backend,) = load_config({"project": "o/p"}, {}, config_file).backends
    assert (backend.name, backend.url) == (name, url)
    assert "example.toml" not in text


async def test_a_bad_setting_points_at_the_help_every_install_has(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_doctor({"project": "o/p", "poll_interval": "-3"}, {}, None, out=out) == 1
    assert "`alp-gateway run --help` lists every one" in out.getvalue()
    assert "example.toml" not in out.getvalue()


async def test_cli_exit_codes(tmp_path: Path) -> None:
    env = clean_env()
    port = await dead_port()
    bad = await trio.run_process(
        [
            EXE,
            "doctor",
            "--project",
            "o/p",
            "--state-dir",
            str(tmp_path),
            "--server",
            f"http://127.0.0.1:{port}",
            "--backend",
            f"http://127.0.0.1:{port}/v1",
        ],
        env=env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out = bad.stdout.decode()
    assert bad.returncode == 1, out + bad.stderr.decode()
    assert out.startswith("alp-gateway doctor") and f"{FAIL}  Server" in out and "→ " in out
    toml = tmp_path / "c.toml"
    toml.write_text('[[backend]]\nname = "gpu"\n')
    broken = await trio.run_process(
        [EXE, "doctor", "--config", str(toml)],
        env=env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert broken.returncode == 1 and "missing url" in broken.stdout.decode()


async def test_a_backend_url_without_v1_fails_and_says_did_you_mean(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    assert sim.url.endswith("/v1")
    plain = sim.url.removesuffix("/v1")  # as Ollama's http://127.0.0.1:11434 is given
    checks = await diagnose(runner_config(hub[1], plain, tmp_path / "state"))
    backend = by_name(checks)["backend default"]
    assert backend.mark == FAIL, table(checks)
    assert backend.detail == (
        f"{plain}/models answered 404, but {sim.url}/models lists models: did you mean {sim.url}?"
    )
    assert "1 required check failed" in table(checks)
    # the right URL still passes
    checks = await diagnose(runner_config(hub[1], sim.url, tmp_path / "state"))
    assert by_name(checks)["backend default"].mark == OK, table(checks)


async def test_run_says_at_start_what_doctor_says_of_a_url_without_v1(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """Issue 31 point 3: ``run --backend http://host:8789`` (no ``/v1``) used to look healthy
    and fail every turn; it says at start, in one WARNING line, doctor's words."""
    plain = sim.url.removesuffix("/v1")
    config = runner_config(hub[1], plain, tmp_path / "state")
    said: list[str] = []
    heard = trio.Event()

    class Hear(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING and "/v1" in record.getMessage():
                said.append(record.getMessage())
                heard.set()

    hear = Hear()
    logging.getLogger().addHandler(hear)
    try:
        async with running(config):
            with trio.fail_after(10):
                await heard.wait()
    finally:
        logging.getLogger().removeHandler(hear)
    backend = by_name(await diagnose(config))["backend default"]
    assert said == [f"backend default: {backend.detail} ({backend.hint})"]
    assert f"did you mean {sim.url}?" in said[0] and "--backend / CHAT_LLM_BACKEND_URL" in said[0]


async def test_an_unreachable_server_is_one_clean_reason(sim: Simulator, tmp_path: Path) -> None:
    port = await dead_port()
    server = f"http://127.0.0.1:{port}"
    checks = by_name(await diagnose(runner_config(server, sim.url, tmp_path / "fresh")))
    assert checks["Server"].mark == FAIL
    assert checks["Server"].detail == (
        f"{server} unreachable: connection refused by 127.0.0.1:{port}: nothing listens there"
    )


def test_the_table_prints_what_servers_and_backends_said_escaped() -> None:
    """Issue 30, row 6: a check's detail quotes a Server's or a backend's answer (a model name, an
    error body); the terminal gets it escaped, and each check stays one line (plus its hint)."""
    out = table(
        [
            Check(OK, "backend", "serving evil\x1b]0;pwned\x07\r\n  ✓  forged"),
            Check(FAIL, "server", "said \x1b[2J", "fix\x1b[31m it"),
        ]
    )
    lines = out.split("\n")
    assert all(line.isprintable() for line in lines), out
    assert "serving evil\\x1b]0;pwned\\x07\\r\\n  ✓  forged" in lines[0]
    assert lines[1].endswith("said \\x1b[2J") and lines[2].endswith("→ fix\\x1b[31m it")


def test_a_registration_on_another_server_is_not_this_ones(tmp_path: Path) -> None:
    """Issue 31 point 5: doctor picks the registration as ``run`` does, per Server and project."""
    state = tmp_path / "state"
    StateStore(state).save(
        SavedRegistration("r-1", "box", "tok-elsewhere", "http://first:8787", OWNER, PROJECT)
    )
    check = doctor.Doctor(runner_config("http://second:8787", None, state, user_token=None))
    assert check.check_state() is None
    (line,) = check.checks
    assert line.mark == FAIL
    assert f"no registration for {OWNER}/{PROJECT} on http://second:8787 (registered on " in (
        line.detail
    )
    assert "--server http://second:8787" in (line.hint or "")
    assert "tok-elsewhere" not in line.detail


async def test_doctor_with_no_flags_takes_server_and_project_from_the_saved_registration(
    hub: tuple[Hub, str], sim: Simulator, tmp_path: Path
) -> None:
    """``alp-gateway doctor`` with only the state directory and a backend: the project (and its
    Server) of registration.json, checked against the hub, not "no project" (issue 37, point 5)."""
    state = tmp_path / "state"
    await Runner(runner_config(hub[1], sim.url, state)).register()
    env = {"ALP_GATEWAY_STATE_DIR": str(state), "CHAT_LLM_BACKEND_URL": sim.url}
    env["CHAT_LLM_BACKEND_KEY"] = BACKEND_KEY
    out = io.StringIO()
    code = await trio.to_thread.run_sync(lambda: run_doctor({}, env, None, out=out))
    text = out.getvalue()
    assert code == 0, text
    assert f"{OWNER}/{PROJECT}, from the saved registration" in text
    assert "runner token accepted" in text and "no project" not in text
    assert hub[1] in text  # the registration's Server, not agentics.dk
    # two projects saved: which one is not guessed
    StateStore(state).save(SavedRegistration("r-2", "box", "tok-2-secret", hub[1], OWNER, "other"))
    out = io.StringIO()
    code = await trio.to_thread.run_sync(lambda: run_doctor({}, env, None, out=out))
    assert (
        code == 1 and f"holds registrations for {OWNER}/{PROJECT}, {OWNER}/other" in out.getvalue()
    )
