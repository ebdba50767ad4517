"""``alp-gateway connect AGENT``: a coding agent set up for the hub in one command (its key, model,
files and environment), printed or written with a backup of every file it changes.

The hub's URL is ``--hub`` or the local hub's (its ``listen`` and ``tls_cert`` settings); an API
key is ``--key`` or one made with the admin API (the admin credential from ``--admin-token`` or
the hub's data directory); the model is ``--model`` or the first of ``/v1/models``. What each agent gets is ``gateway.ops.agents``'s (pure); this module does the
I/O around it. httpx is imported when ``connect`` runs, not with this module: every command
builds the command line, ``connect``'s arguments included (``add_arguments``), and ``run`` and
``hub`` would carry httpx for nothing (with click, rich and pygments, which it takes in when
they are there: 60 ms of every start).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway import logsafe
from gateway.config import ConfigError, load_hub_settings
from gateway.ops.agents import (
    AGENTS,
    KEY_VARIABLE,
    PROVIDER,
    Recipe,
    Target,
    claude_settings_env,
    opencode_config,
    recipe,
)

if TYPE_CHECKING:
    import httpx

TIMEOUT = 15.0  # seconds for each call to the hub (its /v1/models may wait for runners' lists)


class ConnectError(Exception):
    """What stops ``connect``, said in one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("agent", choices=AGENTS, help="the agent to set up")
    parser.add_argument(
        "--hub",
        metavar="URL",
        help="the hub's root URL (default: the local hub's, from its listen and tls_cert "
        "settings: --config, ALP_GATEWAY_HUB_LISTEN, …; http://127.0.0.1:8787 by default)",
    )
    parser.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="the local hub's data directory, for its admin credential (default: the hub's)",
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="the local hub's TOML settings file"
    )
    parser.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="the hub's admin credential, to make an API key (default: DATA/admin-token)",
    )
    parser.add_argument("--key", metavar="KEY", help="use this API key instead of making one")
    parser.add_argument(
        "--key-name", metavar="NAME", help="the new API key's name (default: AGENT-HOSTNAME)"
    )
    parser.add_argument(
        "--project", metavar="OWNER/PROJECT", help="the new API key's project (the hub's default)"
    )
    parser.add_argument("--model", help="the model to use (default: the first of /v1/models)")
    parser.add_argument(
        "--ca-file",
        type=Path,
        metavar="PEM",
        help="the CA of the hub's certificate, when a private CA signed it (default: "
        "ALP_GATEWAY_CA_FILE); the agent is told to trust it too",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--print",
        action="store_true",
        help="show the configuration and environment, writing no file (the default; an API "
        "key is still made on the hub unless --key is given)",
    )
    mode.add_argument(
        "--write",
        action="store_true",
        help="write the agent's files (each one it changes backed up first) and an env file",
    )


def main(args: argparse.Namespace) -> int:
    try:
        target = _target(args)
        made = recipe(args.agent, target)
        if args.write:
            for line in write(made, target, os.environ):
                print(logsafe.escape(line))
        else:
            sys.stdout.write(made.text())
        return 0
    except (ConnectError, ConfigError) as exc:
        print(f"alp-gateway connect: {logsafe.escape(str(exc))}", file=sys.stderr)
        return 2


# -- the hub, the key, the model -------------------------------------------------------------


def _target(args: argparse.Namespace) -> Target:
    env = os.environ
    settings = None
    if args.hub is None or (args.key is None and args.admin_token is None):
        flags: dict[str, Any] = {"data": args.data} if args.data else {}
        settings = load_hub_settings(flags, env, args.config)
    hub = (args.hub or _local_url(settings)).rstrip("/")
    if hub.endswith("/v1"):
        hub = hub[: -len("/v1")]
    if not hub.startswith(("http://", "https://")):
        raise ConnectError(f"--hub {hub}: give the hub's root URL, http(s)://HOST:PORT")
    ca = args.ca_file or (
        Path(env["ALP_GATEWAY_CA_FILE"]) if env.get("ALP_GATEWAY_CA_FILE") else None
    )
    if ca is not None and not ca.is_file():
        raise ConnectError(f"--ca-file {ca}: no such file")
    verify: ssl.SSLContext | bool = True
    if ca is not None:  # added to the system's CAs (create_default_context(cafile=) replaces)
        verify = ssl.create_default_context()
        verify.load_verify_locations(cafile=str(ca))
    import httpx  # (the module's docstring: here, not with the module)

    with httpx.Client(base_url=hub, timeout=TIMEOUT, verify=verify, trust_env=False) as http:
        key = args.key or _make_key(http, args, settings, env)
        model = _model(http, key, args.model)
    ca_file = str(ca.resolve()) if ca else None
    bundle = str(_config_home(env) / "alp-gateway" / "ca-bundle.pem") if ca else None
    system = ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt"
    return Target(hub, key, model, ca_file, bundle, system)


def _local_url(settings: Any) -> str:
    host, port = settings.listen
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "https" if settings.tls_cert else "http"
    return f"{scheme}://{host}:{port}"


def _admin_token(args: argparse.Namespace, settings: Any, env: Any) -> str:
    token = args.admin_token
    if token:
        return str(token).strip()
    path = Path(settings.data) / "admin-token"
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConnectError(
            f"no API key and no admin credential to make one: {path}: {exc.strerror}; give "
            f"--key KEY, or --admin-token, or --data the hub's data directory"
        ) from None


def _make_key(http: httpx.Client, args: argparse.Namespace, settings: Any, env: Any) -> str:
    token = _admin_token(args, settings, env)
    base = args.key_name or f"{args.agent}-{socket.gethostname()}"
    body: dict[str, Any] = {"project": args.project} if args.project else {}
    for n in range(1, 10):
        name = base if n == 1 else f"{base}-{n}"
        answer = _call(
            http, "POST", "/api/hub/keys", token, json={"name": name, **body}, what="make a key"
        )
        if answer.status_code == 201:
            key = answer.json().get("key")
            if isinstance(key, str):
                print(f"made the API key {name}", file=sys.stderr)
                return key
        if answer.status_code != 409 or args.key_name:
            raise ConnectError(f"making an API key: {_said(answer)}")
    raise ConnectError(f"the API keys {base} … {base}-9 all exist: give --key-name")


def _model(http: httpx.Client, key: str, wanted: str | None) -> str:
    answer = _call(http, "GET", "/v1/models", key, what="list its models")
    models = []
    if answer.status_code == 200:
        models = [m.get("id") for m in answer.json().get("data", []) if isinstance(m, dict)]
    if wanted:
        if wanted not in models:
            print(
                f"note: {wanted} is not among the hub's models now "
                f"({', '.join(map(str, models)) or _said(answer)})",
                file=sys.stderr,
            )
        return wanted
    if not models:
        raise ConnectError(f"no model to pick: /v1/models: {_said(answer)}; give --model")
    return str(models[0])


def _call(
    http: httpx.Client, method: str, path: str, token: str, *, what: str, **kwargs: Any
) -> httpx.Response:
    import httpx

    try:
        return http.request(method, path, headers={"Authorization": f"Bearer {token}"}, **kwargs)
    except httpx.ConnectError as exc:
        cause = str(exc)
        hint = ""
        if "CERTIFICATE_VERIFY_FAILED" in cause:
            hint = " (a private CA signed its certificate? give it with --ca-file)"
        raise ConnectError(
            f"could not reach the hub at {http.base_url} to {what}: {cause}{hint}"
        ) from None
    except httpx.HTTPError as exc:
        raise ConnectError(f"the hub at {http.base_url} did not answer ({what}): {exc}") from None


def _said(answer: httpx.Response) -> str:
    try:
        message = answer.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = answer.text[:200]
    return f"{answer.status_code} {message}"


# -- writing -----------------------------------------------------------------------------------


def _config_home(env: Any) -> Path:
    return Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")) / ".config").expanduser()


def _home(env: Any) -> Path:
    return Path(env.get("HOME") or Path.home())


def where(path: str, env: Any) -> Path:
    """A recipe's ``~/…`` path on this machine, honouring CODEX_HOME and CLAUDE_CONFIG_DIR."""
    if path.startswith("~/.codex/") and env.get("CODEX_HOME"):
        return Path(env["CODEX_HOME"]) / path[len("~/.codex/") :]
    if path.startswith("~/.config/") and env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]) / path[len("~/.config/") :]
    return _home(env) / path[2:] if path.startswith("~/") else Path(path)


def write(made: Recipe, target: Target, env: Any) -> list[str]:
    """Write ``made``'s files (merged into the agent's own where its format allows; any file
    changed backed up first), its environment into an owner-only env file, and the CA bundle;
    returns what was done, one line each."""
    done: list[str] = []
    if made.bundle:
        system, ca, out = made.bundle
        path = Path(out)
        text = Path(system).read_text() if Path(system).is_file() else ""
        _put(path, text.rstrip("\n") + "\n" + Path(ca).read_text(), False, done)
    env_left = dict(made.env)
    files = list(made.files)
    if made.agent == "claude-code":
        settings = Path(env["CLAUDE_CONFIG_DIR"]) if env.get("CLAUDE_CONFIG_DIR") else None
        path = (settings or _home(env) / ".claude") / "settings.json"
        current = _json_of(path)
        current.setdefault("env", {}).update(claude_settings_env(target))
        if current.pop("model", None) is not None:  # it would override ANTHROPIC_MODEL
            done.append(f'took "model" out of {path}: it overrides ANTHROPIC_MODEL')
        _put(path, json.dumps(current, indent=2) + "\n", True, done)
        env_left = {k: v for k, v in env_left.items() if k == "NODE_EXTRA_CA_CERTS"}
    for config in files:
        path = where(config.path, env)
        text = config.text
        if made.agent == "opencode":
            current = _json_of(path)
            ours = opencode_config(target)
            current.setdefault("$schema", ours["$schema"])
            current.setdefault("provider", {})[PROVIDER] = ours["provider"][PROVIDER]  # type: ignore[index]
            current["model"] = ours["model"]
            text = json.dumps(current, indent=2) + "\n"
        elif made.agent == "codex" and path.is_file():
            text = merge_codex(path.read_text(encoding="utf-8"), config.text)
        elif made.agent == "aider" and path.is_file():
            text = merge_flat_yaml(path.read_text(encoding="utf-8"), config.text)
        _put(path, text, config.secret, done)
    if env_left:
        path = _config_home(env) / "alp-gateway" / f"{made.agent}.env"
        lines = [f"export {name}={_quote(value)}" for name, value in env_left.items()]
        _put(path, "\n".join(lines) + "\n", True, done)
        done.append(f"then, in the shell that runs it (or in ~/.bashrc): . {path}")
    if made.run:
        done.append(f"start it: {made.run}")
    return done


def merge_codex(current: str, ours: str) -> str:
    """Codex's config.toml with our ``model``, ``model_provider`` and provider table in place of
    its own (every other line kept); ours whole when the result would not parse."""
    mine = ours.split("\n\n", 1)
    top, table = mine[0].splitlines(), mine[1].rstrip("\n").splitlines()
    kept: list[str] = []
    section: str | None = None
    for line in current.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped.strip("[] ").split("]")[0].strip()
        if section == f"model_providers.{PROVIDER}":
            continue
        if section is None and stripped.split("=", 1)[0].strip() in ("model", "model_provider"):
            continue
        kept.append(line)
    merged = "\n".join(top + kept).rstrip("\n") + "\n\n" + "\n".join(table) + "\n"
    try:
        tomllib.loads(merged)
    except tomllib.TOMLDecodeError:
        return ours
    return merged


def merge_flat_yaml(current: str, ours: str) -> str:
    """A flat ``key: value`` YAML file (aider's) with our keys in place of its own, every other
    line kept."""
    keys = {line.split(":", 1)[0] for line in ours.splitlines() if ":" in line}
    kept = [
        line
        for line in current.splitlines()
        if line[:1].isspace() or line.split(":", 1)[0].strip() not in keys
    ]
    return "\n".join(kept + ours.rstrip("\n").splitlines()) + "\n"


def _json_of(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise ConnectError(f"{path} is not JSON ({exc}): fix or move it, then again") from None
    if not isinstance(found, dict):
        raise ConnectError(f"{path} is not a JSON object: fix or move it, then again")
    return found


def _put(path: Path, text: str, secret: bool, done: list[str]) -> None:
    """``text`` into ``path`` (owner-only when ``secret``), the old file backed up first."""
    if path.is_file():
        old = path.read_bytes()
        if old == text.encode():
            done.append(f"unchanged: {path}")
            return
        backup = path.with_name(f"{path.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}")
        backup.write_bytes(old)
        os.chmod(backup, path.stat().st_mode & 0o777)
        done.append(f"backed up {path} to {backup}")
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = 0o600 if secret else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(path, mode)
    done.append(f"wrote {path}")


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


__all__ = ["KEY_VARIABLE", "add_arguments", "main", "merge_codex", "write"]
