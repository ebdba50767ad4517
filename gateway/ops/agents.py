"""Each coding agent's configuration for the hub, rendered from its URL, key and model: pure.

``alp-gateway connect AGENT`` (``gateway.ops.connect``) prints or writes what ``recipe`` returns;
the README's recipes are ``readme_recipes()`` (tests/e2e/test_connect.py holds them equal). Each
agent's own format, as its documentation gives it:

- Claude Code: environment variables (also accepted in ``~/.claude/settings.json``'s ``env``),
  ``NODE_EXTRA_CA_CERTS`` for a private CA (Node reads it at start, before any setting);
- Codex CLI: a provider table in ``$CODEX_HOME/config.toml`` (``~/.codex``), its key in the
  environment variable its ``env_key`` names, a private CA in ``CODEX_CA_CERTIFICATE``;
- OpenCode: a custom provider (``@ai-sdk/openai-compatible``) in
  ``~/.config/opencode/opencode.json``, its key from ``{env:ALP_KEY}``; Bun reads
  ``NODE_EXTRA_CA_CERTS``;
- aider: ``~/.aider.conf.yml`` (``openai-api-base``, ``openai-api-key``, ``model: openai/…``), a
  private CA through ``SSL_CERT_FILE`` (which replaces the system's bundle: give it one with both);
- Continue: a model in ``~/.continue/config.yaml`` (``provider: openai``, ``apiBase``), a private
  CA in its ``requestOptions.caBundlePath``;
- Open WebUI: ``OPENAI_API_BASE_URL`` and ``OPENAI_API_KEY`` in its environment (an env file for
  ``docker run --env-file``), a private CA through ``SSL_CERT_FILE`` as aider's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

AGENTS = ("claude-code", "codex", "opencode", "aider", "continue", "open-webui")
KEY_VARIABLE = "ALP_KEY"  # the environment variable Codex and OpenCode read the key from
PROVIDER = "alp"  # the provider's id in Codex's and OpenCode's configuration
PROVIDER_NAME = "alp-gateway hub"


@dataclass(frozen=True)
class Target:
    """Where an agent goes: the hub's root URL (no ``/v1``), an API key, a model; with a private
    CA, its PEM (``ca_file``) and a bundle of the system's CAs and it (``ca_bundle``, for the
    agents whose variable replaces the system's bundle)."""

    hub: str
    key: str
    model: str
    ca_file: str | None = None
    ca_bundle: str | None = None
    system_cas: str = "/etc/ssl/certs/ca-certificates.crt"  # what ca_bundle adds the CA to

    @property
    def v1(self) -> str:
        return self.hub.rstrip("/") + "/v1"


@dataclass(frozen=True)
class ConfigFile:
    """A file of the agent's: ``path`` (``~`` for the home directory), its text, its format
    (``json``, ``toml``, ``yaml``, ``env``); ``secret``: it holds the key (written owner-only)."""

    path: str
    text: str
    format: str
    secret: bool = False


@dataclass(frozen=True)
class Recipe:
    """What one agent needs: its environment (``export`` lines), its files, how to start it."""

    agent: str
    title: str
    env: dict[str, str] = field(default_factory=dict)
    files: tuple[ConfigFile, ...] = ()
    run: str = ""
    notes: tuple[str, ...] = ()
    bundle: tuple[str, str, str] | None = None  # (the system's CAs, the CA, the bundle of both)

    def text(self) -> str:
        """The recipe as ``connect --print`` shows it: shell lines to paste, files as
        here-documents."""
        lines = [f"# {self.title}"]
        lines += [f"# {note}" for note in self.notes]
        if self.bundle:
            system, ca, out = self.bundle
            lines.append(f"mkdir -p {_dirname(out)} && cat {system} {ca} > {out}")
        lines += [f"export {name}={_shell(value)}" for name, value in self.env.items()]
        for config in self.files:
            if _dirname(config.path) != "~":
                lines.append(f"mkdir -p {_dirname(config.path)}")
            lines.append(f"cat > {config.path} <<'EOF'")
            lines.append(config.text.rstrip("\n"))
            lines.append("EOF")
            if config.secret:
                lines.append(f"chmod 600 {config.path}")
        if self.run:
            lines.append(self.run)
        return "\n".join(lines) + "\n"


def recipe(agent: str, target: Target) -> Recipe:
    """The recipe of ``agent`` (one of ``AGENTS``) for ``target``; ValueError for another."""
    try:
        make = _MAKERS[agent]
    except KeyError:
        raise ValueError(f"unknown agent {agent!r}: one of {', '.join(AGENTS)}") from None
    return make(target)


def _claude_code(t: Target) -> Recipe:
    env = {"ANTHROPIC_BASE_URL": t.hub, "ANTHROPIC_AUTH_TOKEN": t.key}
    # its main model, and the names it asks for by itself (background calls, subagents): else
    # those ask for claude-* names the runners do not serve
    for name in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
    ):
        env[name] = t.model
    if t.ca_file:
        env["NODE_EXTRA_CA_CERTS"] = t.ca_file
    return Recipe(
        "claude-code",
        "Claude Code: its environment (`connect --write` puts all but NODE_EXTRA_CA_CERTS "
        'in ~/.claude/settings.json "env")',
        env=env,
        run="claude",
    )


def claude_settings_env(t: Target) -> dict[str, str]:
    """What ``--write`` puts in ``~/.claude/settings.json``'s ``env``: the recipe's variables
    but the CA (Node reads ``NODE_EXTRA_CA_CERTS`` when it starts, before any setting)."""
    env = dict(_claude_code(t).env)
    env.pop("NODE_EXTRA_CA_CERTS", None)
    return env


def _codex(t: Target) -> Recipe:
    config = "\n".join(
        [
            f"model = {_toml(t.model)}",
            f"model_provider = {_toml(PROVIDER)}",
            "",
            f"[model_providers.{PROVIDER}]",
            f"name = {_toml(PROVIDER_NAME)}",
            f"base_url = {_toml(t.v1)}",
            f"env_key = {_toml(KEY_VARIABLE)}",
            'wire_api = "responses"',
            "",
        ]
    )
    env = {KEY_VARIABLE: t.key}
    if t.ca_file:
        env["CODEX_CA_CERTIFICATE"] = t.ca_file
    return Recipe(
        "codex",
        f"Codex CLI: a provider in ~/.codex/config.toml, its key in ${KEY_VARIABLE}",
        env=env,
        files=(ConfigFile("~/.codex/config.toml", config, "toml"),),
        run="codex",
    )


def opencode_config(t: Target) -> dict[str, object]:
    """OpenCode's ``provider`` and ``model`` entries (merged into an existing opencode.json)."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER_NAME,
                "options": {"baseURL": t.v1, "apiKey": "{env:" + KEY_VARIABLE + "}"},
                "models": {t.model: {"name": t.model}},
            }
        },
        "model": f"{PROVIDER}/{t.model}",
    }


def _opencode(t: Target) -> Recipe:
    text = json.dumps(opencode_config(t), indent=2) + "\n"
    env = {KEY_VARIABLE: t.key}
    if t.ca_file:
        env["NODE_EXTRA_CA_CERTS"] = t.ca_file
    return Recipe(
        "opencode",
        f"OpenCode: a provider in ~/.config/opencode/opencode.json, its key in ${KEY_VARIABLE}",
        env=env,
        files=(ConfigFile("~/.config/opencode/opencode.json", text, "json"),),
        run="opencode",
    )


def _aider(t: Target) -> Recipe:
    lines = [
        f"openai-api-base: {_yaml(t.v1)}",
        f"openai-api-key: {_yaml(t.key)}",
        f"model: {_yaml('openai/' + t.model)}",
    ]
    env = {}
    notes = []
    if t.ca_bundle:
        env["SSL_CERT_FILE"] = t.ca_bundle
        notes.append(
            f"SSL_CERT_FILE replaces the system's CAs: {t.ca_bundle} holds them and the hub's CA"
        )
    return Recipe(
        "aider",
        "aider: ~/.aider.conf.yml (an OpenAI-compatible API at the hub)",
        env=env,
        files=(ConfigFile("~/.aider.conf.yml", "\n".join(lines) + "\n", "yaml", secret=True),),
        run="aider",
        notes=tuple(notes),
        bundle=_bundle(t),
    )


def _continue(t: Target) -> Recipe:
    lines = [
        f"name: {_yaml(PROVIDER_NAME)}",
        "version: 1.0.0",
        "schema: v1",
        "models:",
        f"  - name: {_yaml(t.model + ' (alp hub)')}",
        "    provider: openai",
        f"    model: {_yaml(t.model)}",
        f"    apiBase: {_yaml(t.v1)}",
        f"    apiKey: {_yaml(t.key)}",
        "    roles: [chat, edit, apply]",
    ]
    if t.ca_file:
        lines += ["    requestOptions:", f"      caBundlePath: {_yaml(t.ca_file)}"]
    return Recipe(
        "continue",
        "Continue: a model in ~/.continue/config.yaml",
        files=(ConfigFile("~/.continue/config.yaml", "\n".join(lines) + "\n", "yaml", True),),
    )


def _open_webui(t: Target) -> Recipe:
    lines = [f"OPENAI_API_BASE_URL={t.v1}", f"OPENAI_API_KEY={t.key}"]
    notes = [
        "in a container, 127.0.0.1 is the container: use the host's address "
        "(or --network host, or host.docker.internal)"
    ]
    if t.ca_bundle:
        lines.append(f"SSL_CERT_FILE={t.ca_bundle}")
        notes.append(
            f"SSL_CERT_FILE replaces the system's CAs: {t.ca_bundle} holds them and the hub's CA "
            "(mount it at the same path in a container)"
        )
    path = "~/.config/alp-gateway/open-webui.env"
    return Recipe(
        "open-webui",
        f"Open WebUI: its environment in {path}",
        files=(ConfigFile(path, "\n".join(lines) + "\n", "env", secret=True),),
        run=f"docker run -d -p 3000:8080 --env-file {path} ghcr.io/open-webui/open-webui:main"
        f"  # or: set -a; . {path}; set +a; open-webui serve",
        notes=tuple(notes),
        bundle=_bundle(t),
    )


def _bundle(t: Target) -> tuple[str, str, str] | None:
    return (t.system_cas, t.ca_file, t.ca_bundle) if t.ca_file and t.ca_bundle else None


_MAKERS = {
    "claude-code": _claude_code,
    "codex": _codex,
    "opencode": _opencode,
    "aider": _aider,
    "continue": _continue,
    "open-webui": _open_webui,
}

# -- the README's recipes -------------------------------------------------------------------

README_TARGET = Target("http://127.0.0.1:8787", "alpk_…", "sim-model")


def readme_recipes() -> str:
    """The README's block of recipes: ``connect --print`` of each agent for ``README_TARGET``."""
    parts = []
    for agent in AGENTS:
        parts += ["```sh", recipe(agent, README_TARGET).text().rstrip("\n"), "```", ""]
    return "\n".join(parts)


# -- quoting -------------------------------------------------------------------------------


def _toml(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for these values


def _yaml(value: str) -> str:
    """A YAML scalar: plain when safe, else double-quoted (JSON's escapes are YAML's)."""
    plain = value and value[0] not in "!&*-?{}[]|>'\"%@`#,:" and ": " not in value
    if plain and " #" not in value and not value.endswith(":") and value.strip() == value:
        return value
    return json.dumps(value)


def _shell(value: str) -> str:
    if value and all(c.isalnum() or c in "-_./:@%+=,…" for c in value):
        return value
    return "'" + value.replace("'", "'\\''") + "'"


def _dirname(path: str) -> str:
    return path.rsplit("/", 1)[0]


BEGIN = "<!-- agent recipes: generated by `python -m gateway.ops.agents` -->"
END = "<!-- end of the agent recipes -->"


def with_recipes(readme: str) -> str:
    """``readme`` with its block between ``BEGIN`` and ``END`` made anew."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n\n" + readme_recipes() + readme[end:]


if __name__ == "__main__":  # python -m gateway.ops.agents: the README's block regenerated
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "README.md"
    path.write_text(with_recipes(path.read_text(encoding="utf-8")), encoding="utf-8")
