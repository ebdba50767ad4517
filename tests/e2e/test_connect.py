"""``alp-gateway connect AGENT`` (issue 37, point 1): the installed command, as a subprocess with a
throwaway HOME, against a real hub (a runner and the simulator behind it): it makes an API key
with the admin credential of the hub's data directory, picks the model of ``/v1/models``, and
prints (touching nothing) or writes (backing up what it changes) each agent's configuration.
Claude Code and Codex then run with only what ``--write`` wrote and answer through the hub; the
README's recipes are what ``connect --print`` prints (``readme_recipes``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import tomllib
from pathlib import Path

import trio
import trustme
from helpers import ADMIN, BACKEND_KEY, EXE, OWNER, PROJECT, clean_env, runner_config, running
from test_agents import ANSWER, Setup, claude, codex, run_agent, served, whole_path

from gateway.hub import Hub, open_hub
from gateway.ops.agents import AGENTS, BEGIN, END, Target, readme_recipes, recipe
from gateway.sim import SimOptions, open_sim

__all__ = ["claude", "codex"]  # the fixtures, used by name

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


# the tests' own settings of the agents: nothing on the network but the turns (as in
# tests/e2e/test_agents.py), on top of what connect wrote
AGENT_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "LANG": "C.UTF-8",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
}
OFFLINE = [
    "-c", "features.plugins=false", "-c", "analytics.enabled=false",
    "-c", "feedback.enabled=false", "-c", "check_for_update_on_startup=false",
    "-c", "model_providers.alp.request_max_retries=0",
    "-c", "model_providers.alp.stream_max_retries=0",
]  # fmt: skip


def test_the_readmes_recipes_are_what_connect_prints() -> None:
    text = README.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    assert text[start:end].strip("\n") == readme_recipes().strip("\n"), (
        "regenerate the README's agent recipes: python -m gateway.ops.agents"
    )


def test_each_recipe_trusts_a_private_ca_its_agents_way() -> None:
    target = Target("https://hub.lan:8787", "alpk_x", "m", "/ca.pem", "/b/ca-bundle.pem")
    texts = {agent: recipe(agent, target).text() for agent in AGENTS}
    assert "export NODE_EXTRA_CA_CERTS=/ca.pem" in texts["claude-code"]
    assert "export NODE_EXTRA_CA_CERTS=/ca.pem" in texts["opencode"]  # Bun reads it
    assert "export CODEX_CA_CERTIFICATE=/ca.pem" in texts["codex"]
    assert "export SSL_CERT_FILE=/b/ca-bundle.pem" in texts["aider"]
    assert "SSL_CERT_FILE=/b/ca-bundle.pem" in texts["open-webui"]
    for agent in ("aider", "open-webui"):  # SSL_CERT_FILE replaces the system's CAs: both
        assert "cat /etc/ssl/certs/ca-certificates.crt /ca.pem > /b/ca-bundle.pem" in texts[agent]
    assert "caBundlePath: /ca.pem" in texts["continue"]
    codex_toml = texts["codex"].split("<<'EOF'\n")[1].split("\nEOF")[0]
    provider = tomllib.loads(codex_toml)["model_providers"]["alp"]
    assert provider["name"] and provider["env_key"] == "ALP_KEY"
    assert provider["base_url"] == "https://hub.lan:8787/v1"


async def connect(home: Path, *argv: str, **extra: str) -> tuple[int, str, str]:
    """``alp-gateway connect ARGV`` with HOME ``home`` and no setting of this machine's (but
    ``extra``)."""
    env = clean_env(HOME=str(home), PYTHONPATH=str(ROOT), **extra)
    for name in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "CODEX_HOME", "CLAUDE_CONFIG_DIR"):
        env.pop(name, None)
    with trio.fail_after(60):
        done = await trio.run_process(
            [EXE, "connect", *argv, "--project", f"{OWNER}/{PROJECT}"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def data_dir(tmp_path: Path, path: Setup) -> Path:
    """The hub's data directory as the hub keeps it: its admin credential, owner-only."""
    data = tmp_path / "hubdata"
    data.mkdir(mode=0o700)
    assert path.hub.admin_token
    (data / "admin-token").write_text(path.hub.admin_token + "\n")
    os.chmod(data / "admin-token", 0o600)
    return data


def env_file(path: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of an env file ``--write`` wrote."""
    out = {}
    for line in path.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        out[name] = shlex.split(value)[0]
    return out


async def test_print_shows_the_recipe_and_touches_no_file(tmp_path: Path) -> None:
    """``connect codex --print`` at the local hub: a key made with its data directory's admin
    credential, the model of /v1/models; no file written."""
    async with whole_path(tmp_path) as path:
        home = tmp_path / "home"
        before = sorted(home.rglob("*"))
        data = data_dir(tmp_path, path)
        # no --hub: the local hub's, from its settings (here its listen address)
        listen = path.url.removeprefix("http://")
        code, out, err = await connect(
            home, "codex", "--print", "--data", str(data), ALP_GATEWAY_HUB_LISTEN=listen
        )
        keys = await path.hub.keys.listing()
    assert code == 0, err
    assert sorted(home.rglob("*")) == before  # nothing written
    made = [k for k in keys if k["name"].startswith("codex-")]
    assert len(made) == 1 and "made the API key codex-" in err
    key = re.search(r"export ALP_KEY=(\S+)", out)
    assert key and key.group(1).startswith("alpk_")
    assert 'model = "sim-model"' in out and f'base_url = "{path.url}/v1"' in out


async def test_connect_write_runs_claude_code_through_the_hub(tmp_path: Path, claude: Path) -> None:
    """``connect claude-code --write`` (its settings.json ``env``), then ``claude -p`` with no
    API variable of its own: the answer comes through the hub."""
    async with whole_path(tmp_path) as path:
        home = tmp_path / "home"
        data = data_dir(tmp_path, path)
        code, out, err = await connect(
            home, "claude-code", "--write", "--hub", path.url, "--data", str(data)
        )
        assert code == 0, err
        settings = home / ".claude" / "settings.json"
        assert f"wrote {settings}" in out
        assert stat.S_IMODE(settings.stat().st_mode) == 0o600  # it holds the key
        env = {**AGENT_ENV, "HOME": str(home)}
        (tmp_path / "work").mkdir()
        run = await run_agent(path, [str(claude), "-p", "say hi"], env, tmp_path / "work")
    print(f"claude-code via connect --write: exit {run.returncode}, {run.stdout.strip()!r}")
    assert run.returncode == 0 and ANSWER in run.stdout, run.report()
    for turn in served(run, "/v1/messages"):
        assert turn.headers["authorization"].startswith("Bearer alpk_")


async def test_connect_write_runs_codex_through_the_hub_keeping_the_users_config(
    tmp_path: Path, codex: Path
) -> None:
    """``connect codex --write`` into a ~/.codex/config.toml that has settings of the user's own:
    those kept, the old file backed up, the key in an owner-only env file; then ``codex exec``
    with that file's environment answers through the hub."""
    async with whole_path(tmp_path) as path:
        home = tmp_path / "home"
        (home / ".codex").mkdir(parents=True)
        config = home / ".codex" / "config.toml"
        mine = 'model = "gpt-9"\napproval_policy = "never"\n\n[tui]\nanimations = false\n'
        config.write_text(mine)
        data = data_dir(tmp_path, path)
        code, out, err = await connect(
            home, "codex", "--write", "--hub", path.url, "--data", str(data)
        )
        assert code == 0, err
        written = tomllib.loads(config.read_text())
        (backup,) = home.joinpath(".codex").glob("config.toml.bak-*")
        envs = home / ".config" / "alp-gateway" / "codex.env"
        env = env_file(envs)
        env.update(PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME=str(home), LANG="C.UTF-8")
        argv = [str(codex), "exec", "--skip-git-repo-check", *OFFLINE, "say hi"]
        (tmp_path / "work").mkdir()
        run = await run_agent(path, argv, env, tmp_path / "work")
    assert backup.read_text() == mine
    assert written["model"] == "sim-model" and written["approval_policy"] == "never"
    assert written["tui"] == {"animations": False}
    assert written["model_providers"]["alp"]["env_key"] == "ALP_KEY"
    assert stat.S_IMODE(envs.stat().st_mode) == 0o600 and env["ALP_KEY"].startswith("alpk_")
    print(f"codex via connect --write: exit {run.returncode}, {run.stdout.strip()!r}")
    assert run.returncode == 0 and ANSWER in run.stdout, run.report()
    served(run, "/v1/responses")


async def test_connect_over_tls_with_a_private_ca(tmp_path: Path) -> None:
    """A hub serving HTTPS with a private CA's certificate: ``--ca-file`` reaches it, and the
    recipe tells the agent to trust that CA (Claude Code: NODE_EXTRA_CA_CERTS)."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    ca_pem, cert, key = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    home = tmp_path / "home"
    home.mkdir()
    async with open_hub(Hub(admin_token=ADMIN), certfile=cert, keyfile=key) as (hub, url):
        assert url.startswith("https://")
        argv = ["claude-code", "--hub", url, "--admin-token", ADMIN, "--model", "m"]
        refused = await connect(home, *argv)
        code, out, err = await connect(home, *argv, "--ca-file", str(ca_pem))
    assert refused[0] == 2 and "give it with --ca-file" in refused[2]
    assert code == 0, err
    assert f"export NODE_EXTRA_CA_CERTS={ca_pem}" in out
    assert f"export ANTHROPIC_BASE_URL={url}" in out
    assert not list(home.iterdir())


async def test_connect_write_over_tls_runs_claude_code_and_codex_trusting_the_private_ca(
    tmp_path: Path, claude: Path, codex: Path
) -> None:
    """A hub serving HTTPS with a private CA's certificate: ``connect --write --ca-file`` for
    Claude Code and Codex, then each agent, given only what was written (the env file holds the
    CA's variable: NODE_EXTRA_CA_CERTS, CODEX_CA_CERTIFICATE), answers through the hub."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    ca_pem, cert, key = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    home = tmp_path / "home"
    (tmp_path / "work").mkdir()
    (home / ".codex").mkdir(parents=True)
    answers = {}
    async with open_sim(require_key=BACKEND_KEY, options=SimOptions(chunks=5)) as sim:
        hub = Hub(admin_token=ADMIN, runner_wait_timeout=10)
        async with open_hub(hub, certfile=cert, keyfile=key) as (_, url):
            config = runner_config(url, sim.url, tmp_path / "state", ca_file=ca_pem)
            async with running(config):
                for agent, argv in (
                    ("claude-code", [str(claude), "-p", "say hi"]),
                    ("codex", [str(codex), "exec", "--skip-git-repo-check", *OFFLINE, "say hi"]),
                ):
                    code, out, err = await connect(
                        home, agent, "--write", "--hub", url, "--admin-token", ADMIN,
                        "--ca-file", str(ca_pem),
                    )  # fmt: skip
                    assert code == 0, err
                    env = env_file(home / ".config" / "alp-gateway" / f"{agent}.env")
                    env.update(AGENT_ENV, HOME=str(home))
                    with trio.fail_after(120):
                        done = await trio.run_process(
                            argv, stdin=b"", capture_stdout=True, capture_stderr=True,
                            check=False, env=env, cwd=tmp_path / "work",
                        )  # fmt: skip
                    answers[agent] = (done.returncode, done.stdout.decode(), env)
                    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert answers["claude-code"][2]["NODE_EXTRA_CA_CERTS"] == str(ca_pem)
    assert answers["codex"][2]["CODEX_CA_CERTIFICATE"] == str(ca_pem)
    for agent, (code, out, _) in answers.items():
        print(f"{agent} over TLS via connect --write --ca-file: exit {code}, {out.strip()!r}")
        assert ANSWER in out


async def test_connect_write_merges_into_the_other_agents_files(tmp_path: Path) -> None:
    """OpenCode's opencode.json keeps the user's other providers, aider's file its other
    settings; aider's, Continue's and Open WebUI's files (they hold the key) are owner-only;
    every file changed is backed up first."""
    async with whole_path(tmp_path) as path:
        home = tmp_path / "home"
        config = home / ".config" / "opencode" / "opencode.json"
        config.parent.mkdir(parents=True)
        mine = {"provider": {"mine": {"npm": "x"}}, "theme": "dark"}
        config.write_text(json.dumps(mine))
        (home / ".aider.conf.yml").write_text("dark-mode: true\nmodel: gpt-9\n")
        said = {}
        for agent in ("opencode", "aider", "continue", "open-webui"):
            code, out, err = await connect(
                home, agent, "--write", "--hub", path.url, "--key", path.key, "--model", "m"
            )
            assert code == 0, err
            said[agent] = out
    merged = json.loads(config.read_text())
    assert merged["theme"] == "dark" and set(merged["provider"]) == {"mine", "alp"}
    assert merged["model"] == "alp/m"
    assert merged["provider"]["alp"]["options"] == {
        "baseURL": f"{path.url}/v1",
        "apiKey": "{env:ALP_KEY}",
    }
    assert path.key not in config.read_text()  # OpenCode's key: in the env file only
    assert env_file(home / ".config" / "alp-gateway" / "opencode.env") == {"ALP_KEY": path.key}
    for written in (
        home / ".aider.conf.yml",
        home / ".continue" / "config.yaml",
        home / ".config" / "alp-gateway" / "open-webui.env",
    ):
        assert stat.S_IMODE(written.stat().st_mode) == 0o600 and path.key in written.read_text()
    (backup,) = home.glob(".aider.conf.yml.bak-*")
    assert backup.read_text() == "dark-mode: true\nmodel: gpt-9\n" and "backed up" in said["aider"]
    aider = (home / ".aider.conf.yml").read_text().splitlines()
    assert (
        aider[0] == "dark-mode: true"
        and "model: openai/m" in aider
        and "gpt-9" not in "\n".join(aider)
    )
    assert len(list(config.parent.glob("opencode.json.bak-*"))) == 1
