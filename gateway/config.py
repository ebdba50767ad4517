"""Every setting declared once, and one validated ``Config`` from flags > environment > TOML > defaults.

Each runner setting is one field of ``Config``, each hub setting one field of ``HubSettings``,
made with ``setting(...)``: its type, default, validation, environment names, help text and place
in the docs. The command line flags and their help (``add_flags``, used by ``gateway.cli`` and
``gateway.hub.cli``), the environment and TOML readers (``load_config``,
``load_hub_settings``) and the documentation (``gateway.ops.settings_doc``: the README tables,
``config/alp-gateway.example.toml`` and ``config/hub.example.toml``) all come from ``SETTINGS``
and ``HUB_SETTINGS``, which are read off those fields: adding a setting is adding one field.
Pure: no I/O beyond reading the TOML file.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import ssl
import tomllib
from collections.abc import Callable, Iterable, Mapping
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


def _non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError("must be a whole number")
    number = int(value)
    if number < 0:
        raise ValueError("must be ≥ 0")
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


def _urls(value: Any) -> tuple[str, ...]:
    """One URL, several (a flag given again, a TOML list) or a comma-separated list; each checked
    as ``_url`` does, duplicates dropped."""
    items = value if isinstance(value, (list, tuple)) else [value]
    urls = [_url(part) for item in items for part in str(item).split(",") if part.strip()]
    return tuple(dict.fromkeys(urls))


def _projects(value: Any) -> tuple[str, ...]:
    """OWNER/PROJECT names (a TOML list or comma-separated text), each checked."""
    return tuple(dict.fromkeys(_project(item) for item in _labels(value)))


def _log_format(value: Any) -> str:
    text = str(value)
    if text not in ("text", "json"):
        raise ValueError("expected text or json")
    return text


TIERS = ("primary", "fallback")


def _tier(value: Any) -> str:
    text = str(value).strip().lower()
    if text not in TIERS:
        raise ValueError("expected primary or fallback")
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


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")


def parse_duration(value: Any) -> float:
    """``30m``, ``24h``, ``7d``, ``90s`` (or a number of seconds) as seconds, > 0; the one
    duration parser (the hub's ``usage_retention``, ``hub usage --since``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        found = _DURATION.fullmatch(str(value))
        if found is None:
            raise ValueError("not a duration such as 30m, 24h or 7d")
        seconds = float(found[1]) * _UNITS[found[2] or "s"]
    if not seconds > 0:
        raise ValueError("not a duration such as 30m, 24h or 7d (it must be more than 0)")
    return seconds


def _str(value: Any) -> str:
    return str(value)


def _currency(value: Any) -> str:
    text = str(value).strip()
    if not text or len(text) > 16 or not text.isprintable():
        raise ValueError("not a currency's name such as USD or EUR (1 to 16 printable characters)")
    return text


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
    """One setting (the runner's or the hub's): everything the flags, readers and docs need.

    ``key`` is the ``Config`` (or ``HubSettings``) attribute and the TOML key; the flag is
    ``--key-with-dashes``.
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
    repeat: bool = False  # the flag may be given again: every value is kept (``parse`` gets a list)
    aliases: tuple[str, ...] = ()  # other flags that set it (old names)

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

    ``backends`` lists every backend, those of ``--backend`` first (named "default",
    "default-2", …); it is kept in step with ``backend``/``backend_key`` whenever a Config is
    built.
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
    tier: str = setting(
        "primary",
        env="ALP_GATEWAY_TIER",
        parse=_tier,
        help="primary, or fallback: a fallback runner (a hosted API's, say) gets a new session "
        "only when no primary runner of the project can serve its model (the hub's rule)",
        group="server",
        metavar="TIER",
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
        help="seconds a chat channel may be quiet before it is pinged (the Server's messages "
        "and pings count: a busy channel sends none), which keeps NAT mappings alive and finds "
        "a dead path (0: off)",
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
    backend: tuple[str, ...] = setting(
        (),
        env="CHAT_LLM_BACKEND_URL",
        parse=_urls,
        help="a backend's base URL including /v1; given again, each URL is one more backend of "
        "the pool (named default, default-2, …; a TOML list or comma-separated elsewhere)",
        group="models",
        shown="none",
        metavar="URL",
        note="They come before the [[backend]] tables.",
        sample="http://127.0.0.1:11434/v1",
        repeat=True,
    )
    backend_key: str | None = setting(
        env="CHAT_LLM_BACKEND_KEY",
        parse=_str,
        help="the API key of --backend (one --backend only: give several backends their keys in "
        "[[backend]] tables); it never leaves this machine",
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
        urls: Any = self.backend
        urls = (urls,) if isinstance(urls, str) else tuple(urls or ())  # Config(backend="…")
        object.__setattr__(self, "backend", urls)
        if len(urls) > 1 and self.backend_key:
            raise ConfigError(
                f"--backend-key with {len(urls)} --backend URLs: which backend the key is for is "
                "not clear; give each backend its key in a [[backend]] table (key or key_env)"
            )
        shortcuts = [
            BackendSpec(_shortcut_name(n), url, self.backend_key, shortcut=True)
            for n, url in enumerate(urls, 1)
        ]
        declared = shortcuts + [b for b in self.backends if not b.shortcut]
        seen: set[str] = set()
        for spec in declared:
            if spec.name in seen:
                extra = (
                    " (--backend makes backends named default, default-2, …)"
                    if spec.name.startswith(DEFAULT_BACKEND)
                    else ""
                )
                raise ConfigError(
                    f"backend name {spec.name!r} is used twice{extra}: names must be unique"
                )
            seen.add(spec.name)
        object.__setattr__(self, "backends", tuple(declared))
        object.__setattr__(self, "aliases", dict(self.aliases))
        object.__setattr__(self, "allowed_models", tuple(self.allowed_models))


def _shortcut_name(number: int) -> str:
    """The name of the ``number``-th ``--backend`` URL's backend: default, default-2, …"""
    return DEFAULT_BACKEND if number == 1 else f"{DEFAULT_BACKEND}-{number}"


def _settings(declared: type) -> tuple[Setting, ...]:
    """The ``Setting`` of each field of ``declared`` made with ``setting(...)``, in order."""
    out = []
    for f in fields(declared):
        meta = f.metadata.get("setting")
        if meta is not None:
            default = None if f.default is MISSING else f.default
            out.append(Setting(key=f.name, default=default, **meta))
    return tuple(out)


SETTINGS: tuple[Setting, ...] = _settings(Config)
_BY_KEY = {s.key: s for s in SETTINGS}


# -- the hub's settings -----------------------------------------------------------------------

HUB_GROUPS = {
    "hub": "Where the hub serves, its data directory, its store and its logs",
    "hub-replicas": "Replicas: several hubs on one PostgreSQL store, behind a load balancer",
    "hub-runners": "Runners and their Chat Channels",
    "hub-frontdoor": "The front door: sessions, the fair queue, models, usage",
    "hub-bounds": "The server's bounds",
    "hub-people": "People: sign-in to the status page with OpenID Connect",
}


STORE_POOL = 4  # connections to a --store database at most, by default
_STORE_SCHEMES = ("postgresql", "postgres")


def parse_store(value: Any) -> str:
    """A PostgreSQL URL (``postgresql://`` or ``postgres://``); the error never repeats the
    value (it may hold a password)."""
    text = str(value).strip()
    if text.partition("://")[0].lower() not in _STORE_SCHEMES or "://" not in text:
        raise ValueError(
            "not a PostgreSQL URL: give postgresql://USER@HOST:PORT/DATABASE (or leave it out "
            "for SQLite in the data directory)"
        )
    return text


_REPLICA_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _replica_id(value: Any) -> str:
    text = str(value).strip()
    if not _REPLICA_ID.fullmatch(text):
        raise ValueError("expected 1 to 64 letters, digits, '.', '_' or '-'")
    return text


MIN_TEAM_SECRET = 32  # characters of a team secret at least


def parse_team_secrets(value: Any) -> tuple[str, ...]:
    """One or two team secrets (comma-separated, or a line each in a file's text): the first
    signs, each is accepted. The error never repeats a secret."""
    found = tuple(p.strip() for p in str(value).replace("\n", ",").split(",") if p.strip())
    if not 1 <= len(found) <= 2:
        raise ValueError("expected one team secret, or two (the new one first) while rotating")
    if any(len(secret) < MIN_TEAM_SECRET for secret in found):
        raise ValueError(
            f"a team secret must be {MIN_TEAM_SECRET} characters or more (say, "
            "`openssl rand -hex 32`)"
        )
    return found


def default_hub_data(env: Mapping[str, str]) -> Path:
    """The hub's data directory unless told otherwise: ``hub`` in ``default_state_dir(env)``."""
    return default_state_dir(env) / "hub"


@dataclass
class HubSettings:
    """Every hub setting, one field each (made with ``setting(...)``, as ``Config``'s are).

    Every part of the hub reads the one ``HubSettings`` it was given when it needs a value, so a
    change applies at once. ``listen``, ``data``, ``store``, ``tls_*`` and ``log_*`` are the
    ``hub`` command's (``gateway.hub.cli``); the rest are the hub's own.
    """

    # == where it serves, its data and its logs
    listen: tuple[str, int] = setting(
        ("127.0.0.1", 8787),
        env="ALP_GATEWAY_HUB_LISTEN",
        parse=parse_listen,
        help="HOST:PORT to serve on: runners, the /v1 front door, the status page (a bare port "
        "binds 127.0.0.1)",
        group="hub",
        shown="127.0.0.1:8787",
        metavar="HOST:PORT",
        sample="127.0.0.1:8787",
    )
    data: Path = setting(
        env="ALP_GATEWAY_HUB_DATA",
        parse=_path,
        factory=lambda: default_hub_data(os.environ),
        help="the hub's data directory: hub.sqlite3 (runners, API keys, jobs, sessions, usage; "
        "unless --store) and the admin credential, owner-only; `hub keys` and `hub usage` work "
        "on it",
        group="hub",
        shown="$ALP_GATEWAY_STATE_DIR/hub, else $XDG_STATE_HOME/alp-gateway/hub, else "
        "~/.local/state/alp-gateway/hub",
        metavar="DIR",
        sample="~/.local/state/alp-gateway/hub",
    )
    store: str | None = setting(
        env="ALP_GATEWAY_HUB_STORE",
        parse=parse_store,
        help="keep runners, API keys, jobs, sessions, usage and the admin credential's hash in "
        "this PostgreSQL database (postgresql://USER@HOST:PORT/DATABASE), which several hubs "
        "can share, instead of SQLite in the data directory; `hub keys` and `hub usage` take "
        "it too. A password in it is never printed (PGPASSWORD or ~/.pgpass keep it out of "
        "the URL)",
        group="hub",
        shown="SQLite in the data directory",
        metavar="URL",
        sample="postgresql://alp@db.example:5432/hub",
        secret=True,
    )
    store_pool: int = setting(
        STORE_POOL,
        env="ALP_GATEWAY_HUB_STORE_POOL",
        parse=_positive_int,
        help="connections this hub keeps to the --store database at most (a call waits for one "
        "when all are busy)",
        group="hub",
        metavar="N",
    )
    tls_cert: Path | None = setting(
        env="ALP_GATEWAY_HUB_TLS_CERT",
        parse=_path,
        help="serve HTTPS and WSS only, with this certificate (chain) file; needs --tls-key",
        group="hub",
        shown="plain HTTP",
        metavar="PEM",
        sample="/etc/alp-gateway/hub.crt",
    )
    tls_key: Path | None = setting(
        env="ALP_GATEWAY_HUB_TLS_KEY",
        parse=_path,
        help="the private key of --tls-cert",
        group="hub",
        metavar="PEM",
        sample="/etc/alp-gateway/hub.key",
    )
    log_format: str = setting(
        "text",
        env="ALP_GATEWAY_LOG_FORMAT",
        parse=_log_format,
        help="text or json (the runner's format and variable)",
        group="hub",
        metavar="FORMAT",
    )
    log_level: str = setting(
        "INFO",
        env="ALP_GATEWAY_LOG_LEVEL",
        parse=_log_level,
        help="DEBUG, INFO, WARNING or ERROR",
        group="hub",
        metavar="LEVEL",
    )
    # == runners and their Chat Channels
    advertise: str | None = setting(
        env="ALP_GATEWAY_HUB_ADVERTISE",
        parse=_url,
        help="with --store: the URL the other replicas reach this hub at (its own address, not "
        "the load balancer's); turns whose session's channel is here are forwarded to it",
        group="hub-replicas",
        shown="http://HOST:PORT of --listen (this machine's host name when it listens on every "
        "address)",
        metavar="URL",
        sample="http://10.0.0.5:8787",
    )
    team_secret: tuple[str, ...] | None = setting(
        env="ALP_GATEWAY_HUB_TEAM_SECRET",
        parse=parse_team_secrets,
        help="with --store: the secret every replica signs its internal requests with (the same "
        "on each, 32 characters or more; nothing in the store gives it). Two, comma-separated, "
        "are both accepted while it is rotated: the first signs. --team-secret-file keeps it out "
        "of the environment",
        group="hub-replicas",
        shown="none: no other replica reaches this one's channels",
        metavar="SECRET[,OLD]",
        sample="REPLACE-with-the-output-of-openssl-rand-hex-32",
        secret=True,
    )
    team_secret_file: Path | None = setting(
        env="ALP_GATEWAY_HUB_TEAM_SECRET_FILE",
        parse=_path,
        help="with --store: a file (owner-only) holding the team secret, or two on two lines "
        "while it is rotated (as --team-secret); read at start",
        group="hub-replicas",
        metavar="FILE",
        sample="/run/secrets/alp-team-secret",
    )
    replica_id: str | None = setting(
        env="ALP_GATEWAY_HUB_REPLICA_ID",
        parse=_replica_id,
        help="with --store: this replica's name among the hubs on the store (letters, digits, "
        "'.', '_', '-'; up to 64)",
        group="hub-replicas",
        shown="made at the first start and kept in DATA/replica-id",
        metavar="NAME",
        sample="hub-1",
    )
    offline_after: float = setting(
        60.0,
        env="ALP_GATEWAY_HUB_OFFLINE_AFTER",
        parse=_positive_float,
        help="seconds without a sign of life from a runner (a poll, a heartbeat, a frame or a "
        "channel's pong) before it counts as gone and its jobs are ended",
        group="hub-runners",
        metavar="S",
    )
    reoffer_after: float = setting(
        10.0,
        env="ALP_GATEWAY_HUB_REOFFER_AFTER",
        parse=_positive_float,
        help="seconds after which a claimed job its runner has not started is offered to that "
        "runner again",
        group="hub-runners",
        metavar="S",
    )
    ping_interval: float = setting(
        20.0,
        env="ALP_GATEWAY_HUB_PING_INTERVAL",
        parse=_non_negative_float,
        help="a Chat Channel quiet for 1.5 times this many seconds is pinged (the runner's "
        "messages and pings count: a runner that pings every interval is not pinged back) (0: off)",
        group="hub-runners",
        metavar="S",
    )
    ping_timeout: float | None = setting(
        env="ALP_GATEWAY_HUB_PING_TIMEOUT",
        parse=_positive_float,
        help="seconds a pinged channel may stay silent before it is closed as dead and its turns "
        "move",
        group="hub-runners",
        shown="the ping interval",
        metavar="S",
        sample=20,
    )
    first_frame_timeout: float = setting(
        300.0,
        env="ALP_GATEWAY_HUB_FIRST_FRAME_TIMEOUT",
        parse=_positive_float,
        help="with pings off, seconds a turn waits for its runner's first frame",
        group="hub-runners",
        metavar="S",
    )
    reconnect_timeout: float = setting(
        10.0,
        env="ALP_GATEWAY_HUB_RECONNECT_TIMEOUT",
        parse=_positive_float,
        help="seconds a turn waits for a dropped channel's redial when no other runner is free",
        group="hub-runners",
        metavar="S",
    )
    resume_within: float = setting(
        5.0,
        env="ALP_GATEWAY_HUB_RESUME_WITHIN",
        parse=_non_negative_float,
        help="seconds a turn that has begun its answer waits for its dropped channel's redial to "
        "resume it byte for byte, before it is continued on another runner (0: at once)",
        group="hub-runners",
        metavar="S",
    )
    keepalive_interval: float = setting(
        15.0,
        env="ALP_GATEWAY_HUB_KEEPALIVE_INTERVAL",
        parse=_positive_float,
        help="seconds between SSE keepalives: the runners' event stream, waiting and streamed "
        "turns",
        group="hub-runners",
        metavar="S",
    )
    # == the front door
    runner_wait_timeout: float = setting(
        30.0,
        env="ALP_GATEWAY_HUB_RUNNER_WAIT_TIMEOUT",
        parse=_positive_float,
        help="seconds a new chat session's first turn waits for a runner to take its job",
        group="hub-frontdoor",
        metavar="S",
    )
    session_idle_timeout: float = setting(
        600.0,
        env="ALP_GATEWAY_HUB_SESSION_IDLE_TIMEOUT",
        parse=_non_negative_float,
        help="seconds a chat session may stay idle before its job is ended (0: never)",
        group="hub-frontdoor",
        metavar="S",
    )
    max_sessions_per_key: int = setting(
        16,
        env="ALP_GATEWAY_HUB_MAX_SESSIONS_PER_KEY",
        parse=_non_negative_int,
        help="chat sessions one API key may hold: past it the key's least recently used idle "
        "session is ended, or 429 when all are busy (0: no bound)",
        group="hub-frontdoor",
        metavar="N",
    )
    queue_length: int = setting(
        64,
        env="ALP_GATEWAY_HUB_QUEUE_LENGTH",
        parse=_non_negative_int,
        help="when every runner that could serve a new session is at capacity, at most this many "
        "requests wait in the project's fair queue; one more gets 503 queue_full (0: none wait)",
        group="hub-frontdoor",
        metavar="N",
    )
    queue_wait: float = setting(
        10.0,
        env="ALP_GATEWAY_HUB_QUEUE_WAIT",
        parse=_non_negative_float,
        help="seconds a request waits in that queue, then 503 queue_timeout with Retry-After "
        "(--capacity-wait: its old name)",
        group="hub-frontdoor",
        metavar="S",
        aliases=("--capacity-wait",),
    )
    models_wait: float = setting(
        15.0,
        env="ALP_GATEWAY_HUB_MODELS_WAIT",
        parse=_positive_float,
        help="seconds GET /v1/models waits for the model lists of live runners not known yet "
        "(it answers with all of them together)",
        group="hub-frontdoor",
        metavar="S",
    )
    models_timeout: float = setting(
        3.0,
        env="ALP_GATEWAY_HUB_MODELS_TIMEOUT",
        parse=_positive_float,
        help="seconds GET /v1/models waits for an open channel's answer",
        group="hub-frontdoor",
        metavar="S",
    )
    default_model: str | None = setting(
        env="ALP_GATEWAY_HUB_DEFAULT_MODEL",
        parse=_str,
        help="serve a request for a model no runner lists with this one instead of a 404 (for "
        "clients with fixed model names, such as Claude Code's claude-*)",
        group="hub-frontdoor",
        shown="the 404",
        metavar="MODEL",
        sample="qwen2.5:7b",
    )
    count_usage: bool = setting(
        True,
        env="ALP_GATEWAY_HUB_COUNT_USAGE",
        parse=_bool,
        help="ask for usage on every streamed chat turn (kept from a client that did not ask), "
        "so that every turn's tokens are counted",
        group="hub-frontdoor",
        metavar="on|off",
    )
    key_check_interval: float = setting(
        5.0,
        env="ALP_GATEWAY_HUB_KEY_CHECK_INTERVAL",
        parse=_positive_float,
        help="seconds within which a running hub honours an API key revoked or limits changed "
        "by another process (`hub keys`)",
        group="hub-frontdoor",
        metavar="S",
    )
    usage_retention: float = setting(
        7 * 86400.0,
        env="ALP_GATEWAY_HUB_USAGE_RETENTION",
        parse=parse_duration,
        help="how long each front-door turn's usage row is kept (30m, 24h, 7d); the hourly "
        "totals per key and model are kept for good",
        group="hub-frontdoor",
        shown="7d",
        metavar="DURATION",
        sample="7d",
    )
    token_reservation: int = setting(
        1024,
        env="ALP_GATEWAY_HUB_TOKEN_RESERVATION",
        parse=_positive_int,
        help="tokens a turn that names no max_tokens holds against its API key's token limits "
        "(tpm, tokens_per_day) while in flight, settled to what it used at its end",
        group="hub-frontdoor",
        metavar="TOKENS",
    )
    currency: str = setting(
        "USD",
        env="ALP_GATEWAY_HUB_CURRENCY",
        parse=_currency,
        help="the currency of model prices (`hub prices set`), turns' costs and API keys' budgets",
        group="hub-frontdoor",
        metavar="CODE",
    )
    priority_promote_after: float = setting(
        30.0,
        env="ALP_GATEWAY_HUB_PRIORITY_PROMOTE_AFTER",
        parse=_positive_float,
        help="seconds a turn of a lower priority class waits in the queue before it is served "
        "as one class higher (again after as many more): no class starves",
        group="hub-frontdoor",
        metavar="S",
    )
    channel_backlog: int = setting(
        8 * MiB,
        env="ALP_GATEWAY_HUB_CHANNEL_BACKLOG",
        parse=_positive_int,
        help="bytes of requests that may wait unsent on one Chat Channel whose runner reads "
        "slowly or not at all; a turn past it gets 503 runner_busy at once (one request alone "
        "always goes)",
        group="hub-frontdoor",
        metavar="BYTES",
    )
    client_backlog: int = setting(
        MiB,
        env="ALP_GATEWAY_HUB_CLIENT_BACKLOG",
        parse=_positive_int,
        help="bytes a streaming client may fall behind its turn before that turn alone is ended",
        group="hub-frontdoor",
        metavar="BYTES",
    )
    # == the server's bounds
    head_timeout: float = setting(
        10.0,
        env="ALP_GATEWAY_HUB_HEAD_TIMEOUT",
        parse=_positive_float,
        help="seconds for a request head (or a TLS handshake) to arrive, else the connection is "
        "closed (on a kept-alive connection, from its first byte)",
        group="hub-bounds",
        metavar="S",
    )
    keepalive_timeout: float = setting(
        30.0,
        env="ALP_GATEWAY_HUB_KEEPALIVE_TIMEOUT",
        parse=_positive_float,
        help="seconds a kept-alive connection waits for its next request (longer than a runner's "
        "poll interval, so that a fleet's polls reuse their connections), else it is closed",
        group="hub-bounds",
        metavar="S",
    )
    body_timeout: float = setting(
        60.0,
        env="ALP_GATEWAY_HUB_BODY_TIMEOUT",
        parse=_positive_float,
        help="seconds for a request body to arrive after its head, else 408 and closed",
        group="hub-bounds",
        metavar="S",
    )
    max_body: int = setting(
        16 * MiB,
        env="ALP_GATEWAY_HUB_MAX_BODY",
        parse=_positive_int,
        help="largest request body and WebSocket message, in bytes (413 or close 1009 past it)",
        group="hub-bounds",
        metavar="BYTES",
    )
    max_connections: int = setting(
        16384,
        env="ALP_GATEWAY_HUB_MAX_CONNECTIONS",
        parse=_positive_int,
        help="open connections at most, runners' and clients' together (and within the file "
        "limit, raised to its hard limit at start); one more gets 503 and is closed",
        group="hub-bounds",
        metavar="N",
    )
    max_runner_connections: int = setting(
        12288,
        env="ALP_GATEWAY_HUB_MAX_RUNNER_CONNECTIONS",
        parse=_positive_int,
        help="runners' requests and channels in progress at most (a channel per session, a push "
        "stream and a poll per runner); one more gets 503 at once",
        group="hub-bounds",
        metavar="N",
    )
    max_client_connections: int = setting(
        4096,
        env="ALP_GATEWAY_HUB_MAX_CLIENT_CONNECTIONS",
        parse=_positive_int,
        help="front-door requests in progress at most (/v1: a turn each), apart from the "
        "runners' so that a fleet never locks clients out; one more gets 503 in its API's shape",
        group="hub-bounds",
        metavar="N",
    )
    # == people: sign-in with OpenID Connect (gateway/hub/oidc.py, gateway/hub/people.py)
    oidc_issuer: str | None = setting(
        env="ALP_GATEWAY_HUB_OIDC_ISSUER",
        parse=_url,
        help="let people sign in to the status page with this OpenID Connect issuer (its "
        "/.well-known/openid-configuration is read); needs --oidc-client-id",
        group="hub-people",
        shown="no sign-in: the admin credential only",
        metavar="URL",
        sample="https://login.example.com/realms/team",
    )
    oidc_client_id: str | None = setting(
        env="ALP_GATEWAY_HUB_OIDC_CLIENT_ID",
        parse=_str,
        help="the hub's client id at the --oidc-issuer (its redirect URI: the hub's address "
        "with /auth/callback)",
        group="hub-people",
        metavar="ID",
        sample="alp-hub",
    )
    oidc_client_secret_file: Path | None = setting(
        env="ALP_GATEWAY_HUB_OIDC_CLIENT_SECRET_FILE",
        parse=_path,
        help="a file holding the client's secret (else ALP_GATEWAY_HUB_OIDC_CLIENT_SECRET; "
        "none: a public client, PKCE alone)",
        group="hub-people",
        metavar="FILE",
        sample="/run/secrets/oidc-client-secret",
    )
    oidc_client_secret: str | None = setting(
        env="ALP_GATEWAY_HUB_OIDC_CLIENT_SECRET",
        parse=_str,
        help="the client's secret itself (prefer the environment or --oidc-client-secret-file "
        "to a flag, which other users of the machine can see)",
        group="hub-people",
        metavar="SECRET",
        secret=True,
    )
    oidc_admin_group: str | None = setting(
        env="ALP_GATEWAY_HUB_OIDC_ADMIN_GROUP",
        parse=_str,
        help="a person whose --oidc-groups-claim holds this value is an admin (sees and does "
        "everything); everyone else who signs in is a member (their own keys and usage)",
        group="hub-people",
        shown="none: every person is a member",
        metavar="GROUP",
        sample="hub-admins",
    )
    oidc_groups_claim: str = setting(
        "groups",
        env="ALP_GATEWAY_HUB_OIDC_GROUPS_CLAIM",
        parse=_str,
        help="the ID token claim (a list or a string) --oidc-admin-group is looked for in",
        group="hub-people",
        metavar="CLAIM",
    )
    oidc_member_projects: tuple[str, ...] = setting(
        ("local/chat",),
        env="ALP_GATEWAY_HUB_OIDC_MEMBER_PROJECTS",
        parse=_projects,
        help="the projects (OWNER/PROJECT, comma-separated) a member may make API keys for",
        group="hub-people",
        shown="local/chat",
        metavar="PROJECTS",
        sample="local/chat",
    )
    oidc_redirect_url: str | None = setting(
        env="ALP_GATEWAY_HUB_OIDC_REDIRECT_URL",
        parse=_url,
        help="the hub's address as browsers reach it (behind a proxy); /auth/callback is added",
        group="hub-people",
        shown="the address the browser used",
        metavar="URL",
        sample="https://hub.example.com",
    )
    oidc_session_lifetime: float = setting(
        12 * 3600.0,
        env="ALP_GATEWAY_HUB_OIDC_SESSION_LIFETIME",
        parse=parse_duration,
        help="how long a sign-in lasts (30m, 12h, 7d); sign-out ends it at once",
        group="hub-people",
        shown="12h",
        metavar="DURATION",
        sample="12h",
    )
    # -- not settings: ways to be another Server in tests
    events: bool = True  # serve GET {base}/runners/events (the job_available push)
    register_paths: tuple[str, ...] = ("runners", "runners/register")  # under {base}/

    @property
    def pong_timeout(self) -> float:
        """Seconds a channel may stay silent after a ping before it is closed as dead."""
        return self.ping_interval if self.ping_timeout is None else self.ping_timeout


HUB_SETTINGS: tuple[Setting, ...] = _settings(HubSettings)
_HUB_BY_KEY = {s.key: s for s in HUB_SETTINGS}


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


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None


def read_toml(path: Path) -> FileSettings:
    """Read and check ``path``: an unknown key or table is an error naming the file and the key."""
    data = _load_toml(path)
    where = f"config file {path}"
    values: dict[str, Any] = {}
    backends: tuple[BackendTable, ...] = ()
    aliases: dict[str, str] = {}
    for key, value in data.items():
        norm = key.replace("-", "_")
        urls = isinstance(value, str) or (
            isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
        )
        if norm == "backend" and not urls:  # [[backend]] tables, not backend = URL or [URLs]
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


def flag_help(setting: Setting) -> str:
    """A flag's help: what it does, its environment names and its default (all from the table)."""
    env = " or ".join(setting.env)
    return f"{setting.help} (env {env}; default {setting.default_text})".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """One flag per setting (and its old names), straight from the declarations. A flag not
    given leaves no attribute (``setting_flags`` reads it as None); the value is parsed once, by
    the setting's own ``parse`` when the settings are loaded, so that a flag, a variable and a TOML
    key agree. A ``repeat`` setting's flag collects every value given."""
    for setting in settings:
        names = (setting.flag, *setting.aliases)
        if setting.is_flag:
            parser.add_argument(
                *names,
                dest=setting.key,
                action="store_const",
                const=True,
                default=argparse.SUPPRESS,
                help=flag_help(setting),
            )
        else:
            parser.add_argument(
                *names,
                dest=setting.key,
                action="append" if setting.repeat else "store",
                default=argparse.SUPPRESS,
                metavar=setting.metavar or setting.key.upper(),
                help=flag_help(setting),
            )


def setting_flags(args: object, settings: tuple[Setting, ...] = SETTINGS) -> dict[str, Any]:
    """The settings given on the command line, an argparse namespace (None where a flag was not
    given)."""
    return {s.key: getattr(args, s.key, None) for s in settings}


def _merge(
    settings: tuple[Setting, ...],
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_file: Path | None,
) -> dict[str, Any]:
    """Each setting's value, parsed, from ``flags`` (None = not given) > ``env`` > the file's
    values > nothing (then the field's default applies); ConfigError names the source."""
    values: dict[str, Any] = {}
    for s in settings:
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
                if s.key in file_values:
                    raw, source = file_values[s.key], f"{s.key} in {config_file}"
        if raw is None:
            continue  # the field's default
        try:
            values[s.key] = s.parse(raw)
        except (ValueError, TypeError) as exc:
            shown = "(hidden)" if s.secret else repr(raw)
            raise ConfigError(f"{source}: invalid value {shown}: {exc}") from None
    return values


def load_config(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
) -> Config:
    """Merge ``flags`` (None = not given) > ``env`` > TOML file > defaults and validate."""
    file = read_toml(config_file) if config_file else FileSettings({})
    values = _merge(SETTINGS, flags, env, file.values, config_file)
    values["server_explicit"] = "server" in values
    values.setdefault("state_dir", default_state_dir(env))
    where = f"config file {config_file}" if config_file else "config"
    values["backends"] = tuple(
        _spec(table, n, env, where) for n, table in enumerate(file.backends, 1)
    )
    values["aliases"] = file.aliases
    return Config(**values)


def read_hub_toml(path: Path) -> dict[str, Any]:
    """The hub settings ``path`` holds (plain keys, no tables); an unknown key or any table is an
    error naming the file and the key."""
    where = f"config file {path}"
    values: dict[str, Any] = {}
    for key, value in _load_toml(path).items():
        norm = key.replace("-", "_")
        if norm in _HUB_BY_KEY:
            values[norm] = value
        elif isinstance(value, dict):
            raise ConfigError(f"{where}: unknown table [{key}] (the hub's settings are plain keys)")
        else:
            raise ConfigError(f"{where}: unknown setting {key!r}")
    return values


def load_hub_settings(
    flags: Mapping[str, Any],
    env: Mapping[str, str],
    config_file: Path | None = None,
) -> HubSettings:
    """The hub's ``HubSettings``: ``flags`` (None = not given) > ``env`` > TOML file > defaults,
    validated."""
    file_values = read_hub_toml(config_file) if config_file else {}
    values = _merge(HUB_SETTINGS, flags, env, file_values, config_file)
    values.setdefault("data", default_hub_data(env))
    if (values.get("tls_cert") is None) != (values.get("tls_key") is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if (values.get("oidc_issuer") is None) != (values.get("oidc_client_id") is None):
        raise ConfigError("--oidc-issuer and --oidc-client-id go together")
    return HubSettings(**values)
