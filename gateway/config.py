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
)
_BY_KEY = {s.key: s for s in SETTINGS}


@dataclass(frozen=True)
class Config:
    """Everything the Runner needs to know, validated once at start."""

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
    return Config(**values)
