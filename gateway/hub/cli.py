"""The ``hub`` command line: serve the hub; create, list, update or revoke its front-door API keys;
print the keys' usage.

Its settings (``--listen``, ``--data``, every tunable) are declared once, in ``gateway.config``
(``HubSettings``): their flags come from ``gateway.config.add_flags`` and their values
from ``load_hub_settings`` (flags > environment > ``--config`` file > defaults). This module holds
the commands only. What it prints that a client, a runner or a key's admin chose (key names,
model names) is escaped as the logs are (``gateway.logsafe``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pathlib
import socket
import ssl
import sys
import time
from collections.abc import Sequence
from functools import partial

import trio

from gateway import logsafe
from gateway.config import (
    HUB_SETTINGS,
    ConfigError,
    HubSettings,
    add_flags,
    default_hub_data,
    load_hub_settings,
    parse_duration,
    setting_flags,
)
from gateway.heap import HUB_YOUNG, settle
from gateway.hub import pricing
from gateway.hub.app import serve_hub
from gateway.hub.cliparse import Parser, UsageError, parse
from gateway.hub.hub import Hub
from gateway.hub.people_usage import usage_by_person
from gateway.hub.store import (
    DEFAULT_KEY_PROJECT,
    LIMIT_NAMES,
    KeyLimits,
    Store,
    StoreError,
    StoreMissing,
    UsageTotal,
    backup,
    limits_of,
    open_store,
)
from gateway.observe import setup_logging
from gateway.signals import watch_signals

PROG = "alp-gateway hub"
log = logging.getLogger("gateway.hub")


class _Parser(Parser):
    """The ``hub`` parser: each command takes ``--config``, ``--data`` and ``--store``."""

    def add_common(self, parser: argparse.ArgumentParser) -> None:
        _add_common(parser)


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
    pricing.add_budget_flags(parser)  # and a key's budgets and priority class


_COMMON = ("data", "store")  # settings every hub command takes (its store)


def _add_common(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--data`` and ``--store``, which every hub command takes (before or after
    its name)."""
    parser.add_argument(
        "--config",
        type=pathlib.Path,
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="a TOML file of hub settings, each under its flag's name with underscores "
        "(key_check_interval = 10)",
    )
    add_flags(parser, [s for s in HUB_SETTINGS if s.key in _COMMON])


def _build_parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description="Serve the hub, your own ALP Server: runners dial out to it and claim its "
        "chat jobs, and clients reach their models through its OpenAI-, Anthropic- and "
        "Responses-compatible front door (/v1), with API keys, limits and usage. Or manage "
        "its API keys, or print their usage.",
        epilog="Settings: flags > environment > --config FILE (TOML) > defaults. Runners, API "
        "keys, Chat Jobs (with every report) and the front door's chat sessions live in "
        "DATA/hub.sqlite3, or in the PostgreSQL database of --store: a restarted hub goes on "
        "with them. With the admin credential, GET /api/hub/jobs and GET /api/hub/sessions "
        "list them; GET /api/hub/counters gives pings sent, pong timeouts, "
        "channels declared dead and failovers. Each front-door turn's usage is kept (`hub usage` "
        "prints it).",
    )
    _add_common(parser)
    add_flags(parser, [s for s in HUB_SETTINGS if s.key not in _COMMON])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    keys = parser.command(sub, "keys", help="manage front-door API keys")
    keys_sub = keys.add_subparsers(
        dest="keys_command",
        metavar="{create,list,update,revoke}",
        parser_class=_Parser,
        required=True,
    )
    create = keys.command(
        keys_sub, "create", help="create an API key (printed once), with its limits"
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
        help="start a new hub store in --data (or --store) when there is none (otherwise "
        "refused: a key in a store no hub serves is a key every hub rejects)",
    )
    _add_limit_flags(create)
    keys.command(keys_sub, "list", help="list API keys and their limits")
    update = keys.command(
        keys_sub,
        "update",
        help="change an API key's limits (the flags given; 0 = no limit); a running hub "
        "applies them within its key_check_interval",
    )
    update.add_argument("name")
    _add_limit_flags(update)
    revoke = keys.command(
        keys_sub,
        "revoke",
        help="revoke an API key; a running hub refuses it within its key_check_interval "
        "and ends its turns in flight within a second",
    )
    revoke.add_argument("name")
    usage = parser.command(
        sub,
        "usage",
        help="print the front-door usage per API key and model (turns, tokens, errors, estimated)",
    )
    usage.add_argument("--key", metavar="NAME", help="only this API key")
    usage.add_argument(
        "--by",
        choices=("key", "person"),
        default="key",
        help="per API key (default) or per person who signed in (the keys they own; from the "
        "hourly totals)",
    )
    usage.add_argument(
        "--since", default="24h", metavar="DURATION", help="30m, 24h, 7d... (default 24h)"
    )
    backup.add_commands(parser, sub)
    from gateway.hub.runnercli import add_runners_commands

    add_runners_commands(parser, sub, _limit)
    pricing.add_prices_command(sub, parser)
    parser.command(
        sub,
        "doctor",
        help="check the hub's store (reachable, migrated) and the replicas it knows (their "
        "heartbeats, versions, and whether their addresses answer from here)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``alp-gateway hub ...``; returns the exit status."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(parser, argv, PROG)
        settings = load_hub_settings(
            setting_flags(args, HUB_SETTINGS), os.environ, getattr(args, "config", None)
        )
        if args.command == "keys":
            return _keys(args, settings)
        if args.command == "usage":
            return _usage(args, settings)
        if args.command in backup.COMMANDS:
            print(logsafe.escape(backup.command(args.command, settings, args.file)))
            return 0
        if args.command == "runners":
            from gateway.hub.runnercli import runners_command

            return runners_command(args, _open(settings), _table)
        if args.command == "prices":
            return trio.run(pricing.run_prices, args, _open(settings), settings)
        if args.command == "doctor":
            from gateway.hub.doctor import main as doctor_main

            return doctor_main(settings)
        if settings.tls_cert is not None and settings.tls_key is not None:
            _check_tls(settings.tls_cert, settings.tls_key)
        _check_listen(*settings.listen)  # before the data directory and an admin token are made
        return _serve(settings)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except (UsageError, ConfigError) as exc:
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
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _check_tls(cert: pathlib.Path, key: pathlib.Path) -> None:
    """Load the certificate and key once, so a bad pair is a one-line error before serving."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise UsageError(f"cannot use --tls-cert {cert} with --tls-key {key}: {reason}") from None


def _fail(message: str) -> int:
    print(f"{PROG}: error: {logsafe.escape(message)}", file=sys.stderr)
    return 2


def _open(settings: HubSettings, *, create: bool = False) -> Store:
    """The store of the hub the settings name (``--store``, else ``--data``'s SQLite): ``keys``
    and ``usage`` work on an existing hub's store, never on an empty one they would make up
    (unless ``create``): StoreMissing, said with what to give instead."""
    try:
        return open_store(
            settings.store or settings.data, create=create, pool_size=settings.store_pool
        )
    except StoreMissing as exc:
        if settings.store:
            raise StoreMissing(f"{exc}: give the --store of the hub you run") from None
        raise StoreMissing(
            f"{exc}: give the --data of the hub you run (`alp-gateway hub` uses "
            f"{default_hub_data(os.environ)} unless told otherwise)"
        ) from None


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int) -> list[str]:
    """Lines of a table: every cell escaped and capped as a log line's values are (a name may
    hold a terminal's escape sequence or a line break), the first ``left`` columns aligned left,
    the others right."""
    cells = [list(header)] + [[logsafe.safe(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        out = [
            f"{c:<{w}}" if i < left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(out).rstrip())
    return lines


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _keys(args: argparse.Namespace, settings: HubSettings) -> int:
    try:
        store = _open(settings, create=args.keys_command == "create" and args.create)
    except StoreMissing as missing:
        extra = "; or `keys create --create` to start a new hub store there"
        return _fail(str(missing) + (extra if args.keys_command == "create" else ""))
    within = f"within key_check_interval ({_seconds(settings.key_check_interval)})"
    return trio.run(_keys_in, args, store, within, settings.currency)


async def _keys_in(args: argparse.Namespace, store: Store, within: str, currency: str) -> int:
    try:
        if args.keys_command == "create":
            limits = limits_of(*(getattr(args, name) for name in LIMIT_NAMES))
            key = await store.create_api_key(args.name, args.project, limits)
            budget = await pricing.set_budget(store, args)
            print(
                f"created API key {logsafe.safe(args.name)!r} for {logsafe.safe(args.project)} "
                f"(limits: {limits.describe()}; {budget.describe(currency)}); it is shown only now:",
                file=sys.stderr,
            )
            print(key)
            return 0
        if args.keys_command == "list":
            keys = await store.list_api_keys()
            if not keys:
                print("no API keys", file=sys.stderr)
                return 0
            budgets = await pricing.budget_cells(store, keys, currency)
            rows = []
            for k in keys:
                key_limits = k["limits"]
                assert isinstance(key_limits, KeyLimits)
                rows.append(
                    (
                        str(k["name"]),
                        f"{k['owner']}/{k['project']}",
                        str(k["createdAt"]),
                        "revoked" if k["revoked"] else "active",
                        key_limits.describe(),
                        budgets[str(k["name"])],
                    )
                )
            header = ("NAME", "PROJECT", "CREATED", "STATUS", "LIMITS", "BUDGET")
            print("\n".join(_table(header, rows, left=len(header))))
            return 0
        name = logsafe.safe(args.name)
        if args.keys_command == "update":
            given = {limit: getattr(args, limit) for limit in LIMIT_NAMES}
            if all(value is None for value in given.values()) and not pricing.budget_given(args):
                raise UsageError(
                    "keys update needs at least one of --rpm, --tpm, --tokens-per-day, "
                    "--max-streams, --budget-daily, --budget-monthly, --priority"
                )
            found = await store.key_limits(args.name)
            if found is None:
                return _fail(f"no active API key named {name!r}")
            if not await pricing.update_budget(store, args, currency, within):
                return _fail(f"no active API key named {name!r}")
            old = found[1]
            merged = {
                limit: getattr(old, limit) if value is None else value
                for limit, value in given.items()
            }
            limits = limits_of(**merged)
            if not await store.set_key_limits(args.name, limits):
                return _fail(f"no active API key named {name!r}")
            print(
                f"API key {name!r} limits: {limits.describe()}; a running hub applies them {within}"
            )
            return 0
        if await store.revoke_api_key(args.name):
            print(
                f"revoked API key {name!r}; a running hub refuses it and ends its sessions and "
                f"turns in flight {within} (the admin API and the status page: at once)"
            )
            return 0
        return _fail(f"no active API key named {name!r}")
    finally:
        await store.close()


def _usage(args: argparse.Namespace, settings: HubSettings) -> int:
    """``hub usage``: per key and model since ``--since``, from the store (the hub may run)."""
    try:
        span = parse_duration(args.since)
    except ValueError as exc:
        raise UsageError(f"--since {args.since!r} is {exc}") from None
    since = time.time() - span
    if args.by == "person":  # the keys' owners (issue 34): gateway/hub/people_usage.py
        return usage_by_person(_open(settings), since, _table)
    found = trio.run(_totals, _open(settings), since, args.key)
    if found is None:
        return _fail(f"no API key named {logsafe.safe(args.key)!r} (`hub keys list` lists them)")
    totals, exact = found
    start = datetime.datetime.fromtimestamp(since, datetime.UTC)
    if not exact:
        start = start.replace(minute=0, second=0, microsecond=0)
    when = start.strftime("%Y-%m-%d %H:%M:%S UTC")
    note = "" if exact else " (from the hourly totals: the first hour counted whole)"
    whose = f" of API key {logsafe.safe(args.key)!r}" if args.key else ""
    if not totals:
        print(f"no usage{whose} since {when}{note}")
        return 0
    print(f"usage{whose} since {when}{note}")
    header = ("KEY", "MODEL", "TURNS", "PROMPT TOKENS", "COMPLETION TOKENS", "ERRORS", "ESTIMATED")
    rows = [
        (
            t.key_name,
            t.model or "-",
            str(t.turns),
            str(t.prompt_tokens),
            str(t.completion_tokens),
            str(t.errors),
            str(t.estimated),  # turns whose tokens are the hub's estimate
        )
        for t in totals
    ]
    print("\n".join(_table(*pricing.with_costs(header, rows, totals, settings.currency), left=2)))
    print("\n".join(pricing.cost_summary(totals, settings.currency)))
    return 0


async def _totals(
    store: Store, since: float, key: str | None
) -> tuple[list[UsageTotal], bool] | None:
    """The usage totals since ``since`` (of ``key``), None when there is no key of that name."""
    try:
        if key is not None and all(k["name"] != key for k in await store.list_api_keys()):
            return None
        return await store.usage_totals(since, key)
    finally:
        await store.close()


def configure_logging(fmt: str = "text", level: str = "INFO") -> None:
    """The hub's log output: lines on stderr in the runner's format (``gateway.observe``), every
    line the hub writes while it serves among them, unless logging is set up already; every
    handler's lines escaped and capped (``gateway.logsafe``: clients choose some of the values)."""
    root = logging.getLogger()
    if not root.handlers:
        setup_logging(level, fmt)
    for handler in root.handlers:
        logsafe.install(handler)
    logging.getLogger("gateway.wire.server").setLevel(logging.WARNING)


def _serve(settings: HubSettings) -> int:
    configure_logging(settings.log_format, settings.log_level)  # before the store may log
    hub = Hub(settings.data, settings=settings)
    if hub.admin_token_created:
        # the command's one answer, on stdout and never in a log line: a secret shown once
        shared = "; its hash in the store, for every hub on it" if settings.store else ""
        print(
            "admin token (a user credential for runner registration; shown only now, kept in "
            f"{settings.data / 'admin-token'}{shared}):"
        )
        print(f"  {hub.admin_token}", flush=True)
    host, port = settings.listen
    # what lives as long as the process set aside, and a young generation for a server whose
    # heap holds thousands of sessions: rare full collections (gateway/heap.py)
    settle(HUB_YOUNG)
    try:
        trio.run(_run, hub, settings)
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


async def _run(hub: Hub, settings: HubSettings) -> None:
    stop = trio.Event()
    host, port = settings.listen
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_signals, lambda _signum: stop.set())
        serve = partial(
            serve_hub,
            hub,
            host=host,
            port=port,
            certfile=settings.tls_cert,
            keyfile=settings.tls_key,
        )
        base_url: str = await nursery.start(serve)
        # "hub listening on" stays the last line of the start (scripts wait for it)
        log.info("status page: %s/ (sign in with the admin credential)", base_url)
        log.info("hub listening on %s", base_url)
        await stop.wait()
        log.info("hub stopping")
        nursery.cancel_scope.cancel()
