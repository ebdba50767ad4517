"""The ``hub`` command line: serve the hub; create, list, update or revoke its front-door API keys;
print the keys' usage."""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pathlib
import re
import socket
import ssl
import sys
import time
from functools import partial
from typing import NoReturn

import trio

from gateway import logsafe
from gateway.config import default_state_dir
from gateway.config import parse_listen as config_parse_listen
from gateway.hub.app import serve_hub
from gateway.hub.hub import Hub
from gateway.hub.settings import HubSettings
from gateway.hub.store import (
    DEFAULT_KEY_PROJECT,
    LIMIT_NAMES,
    KeyLimits,
    Store,
    StoreError,
    UsageTotal,
    limits_of,
    open_store,
)
from gateway.observe import setup_logging
from gateway.signals import watch_signals

PROG = "alp-gateway hub"
DEFAULT_LISTEN = "127.0.0.1:8787"


class _UsageError(Exception):
    """A command-line mistake: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def default_data_dir() -> pathlib.Path:
    """``hub`` in the state directory (``gateway.config.default_state_dir``, the runner's rule)."""
    return default_state_dir(os.environ) / "hub"


def parse_listen(value: str) -> tuple[str, int]:
    """``--listen`` through the one parser (``gateway.config.parse_listen``); _UsageError when malformed."""
    try:
        return config_parse_listen(value)
    except ValueError as exc:
        raise _UsageError(f"--listen {value!r}: {exc}") from None


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str) -> float:
    """``30m``, ``24h``, ``7d`` (or ``90s``) as seconds; _UsageError when malformed."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", value)
    if found is None or not float(found[1]) > 0:
        raise _UsageError(f"{value!r} is not a duration such as 30m, 24h or 7d")
    return float(found[1]) * _UNITS[found[2]]


def _limit(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (0: no limit)")
    return number


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rpm", type=_limit, metavar="N", help="requests a minute (a sliding 60 s window)"
    )
    parser.add_argument(
        "--tpm",
        type=_limit,
        metavar="N",
        help="tokens a minute (prompt and completion of turns ended in the last 60 s)",
    )
    parser.add_argument(
        "--tokens-per-day", type=_limit, metavar="N", help="tokens a day (the UTC day)"
    )
    parser.add_argument("--max-streams", type=_limit, metavar="N", help="turns in flight at once")


def _build_parser() -> _Parser:
    data = _Parser(add_help=False)
    data.add_argument(
        "--data",
        type=pathlib.Path,
        default=argparse.SUPPRESS,
        help="state directory (default: $ALP_GATEWAY_STATE_DIR/hub or ~/.local/state/alp-gateway/hub)",
    )
    parser = _Parser(
        prog=PROG,
        description="Serve the hub (an ALP Server emulator) or manage its API keys.",
        epilog="Runners, API keys, Chat Jobs (with every report) and the front door's chat "
        "sessions live in DATA/hub.sqlite3: a restarted hub goes on with them. With the admin "
        "credential, GET /api/hub/jobs and GET /api/hub/sessions list them; GET /api/hub/counters "
        "gives pings sent, pong timeouts, channels declared dead and failovers. Each front-door "
        "turn's usage is kept (`hub usage` prints it).",
        parents=[data],
    )
    parser.add_argument(
        "--listen", default=DEFAULT_LISTEN, help=f"HOST:PORT to serve on (default {DEFAULT_LISTEN})"
    )
    parser.add_argument(
        "--tls-cert",
        type=pathlib.Path,
        metavar="PEM",
        help="serve HTTPS/WSS with this certificate (chain) file; needs --tls-key",
    )
    parser.add_argument(
        "--tls-key", type=pathlib.Path, metavar="PEM", help="the private key of --tls-cert"
    )
    parser.add_argument(
        "--models-wait",
        type=float,
        metavar="SECONDS",
        default=HubSettings.models_wait,
        help="how long GET /v1/models waits for a runner when no model list is known yet "
        f"(default {HubSettings.models_wait:g})",
    )
    parser.add_argument(
        "--ping-interval",
        type=float,
        metavar="SECONDS",
        default=HubSettings.ping_interval,
        help="a WebSocket ping on every chat channel this often; 0 turns pings off "
        f"(default {HubSettings.ping_interval:g})",
    )
    parser.add_argument(
        "--ping-timeout",
        type=float,
        metavar="SECONDS",
        default=None,
        help="a channel silent this long after a ping is closed as dead and its turns move "
        "(default: the ping interval)",
    )
    parser.add_argument(
        "--queue-length",
        type=int,
        metavar="N",
        default=HubSettings.queue_length,
        help="when every runner that could serve a new chat session is at capacity, at most this "
        "many requests wait in the project's queue (round-robin across API keys); one more is "
        f"answered 503 queue_full with Retry-After; 0 = none wait (default {HubSettings.queue_length})",
    )
    parser.add_argument(
        "--queue-wait",
        "--capacity-wait",
        dest="queue_wait",
        type=float,
        metavar="SECONDS",
        default=HubSettings.queue_wait,
        help="a request waits this long in the queue for a runner to free up, then 503 "
        f"queue_timeout with Retry-After (--capacity-wait: the old name) (default {HubSettings.queue_wait:g})",
    )
    parser.add_argument(
        "--max-sessions-per-key",
        type=int,
        metavar="N",
        default=HubSettings.max_sessions_per_key,
        help="chat sessions one API key may hold: past it the key's least recently used idle "
        "session is ended, or 429 when all are busy; 0 = no bound "
        f"(default {HubSettings.max_sessions_per_key})",
    )
    parser.add_argument(
        "--default-model",
        metavar="MODEL",
        default=None,
        help="serve a request for a model no runner lists with this one instead of a 404 (for "
        "clients with fixed model names, such as Claude Code's claude-*) (default: the 404)",
    )
    parser.add_argument(
        "--head-timeout",
        type=float,
        metavar="SECONDS",
        default=HubSettings.head_timeout,
        help="a request head (or TLS handshake) not complete within this is closed; also how "
        f"long a kept-alive connection waits for its next request (default {HubSettings.head_timeout:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        default=HubSettings.body_timeout,
        help="a request body not complete within this of its head gets 408 and is closed "
        f"(default {HubSettings.body_timeout:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        default=HubSettings.max_connections,
        help="open connections at most; one more gets 503 and is closed "
        f"(default {HubSettings.max_connections})",
    )
    parser.add_argument(
        "--usage-retention",
        metavar="DURATION",
        default=None,
        help="keep each front-door turn's usage row this long (30m, 24h, 7d); the hourly totals "
        f"per key and model are kept for good (default {HubSettings.usage_retention / 86400:g}d)",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    keys = sub.add_parser("keys", help="manage front-door API keys", parents=[data])
    keys_sub = keys.add_subparsers(
        dest="keys_command",
        metavar="{create,list,update,revoke}",
        parser_class=_Parser,
        required=True,
    )
    create = keys_sub.add_parser(
        "create", help="create an API key (printed once), with its limits", parents=[data]
    )
    create.add_argument("name")
    create.add_argument(
        "--project",
        default=DEFAULT_KEY_PROJECT,
        help=f"OWNER/PROJECT the key chats in (default {DEFAULT_KEY_PROJECT})",
    )
    create.add_argument(
        "--create",
        action="store_true",
        help="start a new hub store in --data when there is none (otherwise refused: a key in "
        "a store no hub serves is a key every hub rejects)",
    )
    _add_limit_flags(create)
    keys_sub.add_parser("list", help="list API keys and their limits", parents=[data])
    update = keys_sub.add_parser(
        "update",
        help="change an API key's limits (the flags given; 0 = no limit); a running hub "
        "applies them within its key check interval",
        parents=[data],
    )
    update.add_argument("name")
    _add_limit_flags(update)
    revoke = keys_sub.add_parser("revoke", help="revoke an API key", parents=[data])
    revoke.add_argument("name")
    usage = sub.add_parser(
        "usage",
        help="print the front-door usage per API key and model (turns, tokens, errors)",
        parents=[data],
    )
    usage.add_argument("--key", metavar="NAME", help="only this API key")
    usage.add_argument(
        "--since", default="24h", metavar="DURATION", help="30m, 24h, 7d... (default 24h)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``alp-gateway hub ...``; returns the exit status."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        data_dir: pathlib.Path = getattr(args, "data", None) or default_data_dir()
        if args.command == "keys":
            return _keys(args, data_dir)
        if args.command == "usage":
            return _usage(args, data_dir)
        host, port = parse_listen(args.listen)
        if (args.tls_cert is None) != (args.tls_key is None):
            raise _UsageError("--tls-cert and --tls-key go together")
        if args.tls_cert is not None:
            _check_tls(args.tls_cert, args.tls_key)
        if not args.models_wait > 0:
            raise _UsageError("--models-wait must be a positive number of seconds")
        if not args.ping_interval >= 0:
            raise _UsageError("--ping-interval must be 0 (off) or a positive number of seconds")
        if args.ping_timeout is not None and not args.ping_timeout > 0:
            raise _UsageError("--ping-timeout must be a positive number of seconds")
        if not args.queue_wait >= 0:
            raise _UsageError(
                "--queue-wait (--capacity-wait) must be 0 or a positive number of seconds"
            )
        if args.queue_length < 0:
            raise _UsageError("--queue-length must be 0 (no queue) or a positive number")
        if args.max_sessions_per_key < 0:
            raise _UsageError("--max-sessions-per-key must be 0 (no bound) or a positive number")
        if not args.head_timeout > 0 or not args.body_timeout > 0:
            raise _UsageError(
                "--head-timeout and --body-timeout must be positive numbers of seconds"
            )
        if args.max_connections < 1:
            raise _UsageError("--max-connections must be a positive number")
        retention = HubSettings.usage_retention
        if args.usage_retention is not None:
            retention = parse_duration(args.usage_retention)
        settings = HubSettings(
            models_wait=args.models_wait,
            ping_interval=args.ping_interval,
            ping_timeout=args.ping_timeout,
            queue_length=args.queue_length,
            queue_wait=args.queue_wait,
            max_sessions_per_key=args.max_sessions_per_key,
            default_model=args.default_model,
            head_timeout=args.head_timeout,
            body_timeout=args.body_timeout,
            max_connections=args.max_connections,
            usage_retention=retention,
        )
        _check_listen(host, port)  # before the data directory and an admin token are made
        return _serve(data_dir, host, port, args.tls_cert, args.tls_key, settings)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except _UsageError as exc:
        return _fail(str(exc))
    except (OSError, StoreError, ValueError) as exc:
        return _fail(str(exc))


def _check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once and let go, as the server will (SO_REUSEADDR, like trio's
    listeners): a port in use is a one-line error before anything is created on disk."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise _UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise _UsageError(
                    f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from None


def _check_tls(cert: pathlib.Path, key: pathlib.Path) -> None:
    """Load the certificate and key once, so a bad pair is a one-line error before serving."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise _UsageError(f"cannot use --tls-cert {cert} with --tls-key {key}: {reason}") from None


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _no_hub_in(data_dir: pathlib.Path) -> str | None:
    """Why ``data_dir`` holds no hub (None when it holds one): ``keys`` and ``usage`` work on
    an existing hub's store, never on an empty one they would make up."""
    if (data_dir / "hub.sqlite3").exists():
        return None
    return (
        f"no hub in {data_dir} (no hub.sqlite3): give the --data of the hub you run "
        f"(`alp-gateway hub` uses {default_data_dir()} unless told otherwise)"
    )


def _keys(args: argparse.Namespace, data_dir: pathlib.Path) -> int:
    missing = _no_hub_in(data_dir)
    if missing is not None and not (args.keys_command == "create" and args.create):
        extra = "; or `keys create --create` to start a new hub store there"
        return _fail(missing + (extra if args.keys_command == "create" else ""))
    return trio.run(_keys_in, args, open_store(data_dir))


async def _keys_in(args: argparse.Namespace, store: Store) -> int:
    try:
        if args.keys_command == "create":
            limits = limits_of(*(getattr(args, name) for name in LIMIT_NAMES))
            key = await store.create_api_key(args.name, args.project, limits)
            print(
                f"created API key {args.name!r} for {args.project} (limits: "
                f"{limits.describe()}); it is shown only now:",
                file=sys.stderr,
            )
            print(key)
            return 0
        if args.keys_command == "list":
            keys = await store.list_api_keys()
            if not keys:
                print("no API keys", file=sys.stderr)
                return 0
            width = max(len("NAME"), *(len(str(k["name"])) for k in keys))
            print(f"{'NAME':<{width}}  {'PROJECT':<24}  {'CREATED':<20}  {'STATUS':<7}  LIMITS")
            for k in keys:
                project = f"{k['owner']}/{k['project']}"
                status = "revoked" if k["revoked"] else "active"
                key_limits = k["limits"]
                assert isinstance(key_limits, KeyLimits)
                print(
                    f"{k['name']!s:<{width}}  {project:<24}  {k['createdAt']!s:<20}  "
                    f"{status:<7}  {key_limits.describe()}"
                )
            return 0
        if args.keys_command == "update":
            given = {name: getattr(args, name) for name in LIMIT_NAMES}
            if all(value is None for value in given.values()):
                raise _UsageError(
                    "keys update needs at least one of --rpm, --tpm, "
                    "--tokens-per-day, --max-streams"
                )
            found = await store.key_limits(args.name)
            if found is None:
                return _fail(f"no active API key named {args.name!r}")
            old = found[1]
            merged = {
                name: getattr(old, name) if value is None else value
                for name, value in given.items()
            }
            limits = limits_of(**merged)
            if not await store.set_key_limits(args.name, limits):
                return _fail(f"no active API key named {args.name!r}")
            print(f"API key {args.name!r} limits: {limits.describe()}")
            return 0
        if await store.revoke_api_key(args.name):
            print(f"revoked API key {args.name!r}")
            return 0
        return _fail(f"no active API key named {args.name!r}")
    finally:
        await store.close()


def _usage(args: argparse.Namespace, data_dir: pathlib.Path) -> int:
    """``hub usage``: per key and model since ``--since``, from the store (the hub may run)."""
    span = parse_duration(args.since)
    missing = _no_hub_in(data_dir)
    if missing is not None:
        return _fail(missing)
    since = time.time() - span
    totals, exact = trio.run(_totals, open_store(data_dir), since, args.key)
    start = datetime.datetime.fromtimestamp(since, datetime.UTC)
    if not exact:
        start = start.replace(minute=0, second=0, microsecond=0)
    when = start.strftime("%Y-%m-%d %H:%M:%S UTC")
    note = "" if exact else " (from the hourly totals: the first hour counted whole)"
    whose = f" of API key {args.key!r}" if args.key else ""
    if not totals:
        print(f"no usage{whose} since {when}{note}")
        return 0
    print(f"usage{whose} since {when}{note}")
    header = ("KEY", "MODEL", "TURNS", "PROMPT TOKENS", "COMPLETION TOKENS", "ERRORS")
    rows = [
        (
            t.key_name,
            t.model or "-",
            str(t.turns),
            str(t.prompt_tokens),
            str(t.completion_tokens),
            str(t.errors),
        )
        for t in totals
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: tuple[str, ...]) -> str:
        left = [f"{c:<{w}}" for c, w in zip(cells[:2], widths[:2], strict=True)]
        right = [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    print(line(header))
    for row in rows:
        print(line(row))
    return 0


async def _totals(store: Store, since: float, key: str | None) -> tuple[list[UsageTotal], bool]:
    try:
        return await store.usage_totals(since, key)
    finally:
        await store.close()


def configure_logging() -> None:
    """The hub's log output: INFO lines on stderr in the runner's format (``gateway.observe``;
    JSON when ALP_GATEWAY_LOG_FORMAT=json), unless logging is set up already; every handler's
    lines escaped and capped (``gateway.logsafe``: clients choose some of the values)."""
    root = logging.getLogger()
    if not root.handlers:
        fmt = "json" if os.environ.get("ALP_GATEWAY_LOG_FORMAT", "").lower() == "json" else "text"
        setup_logging("INFO", fmt)
    for handler in root.handlers:
        logsafe.install(handler)
    logging.getLogger("gateway.wire.server").setLevel(logging.WARNING)


def _serve(
    data_dir: pathlib.Path,
    host: str,
    port: int,
    certfile: pathlib.Path | None = None,
    keyfile: pathlib.Path | None = None,
    settings: HubSettings | None = None,
) -> int:
    hub = Hub(data_dir, settings=settings)
    if hub.admin_token_created:
        print(
            f"admin token (a user credential for runner registration; shown only now, kept in {data_dir / 'admin-token'}):"
        )
        print(f"  {hub.admin_token}", flush=True)
    configure_logging()
    try:
        trio.run(_run, hub, host, port, certfile, keyfile)
    except KeyboardInterrupt:
        pass
    except BaseExceptionGroup as group:
        error = _first_os_error(group)
        if error is None:
            raise
        return _fail(f"cannot listen on {host}:{port}: {error.strerror or error}")
    except OSError as error:
        return _fail(f"cannot listen on {host}:{port}: {error.strerror or error}")
    finally:
        trio.run(hub.store.close)  # what the hub's writer left queued, if anything
    return 0


def _first_os_error(group: BaseExceptionGroup[BaseException]) -> OSError | None:
    for exc in group.exceptions:
        if isinstance(exc, OSError):
            return exc
        if isinstance(exc, BaseExceptionGroup):
            found = _first_os_error(exc)
            if found is not None:
                return found
    return None


async def _run(
    hub: Hub,
    host: str,
    port: int,
    certfile: pathlib.Path | None = None,
    keyfile: pathlib.Path | None = None,
) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_signals, lambda _signum: stop.set())
        serve = partial(serve_hub, hub, host=host, port=port, certfile=certfile, keyfile=keyfile)
        base_url: str = await nursery.start(serve)
        # "hub listening on" stays the last line of the start (scripts wait for it)
        print(f"status page: {base_url}/ (sign in with the admin credential)", flush=True)
        print(f"hub listening on {base_url}", flush=True)
        await stop.wait()
        print("hub stopping", flush=True)
        nursery.cancel_scope.cancel()
