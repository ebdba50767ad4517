"""One validated ``Config`` from flags > environment > TOML file > defaults: pure, no I/O beyond reading the file."""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_SERVER = "agentics.dk"
MiB = 1024 * 1024


class ConfigError(ValueError):
    """A missing or invalid setting; its message is one line meant for the user."""


def normalize_server(value: str) -> str:
    """``localhost``/``127.0.0.1`` get ``http://``, any other bare host ``https://``."""
    value = value.strip().rstrip("/")
    if not value:
        raise ConfigError("server: empty value")
    if "://" not in value:
        host = value.split("/")[0].split(":")[0]
        scheme = "http" if host in ("localhost", "127.0.0.1", "[::1]") else "https"
        value = f"{scheme}://{value}"
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"server: {value!r} is not an http(s) URL or host name")
    return value


def default_state_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_STATE_HOME")
    root = Path(base) if base else Path.home() / ".local" / "state"
    return root / "alp-gateway"


def _project(value: str) -> str:
    value = value.strip().strip("/")
    owner, _, name = value.partition("/")
    if not owner or not name or "/" in name:
        raise ValueError("expected OWNER/PROJECT")
    return value


def _positive_float(value: Any) -> float:
    number = float(value)
    if not number > 0:
        raise ValueError("must be > 0")
    return number


def _positive_int(value: Any) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("must be a whole number")
    number = int(value)
    if number < 1:
        raise ValueError("must be ≥ 1")
    return number


def _labels(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = [str(v) for v in value]
    else:
        raise ValueError("expected a comma-separated list")
    return tuple(item.strip() for item in items if item.strip())


def _url(value: Any) -> str:
    text = str(value).strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an http(s) URL such as http://127.0.0.1:11434/v1")
    return text


def _log_format(value: Any) -> str:
    text = str(value)
    if text not in ("text", "json"):
        raise ValueError("expected text or json")
    return text


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected true or false")


def parse_listen(value: Any) -> tuple[str, int]:
    """``HOST:PORT``, ``[v6]:PORT`` or a bare ``PORT`` (loopback: ``9464`` = ``127.0.0.1:9464``)."""
    text = str(value).strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError("expected PORT or HOST:PORT, such as 9464 or 127.0.0.1:9464")
    return host or "127.0.0.1", int(port_text)


def _str(value: Any) -> str:
    return str(value)


def _model_list(value: Any) -> tuple[str, ...]:
    """A list of model ids (TOML list or comma-separated text); duplicates dropped."""
    items = _labels(value)
    return tuple(dict.fromkeys(items))


@dataclass(frozen=True)
class Setting:
    key: str  # TOML key and attribute name; the flag is --key-with-dashes
    env: tuple[str, ...]
    parse: Callable[[Any], Any]
    default: Any = None
    secret: bool = False


SETTINGS: tuple[Setting, ...] = (
    Setting("server", ("AGENTICS_SERVER",), normalize_server, DEFAULT_SERVER),
    Setting("project", ("ALP_PROJECT", "AGENTICS_PROJECT"), _project),
    Setting("state_dir", ("ALP_GATEWAY_STATE_DIR",), lambda v: Path(str(v)).expanduser()),
    Setting("backend", ("CHAT_LLM_BACKEND_URL",), _url),
    Setting("backend_key", ("CHAT_LLM_BACKEND_KEY",), _str, secret=True),
    Setting("model", ("CHAT_LLM_MODEL",), _str),
    Setting("user_token", ("AGENTICS_USER_TOKEN",), _str, secret=True),
    Setting("name", ("ALP_GATEWAY_NAME",), _str),
    Setting("labels", ("ALP_GATEWAY_LABELS",), _labels, ("self-hosted", "linux")),
    Setting("poll_interval", ("ALP_GATEWAY_POLL_INTERVAL",), _positive_float, 10.0),
    Setting("max_sessions", ("ALP_GATEWAY_MAX_SESSIONS",), _positive_int, 64),
    Setting("reconnect_window", ("ALP_GATEWAY_RECONNECT_WINDOW",), _positive_float, 60.0),
    Setting("grace", ("ALP_GATEWAY_GRACE",), _positive_float, 30.0),
    Setting("heartbeat_interval", ("ALP_GATEWAY_HEARTBEAT",), _positive_float, 20.0),
    Setting("idle_timeout", ("ALP_GATEWAY_IDLE_TIMEOUT",), _positive_float, 600.0),
    Setting("connect_timeout", ("ALP_GATEWAY_CONNECT_TIMEOUT",), _positive_float, 10.0),
    Setting("models_cache", ("ALP_GATEWAY_MODELS_CACHE",), _positive_float, 30.0),
    Setting("max_frame_size", ("ALP_GATEWAY_MAX_FRAME_SIZE",), _positive_int, 16 * MiB),
    Setting("ca_file", ("ALP_GATEWAY_CA_FILE",), lambda v: Path(str(v)).expanduser()),
    Setting("log_format", ("ALP_GATEWAY_LOG_FORMAT",), _log_format, "text"),
    Setting("log_level", ("ALP_GATEWAY_LOG_LEVEL",), lambda v: str(v).upper(), "INFO"),
    Setting("metrics_listen", ("ALP_GATEWAY_METRICS_LISTEN",), parse_listen),
    Setting("verbose_frames", ("ALP_GATEWAY_VERBOSE_FRAMES",), _bool, False),
    Setting("allowed_models", ("ALP_GATEWAY_ALLOWED_MODELS",), _model_list, ()),
    Setting("health_interval", ("ALP_GATEWAY_HEALTH_INTERVAL",), _positive_float, 30.0),
    Setting("models_refresh", ("ALP_GATEWAY_MODELS_REFRESH",), _positive_float, 300.0),
)
_BY_KEY = {s.key: s for s in SETTINGS}


DEFAULT_BACKEND = "default"
DEFAULT_QUEUE = 16
_BACKEND_KEYS = ("name", "url", "key", "key_env", "models", "max_concurrency", "queue")


@dataclass(frozen=True)
class BackendSpec:
    """One configured backend: its name, base URL (with ``/v1``), key, models and limits."""

    name: str
    url: str
    key: str | None = field(default=None, repr=False)
    models: tuple[str, ...] = ()  # declared model ids; empty = discover them
    max_concurrency: int | None = None  # turns in flight at once; None = unlimited
    queue: int = DEFAULT_QUEUE  # turns that may wait for a slot beyond that
    shortcut: bool = False  # made from --backend / CHAT_LLM_BACKEND_URL


@dataclass(frozen=True)
class Config:
    """Everything the Runner needs to know, validated once at start.

    ``backends`` lists every backend, the ``--backend`` shortcut (named "default") first;
    it is kept in step with ``backend``/``backend_key`` whenever a Config is built.
    """

    server: str = "https://agentics.dk"
    server_explicit: bool = False
    project: str | None = None
    state_dir: Path = field(default_factory=lambda: default_state_dir(os.environ))
    backend: str | None = None
    backend_key: str | None = field(default=None, repr=False)
    model: str | None = None
    user_token: str | None = field(default=None, repr=False)
    name: str = field(default_factory=socket.gethostname)
    labels: tuple[str, ...] = ("self-hosted", "linux")
    poll_interval: float = 10.0
    max_sessions: int = 64
    reconnect_window: float = 60.0
    grace: float = 30.0
    heartbeat_interval: float = 20.0
    idle_timeout: float = 600.0
    connect_timeout: float = 10.0
    models_cache: float = 30.0
    max_frame_size: int = 16 * MiB
    ca_file: Path | None = None
    log_format: str = "text"
    log_level: str = "INFO"
    metrics_listen: tuple[str, int] | None = None  # health and metrics HTTP server; off when None
    verbose_frames: bool = False
    backends: tuple[BackendSpec, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict, hash=False)
    allowed_models: tuple[str, ...] = ()
    health_interval: float = 30.0
    models_refresh: float = 300.0

    def __post_init__(self) -> None:
        declared = [b for b in self.backends if not b.shortcut]
        if self.backend:
            declared.insert(
                0, BackendSpec(DEFAULT_BACKEND, self.backend, self.backend_key, shortcut=True)
            )
        seen: set[str] = set()
        for spec in declared:
            if spec.name in seen:
                extra = (
                    " (--backend makes a backend named default)"
                    if spec.name == DEFAULT_BACKEND
                    else ""
                )
                raise ConfigError(
                    f"backend name {spec.name!r} is used twice{extra}: names must be unique"
                )
            seen.add(spec.name)
        object.__setattr__(self, "backends", tuple(declared))
        object.__setattr__(self, "aliases", dict(self.aliases))
        object.__setattr__(self, "allowed_models", tuple(self.allowed_models))

    @property
    def owner(self) -> str:
        assert self.project
        return self.project.split("/", 1)[0]

    @property
    def project_name(self) -> str:
        assert self.project
        return self.project.split("/", 1)[1]

    @property
    def base_url(self) -> str:
        """``{server}/api/owners/{owner}/projects/{project}`` (PROTOCOL.md)."""
        return f"{self.server}/api/owners/{self.owner}/projects/{self.project_name}"


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        if norm == "backend" and not isinstance(value, str):
            if not isinstance(value, list):
                raise ConfigError(
                    f"config file {path}: write backends as [[backend]] tables (an array), not [backend]"
                )
            flat["_backend_tables"] = value
            continue
        if norm == "aliases":
            if not isinstance(value, dict):
                raise ConfigError(
                    f'config file {path}: aliases must be a table: [aliases] then "name" = "local-model"'
                )
            flat["_aliases"] = value
            continue
        if norm not in _BY_KEY:
            if isinstance(value, (dict, list)):  # tables of later features ([[backend]], ...)
                continue
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        flat[norm] = value
    return flat


def load_config(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
) -> Config:
    """Merge ``flags`` (None = not given) > ``env`` > TOML file > defaults and validate."""
    file_values = read_toml(config_file) if config_file else {}
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        raw: Any = None
        source = ""
        if flags.get(setting.key) is not None:
            raw, source = flags[setting.key], "--" + setting.key.replace("_", "-")
        else:
            for name in setting.env:
                if env.get(name):
                    raw, source = env[name], name
                    break
            else:
                if setting.key in file_values:
                    raw, source = file_values[setting.key], f"{setting.key} in {config_file}"
        if raw is None:
            if setting.default is not None:
                values[setting.key] = setting.parse(setting.default)
            continue
        try:
            values[setting.key] = setting.parse(raw)
        except (ValueError, TypeError) as exc:
            shown = "(hidden)" if setting.secret else repr(raw)
            raise ConfigError(f"{source}: invalid value {shown}: {exc}") from None
        if setting.key == "server":
            values["server_explicit"] = True
    if "state_dir" not in values:
        values["state_dir"] = default_state_dir(env)
    where = f"config file {config_file}" if config_file else "config"
    values["backends"] = _backend_specs(file_values.get("_backend_tables", []), env, where)
    values["aliases"] = _aliases(file_values.get("_aliases", {}), where)
    return Config(**values)


def _backend_specs(
    tables: list[Any], env: Mapping[str, str], where: str
) -> tuple[BackendSpec, ...]:
    """Validate the ``[[backend]]`` tables; a key_env is read from ``env`` here, once."""
    specs: list[BackendSpec] = []
    for number, table in enumerate(tables, 1):
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [[backend]] #{number} is not a table")
        name = table.get("name", f"backend-{number}")
        label = f"{where}: [[backend]] #{number}"
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{label}: name must be a non-empty string")
        name = name.strip()
        label = f"{where}: backend {name!r}"
        unknown = sorted(set(table) - set(_BACKEND_KEYS))
        if unknown:
            raise ConfigError(
                f"{label}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(_BACKEND_KEYS)})"
            )
        if "url" not in table:
            raise ConfigError(f'{label}: missing url, e.g. url = "http://127.0.0.1:11434/v1"')
        try:
            url = _url(table["url"])
        except ValueError as exc:
            raise ConfigError(f"{label}: url {table['url']!r}: {exc}") from None
        if "key" in table and "key_env" in table:
            raise ConfigError(f"{label}: give key or key_env, not both")
        key: str | None = None
        if "key" in table:
            if not isinstance(table["key"], str):
                raise ConfigError(f"{label}: key must be a string")
            key = table["key"] or None
        elif "key_env" in table:
            var = table["key_env"]
            if not isinstance(var, str) or not var:
                raise ConfigError(f"{label}: key_env must name an environment variable")
            key = env.get(var) or None
            if key is None:
                raise ConfigError(
                    f"{label}: key_env names {var}, which is not set (or empty) in the environment"
                )
        models: tuple[str, ...] = ()
        if "models" in table:
            raw = table["models"]
            if not isinstance(raw, list) or not all(isinstance(m, str) and m.strip() for m in raw):
                raise ConfigError(
                    f'{label}: models must be a list of model ids, e.g. ["qwen2.5:7b"]'
                )
            models = tuple(dict.fromkeys(m.strip() for m in raw))
        max_concurrency: int | None = None
        if "max_concurrency" in table:
            raw = table["max_concurrency"]
            if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
                raise ConfigError(
                    f"{label}: max_concurrency must be a whole number ≥ 1 (leave it out for no limit)"
                )
            max_concurrency = raw
        queue = DEFAULT_QUEUE
        if "queue" in table:
            raw = table["queue"]
            if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
                raise ConfigError(f"{label}: queue must be a whole number ≥ 0")
            queue = raw
        specs.append(BackendSpec(name, url, key, models, max_concurrency, queue))
    return tuple(specs)


def _aliases(table: Mapping[str, Any], where: str) -> dict[str, str]:
    """Validate ``[aliases]``: caller's model name -> local model name, one level deep."""
    aliases: dict[str, str] = {}
    for name, target in table.items():
        if not isinstance(target, str) or not target.strip():
            raise ConfigError(
                f'{where}: alias {name!r} must name a local model, e.g. "{name}" = "qwen2.5:7b"'
            )
        aliases[name] = target.strip()
    for name, target in aliases.items():
        if target in aliases and target != name:
            raise ConfigError(
                f"{where}: alias {name!r} points to {target!r}, which is an alias too: point it at the local model name"
            )
    return aliases
