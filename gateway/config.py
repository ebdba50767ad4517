"""Every setting declared once, and one validated ``Config`` from flags > environment > TOML > defaults.

Each runner setting is one field of ``Config`` made with ``setting(...)``: its type, default,
validation, environment names, help text and place in the docs. The command line flags
(``gateway.cli``), the environment and TOML readers (``load_config``) and the documentation
(``gateway.settings_doc``: the README table and ``config/alp-gateway.example.toml``) all come from
``SETTINGS``, which is read off those fields. Pure: no I/O beyond reading the TOML file.
"""

from __future__ import annotations

import os
import re
import socket
import ssl
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec

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


STATE_DIR_ENV = "ALP_GATEWAY_STATE_DIR"


def default_state_dir(env: Mapping[str, str]) -> Path:
    """The one state-directory rule (runner and hub): ``$ALP_GATEWAY_STATE_DIR``, else
    ``$XDG_STATE_HOME/alp-gateway``, else ``~/.local/state/alp-gateway``."""
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV]).expanduser()
    base = env.get("XDG_STATE_HOME")
    root = Path(base).expanduser() if base else Path.home() / ".local" / "state"
    return root / "alp-gateway"


def split_project(value: str) -> tuple[str, str]:
    """``OWNER/PROJECT`` -> ``(owner, project)``: the one parser of a project's name (the
    runner's setting, the hub's API keys). Spaces and slashes around it are dropped; ValueError
    when the owner or the project is missing or there is more than one ``/``."""
    owner, sep, name = value.strip().strip("/").partition("/")
    if not sep or not owner or not name or "/" in name:
        raise ValueError(f"project must look like OWNER/PROJECT, not {value!r}")
    return owner, name


def _project(value: str) -> str:
    try:
        return "/".join(split_project(value))
    except ValueError:
        raise ValueError("expected OWNER/PROJECT") from None  # the caller shows the value


def _positive_float(value: Any) -> float:
    number = float(value)
    if not number > 0:
        raise ValueError("must be > 0")
    return number


def _non_negative_float(value: Any) -> float:
    number = float(value)
    if not number >= 0:
        raise ValueError("must be >= 0")
    return number


def _http_url(value: Any) -> str:
    text = str(value).strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError("expected an http(s) URL, such as http://127.0.0.1:4318")
    return text


def _positive_int(value: Any) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("must be a whole number")
    number = int(value)
    if number < 1:
        raise ValueError("must be ≥ 1")
    return number


def _non_negative_int(value: Any) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("must be a whole number")
    number = int(value)
    if number < 0:
        raise ValueError("must be ≥ 0")
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
    """``HOST:PORT``, ``[v6]:PORT``, ``:PORT`` or a bare ``PORT`` (loopback: ``9464`` =
    ``127.0.0.1:9464``): the one listen-address parser (runner, hub and simulator)."""
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


def _path(value: Any) -> Path:
    return Path(str(value)).expanduser()


def _ca_file(value: Any) -> Path:
    """A CA file that loads: missing, unreadable or not PEM is a one-line error here, before
    any TLS connection is tried (``run``, ``register`` and ``doctor`` alike)."""
    path = _path(value)
    try:
        ssl.create_default_context().load_verify_locations(cafile=str(path))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except ssl.SSLError as exc:
        raise ValueError(
            f"{path} holds no PEM certificate ({exc.reason or exc}); give the CA's certificate "
            "in PEM (-----BEGIN CERTIFICATE-----)"
        ) from None
    except OSError as exc:  # after SSLError, which is one
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    return path


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(value: Any) -> str:
    """One of ``LOG_LEVELS`` (any case); anything else is refused, not quietly INFO."""
    level = str(value).strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"not a log level: use {', '.join(LOG_LEVELS)}")
    return level


def _model_list(value: Any) -> tuple[str, ...]:
    """A list of model ids (TOML list or comma-separated text); duplicates dropped."""
    items = _labels(value)
    return tuple(dict.fromkeys(items))


# -- the settings table ---------------------------------------------------------------------

GROUPS = {
    "server": "The ALP Server and the project this runner serves",
    "sessions": "Polling, sessions and the chat channel",
    "logs": "Logs and metrics",
    "models": "Models and backends",
}


@dataclass(frozen=True)
class Setting:
    """One runner setting: everything the flags, readers and docs need to know about it.

    ``key`` is the ``Config`` attribute and the TOML key; the flag is ``--key-with-dashes``.
    ``parse`` converts and validates a value from any source (flag text, environment text or a
    TOML value) and raises ValueError with a short reason. ``default`` is the ``Config`` field's
    default (None when it has none or a computed one); ``shown`` describes a default in words.
    """

    key: str
    env: tuple[str, ...]
    parse: Callable[[Any], Any]
    help: str
    group: str
    default: Any = None
    shown: str | None = None  # the default in words, where it is not a plain value
    metavar: str | None = None
    note: str = ""  # more lines for the example TOML file
    example: Any = None  # a value the example TOML file sets (else it shows the default)
    sample: Any = None  # a value the example TOML file shows commented out, where no default is
    secret: bool = False
    register: bool = False  # also a flag of `alp-gateway register`
    is_flag: bool = False  # a flag without a value (``store_true``)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def default_text(self) -> str:
        """The default as the help, the README and the example file say it."""
        if self.shown is not None:
            return self.shown
        return show_value(self.default)


def show_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (tuple, list)):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


def setting(
    default: Any = None,
    *,
    env: str | tuple[str, ...],
    parse: Callable[[Any], Any],
    help: str,
    group: str,
    factory: Callable[[], Any] | None = None,
    **more: Any,
) -> Any:
    """A ``Config`` field that is a setting (``more``: the other ``Setting`` attributes)."""
    envs = (env,) if isinstance(env, str) else env
    meta = {"setting": dict(env=envs, parse=parse, help=help, group=group, **more)}
    shown_in_repr = not more.get("secret", False)
    if factory is not None:
        return field(default_factory=factory, metadata=meta, repr=shown_in_repr)
    return field(default=default, metadata=meta, repr=shown_in_repr)


DEFAULT_BACKEND = "default"
DEFAULT_QUEUE = 16


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
    """Everything the Runner needs to know, validated once at start; one field per setting.

    ``backends`` lists every backend, the ``--backend`` shortcut (named "default") first;
    it is kept in step with ``backend``/``backend_key`` whenever a Config is built.
    """

    # == the Server and the project
    server: str = setting(
        "https://agentics.dk",
        env="AGENTICS_SERVER",
        parse=normalize_server,
        help="the ALP Server: a URL or a bare host (localhost gets http://, other hosts https://)",
        group="server",
        shown=DEFAULT_SERVER,
        metavar="URL",
        register=True,
        example=DEFAULT_SERVER,
    )
    project: str | None = setting(
        env=("ALP_PROJECT", "AGENTICS_PROJECT"),
        parse=_project,
        help="OWNER/PROJECT the runner registers with and serves",
        group="server",
        metavar="OWNER/PROJECT",
        register=True,
        example="acme/chat",
    )
    state_dir: Path = setting(
        env=STATE_DIR_ENV,
        parse=_path,
        factory=lambda: default_state_dir(os.environ),
        help="where the registration (runner id and token) is kept, readable by the owner only",
        group="server",
        shown="$XDG_STATE_HOME/alp-gateway, else ~/.local/state/alp-gateway",
        metavar="DIR",
        register=True,
        sample="~/.local/state/alp-gateway",
    )
    user_token: str | None = setting(
        env="AGENTICS_USER_TOKEN",
        parse=_str,
        help="a user credential, used only to register the runner; keep it out of files",
        group="server",
        metavar="TOKEN",
        secret=True,
        register=True,
        sample="…",
    )
    name: str = setting(
        env="ALP_GATEWAY_NAME",
        parse=_str,
        factory=socket.gethostname,
        help="the runner's name on the Server",
        group="server",
        shown="the host name",
        register=True,
        sample="gpu-box",
    )
    labels: tuple[str, ...] = setting(
        ("self-hosted", "linux"),
        env="ALP_GATEWAY_LABELS",
        parse=_labels,
        help="the runner's labels (comma-separated in a flag or the environment)",
        group="server",
        metavar="A,B",
        register=True,
        example=("self-hosted", "linux", "gpu"),
    )
    ca_file: Path | None = setting(
        env="ALP_GATEWAY_CA_FILE",
        parse=_ca_file,
        help="a CA certificate (PEM) to trust for the Server besides the system's",
        group="server",
        shown="system CAs only",
        metavar="PEM",
        register=True,
        sample="/etc/ssl/private-ca.pem",
    )
    # == polling, sessions and the chat channel
    poll_interval: float = setting(
        10.0,
        env="ALP_GATEWAY_POLL_INTERVAL",
        parse=_positive_float,
        help="seconds between polls for jobs (push events make this mostly moot)",
        group="sessions",
        metavar="S",
    )
    max_sessions: int = setting(
        64,
        env="ALP_GATEWAY_MAX_SESSIONS",
        parse=_positive_int,
        help="chat sessions served at once; at the limit chat-llm:v1 is no longer advertised",
        group="sessions",
        metavar="N",
    )
    reconnect_window: float = setting(
        60.0,
        env="ALP_GATEWAY_RECONNECT_WINDOW",
        parse=_positive_float,
        help="seconds to keep redialling a dropped chat channel before the job is reported failed",
        group="sessions",
        metavar="S",
    )
    grace: float = setting(
        30.0,
        env="ALP_GATEWAY_GRACE",
        parse=_positive_float,
        help="seconds in-flight turns get to finish at shutdown (a second signal stops at once)",
        group="sessions",
        metavar="S",
    )
    heartbeat_interval: float = setting(
        20.0,
        env="ALP_GATEWAY_HEARTBEAT",
        parse=_positive_float,
        help="seconds between progress heartbeats (the Server deems a runner gone after 60 s)",
        group="sessions",
        metavar="S",
    )
    connect_timeout: float = setting(
        10.0,
        env="ALP_GATEWAY_CONNECT_TIMEOUT",
        parse=_positive_float,
        help="seconds for a connect or handshake (Server, channel, backend)",
        group="sessions",
        metavar="S",
    )
    idle_timeout: float = setting(
        600.0,
        env="ALP_GATEWAY_IDLE_TIMEOUT",
        parse=_positive_float,
        help="seconds a backend may stay silent mid-answer (never a limit on the whole answer)",
        group="sessions",
        metavar="S",
    )
    ping_interval: float = setting(
        20.0,
        env="ALP_GATEWAY_PING_INTERVAL",
        parse=_non_negative_float,
        help="seconds between WebSocket pings on each chat channel, which keep NAT mappings "
        "alive and find a dead path (0: off)",
        group="sessions",
        metavar="S",
    )
    ping_timeout: float | None = setting(
        env="ALP_GATEWAY_PING_TIMEOUT",
        parse=_positive_float,
        help="seconds a pinged channel may stay silent before it counts as dropped and is redialled",
        group="sessions",
        shown="the ping interval",
        metavar="S",
        sample=20,
    )
    resume_buffer: int = setting(
        MiB,
        env="ALP_GATEWAY_RESUME_BUFFER",
        parse=_non_negative_int,
        help="bytes of recent frames kept per chat channel, so that a Server with the resume "
        "extension gets an answer whole across a dropped channel (0: no resume)",
        group="sessions",
        metavar="BYTES",
    )
    resume_window: float = setting(
        30.0,
        env="ALP_GATEWAY_RESUME_WINDOW",
        parse=_positive_float,
        help="seconds the turns of a dropped chat channel go on for a redial that resumes them "
        "(the resume extension); then they are cancelled",
        group="sessions",
        metavar="S",
    )
    max_frame_size: int = setting(
        16 * MiB,
        env="ALP_GATEWAY_MAX_FRAME_SIZE",
        parse=_positive_int,
        help="largest channel frame accepted from the Server, in bytes",
        group="sessions",
        metavar="BYTES",
    )
    # == logs and metrics
    log_format: str = setting(
        "text",
        env="ALP_GATEWAY_LOG_FORMAT",
        parse=_log_format,
        help="text or json",
        group="logs",
        metavar="FORMAT",
        register=True,
    )
    log_level: str = setting(
        "INFO",
        env="ALP_GATEWAY_LOG_LEVEL",
        parse=_log_level,
        help="DEBUG, INFO, WARNING or ERROR",
        group="logs",
        metavar="LEVEL",
        register=True,
    )
    verbose_frames: bool = setting(
        False,
        env="ALP_GATEWAY_VERBOSE_FRAMES",
        parse=_bool,
        help="log every channel frame, cut short and with credentials redacted",
        group="logs",
        is_flag=True,
    )
    metrics_listen: tuple[str, int] | None = setting(
        env="ALP_GATEWAY_METRICS_LISTEN",
        parse=parse_listen,
        help="serve /healthz, /livez and /metrics on [HOST:]PORT (a bare port binds 127.0.0.1)",
        group="logs",
        shown="off",
        metavar="[HOST:]PORT",
        sample="127.0.0.1:9464",
    )
    otlp_endpoint: str | None = setting(
        env="ALP_GATEWAY_OTLP_ENDPOINT",
        parse=_http_url,
        help="send traces over OTLP/HTTP to this collector (a base URL; the standard "
        "OTEL_EXPORTER_OTLP_ENDPOINT works too)",
        group="logs",
        shown="off",
        metavar="URL",
        sample="http://127.0.0.1:4318",
    )
    # == models and backends
    model: str | None = setting(
        env="CHAT_LLM_MODEL",
        parse=_str,
        help="the model a turn gets when neither its frame nor its body names one",
        group="models",
        shown="the body's model",
        metavar="ID",
        example="qwen2.5:7b",
    )
    allowed_models: tuple[str, ...] = setting(
        (),
        env="ALP_GATEWAY_ALLOWED_MODELS",
        parse=_model_list,
        help="only these models may be used (caller or local names; comma-separated in a flag)",
        group="models",
        shown="every model",
        metavar="A,B",
        note="Enforced on every turn (a refused turn never reaches a backend) and on "
        "chat.models.response.",
        example=("qwen2.5:7b", "llama3.2:3b", "gpt-4o-mini"),
    )
    health_interval: float = setting(
        30.0,
        env="ALP_GATEWAY_HEALTH_INTERVAL",
        parse=_positive_float,
        help="seconds between health probes (GET {url}/models) of each backend",
        group="models",
        metavar="S",
        note="A turn that cannot connect triggers a probe at once. A backend that fails is skipped "
        "until it answers again; while no backend is up chat-llm:v1 is not advertised.",
    )
    models_refresh: float = setting(
        300.0,
        env="ALP_GATEWAY_MODELS_REFRESH",
        parse=_positive_float,
        help="seconds between refreshes of the model lists of backends that declare none",
        group="models",
        metavar="S",
    )
    models_cache: float = setting(
        30.0,
        env="ALP_GATEWAY_MODELS_CACHE",
        parse=_positive_float,
        help="seconds a chat.models.request may be answered from the cached model lists",
        group="models",
        metavar="S",
    )
    backend: str | None = setting(
        env="CHAT_LLM_BACKEND_URL",
        parse=_url,
        help="one-backend shortcut: its base URL including /v1 (a backend named default)",
        group="models",
        metavar="URL",
        note="It comes before the [[backend]] tables.",
        sample="http://127.0.0.1:11434/v1",
    )
    backend_key: str | None = setting(
        env="CHAT_LLM_BACKEND_KEY",
        parse=_str,
        help="the API key of --backend; it never leaves this machine",
        group="models",
        metavar="KEY",
        secret=True,
        sample="…",
    )
    # -- not settings of their own: the [[backend]] and [aliases] tables, and where server came from
    server_explicit: bool = False
    backends: tuple[BackendSpec, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict, hash=False)

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


def _settings() -> tuple[Setting, ...]:
    out = []
    for f in fields(Config):
        meta = f.metadata.get("setting")
        if meta is not None:
            default = None if f.default is MISSING else f.default
            out.append(Setting(key=f.name, default=default, **meta))
    return tuple(out)


SETTINGS: tuple[Setting, ...] = _settings()
_BY_KEY = {s.key: s for s in SETTINGS}


# -- the TOML file ----------------------------------------------------------------------------

_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class BackendTable(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One ``[[backend]]`` table as written in the file (checked by msgspec, then by ``_spec``)."""

    url: str
    name: _NonEmpty | None = None
    key: str | None = None
    key_env: _NonEmpty | None = None
    models: list[_NonEmpty] | None = None
    max_concurrency: Annotated[int, msgspec.Meta(ge=1)] | None = None
    queue: Annotated[int, msgspec.Meta(ge=0)] = DEFAULT_QUEUE


_BACKEND_KEYS = tuple(BackendTable.__struct_fields__)
_BACKEND_HINTS = {
    "url": 'url must be an http(s) URL such as "http://127.0.0.1:11434/v1"',
    "name": "name must be a non-empty string",
    "key": "key must be a string",
    "key_env": "key_env must name an environment variable",
    "models": 'models must be a list of model ids, e.g. ["qwen2.5:7b"]',
    "max_concurrency": "max_concurrency must be a whole number ≥ 1 (leave it out for no limit)",
    "queue": "queue must be a whole number ≥ 0",
}
_TABLES = ("[[backend]]", "[aliases]")
_AT = re.compile(r" - at `\$\.?([A-Za-z_]*)[^`]*`$")


@dataclass(frozen=True)
class FileSettings:
    """What a TOML file holds: plain settings by key, the ``[[backend]]`` and ``[aliases]`` tables."""

    values: dict[str, Any]
    backends: tuple[BackendTable, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)


def read_toml(path: Path) -> FileSettings:
    """Read and check ``path``: an unknown key or table is an error naming the file and the key."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    where = f"config file {path}"
    values: dict[str, Any] = {}
    backends: tuple[BackendTable, ...] = ()
    aliases: dict[str, str] = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        if norm == "backend" and not isinstance(value, str):
            if not isinstance(value, list):
                raise ConfigError(
                    f"{where}: write backends as [[backend]] tables (an array), not [backend]"
                )
            backends = tuple(_backend_table(where, n, t) for n, t in enumerate(value, 1))
        elif norm == "aliases":
            aliases = _aliases(value, where)
        elif norm in _BY_KEY:
            values[norm] = value
        elif isinstance(value, dict):
            raise ConfigError(
                f"{where}: unknown table [{key}] (known tables: {', '.join(_TABLES)})"
            )
        else:
            raise ConfigError(f"{where}: unknown setting {key!r}")
    return FileSettings(values, backends, aliases)


def _backend_table(where: str, number: int, table: Any) -> BackendTable:
    label = f"{where}: [[backend]] #{number}"
    if not isinstance(table, dict):
        raise ConfigError(f"{label} is not a table")
    if isinstance(table.get("name"), str) and table["name"].strip():
        label = f"{where}: backend {table['name'].strip()!r}"
    try:
        return msgspec.convert(table, BackendTable)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if text.startswith("Object missing required field `url`"):
            problem = 'missing url, e.g. url = "http://127.0.0.1:11434/v1"'
        elif text.startswith("Object contains unknown field"):
            unknown = sorted(set(table) - set(_BACKEND_KEYS))
            problem = f"unknown setting(s) {', '.join(unknown)} (known: {', '.join(_BACKEND_KEYS)})"
        else:
            at = _AT.search(text)
            problem = _BACKEND_HINTS.get(at.group(1), text) if at else text
        raise ConfigError(f"{label}: {problem}") from None


def _aliases(table: Any, where: str) -> dict[str, str]:
    """``[aliases]``: caller's model name -> local model name, one level deep."""
    if not isinstance(table, dict):
        raise ConfigError(
            f'{where}: aliases must be a table: [aliases] then "name" = "local-model"'
        )
    aliases: dict[str, str] = {}
    for name, target in table.items():
        try:
            aliases[name] = msgspec.convert(target, _NonEmpty).strip()
        except msgspec.ValidationError:
            aliases[name] = ""
        if not aliases[name]:
            raise ConfigError(
                f'{where}: alias {name!r} must name a local model, e.g. "{name}" = "qwen2.5:7b"'
            )
    for name, target in aliases.items():
        if target in aliases and target != name:
            raise ConfigError(
                f"{where}: alias {name!r} points to {target!r}, which is an alias too: "
                "point it at the local model name"
            )
    return aliases


def _spec(table: BackendTable, number: int, env: Mapping[str, str], where: str) -> BackendSpec:
    """A ``[[backend]]`` table as a ``BackendSpec``; a key_env is read from ``env`` here, once."""
    name = (table.name or f"backend-{number}").strip()
    label = f"{where}: backend {name!r}"
    try:
        url = _url(table.url)
    except ValueError as exc:
        raise ConfigError(f"{label}: url {table.url!r}: {exc}") from None
    if table.key is not None and table.key_env is not None:
        raise ConfigError(f"{label}: give key or key_env, not both")
    key = table.key or None
    if table.key_env is not None:
        key = env.get(table.key_env) or None
        if key is None:
            raise ConfigError(
                f"{label}: key_env names {table.key_env}, which is not set (or empty) in the "
                "environment"
            )
    models = tuple(dict.fromkeys(m.strip() for m in table.models or ()))
    return BackendSpec(name, url, key, models, table.max_concurrency, table.queue)


# -- merging ----------------------------------------------------------------------------------


def setting_flags(args: object) -> dict[str, Any]:
    """The settings given on the command line, an argparse namespace (None where a flag was not
    given)."""
    return {s.key: getattr(args, s.key, None) for s in SETTINGS}


def load_config(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
) -> Config:
    """Merge ``flags`` (None = not given) > ``env`` > TOML file > defaults and validate."""
    file = read_toml(config_file) if config_file else FileSettings({})
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw: Any = None
        source = ""
        if flags.get(s.key) is not None:
            raw, source = flags[s.key], s.flag
        else:
            for name in s.env:
                if env.get(name):
                    raw, source = env[name], name
                    break
            else:
                if s.key in file.values:
                    raw, source = file.values[s.key], f"{s.key} in {config_file}"
        if raw is None:
            continue  # the Config field's default
        try:
            values[s.key] = s.parse(raw)
        except (ValueError, TypeError) as exc:
            shown = "(hidden)" if s.secret else repr(raw)
            raise ConfigError(f"{source}: invalid value {shown}: {exc}") from None
    values["server_explicit"] = "server" in values
    values.setdefault("state_dir", default_state_dir(env))
    where = f"config file {config_file}" if config_file else "config"
    values["backends"] = tuple(
        _spec(table, n, env, where) for n, table in enumerate(file.backends, 1)
    )
    values["aliases"] = file.aliases
    return Config(**values)
