"""The ``alp-gateway`` command: run, register, hub, sim, demo, status, connect, --version."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import trio

from gateway import __version__, logsafe
from gateway.config import SETTINGS, Config, ConfigError, add_flags, load_config, setting_flags
from gateway.heap import settle
from gateway.observe import setup_logging
from gateway.runner.state import StateError

log = logging.getLogger("gateway")


def _add_settings(parser: argparse.ArgumentParser, *, register_only: bool = False) -> None:
    """``--config`` and one flag per runner setting (``gateway.config.add_flags``)."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="a TOML file of these settings, each under its flag's name with underscores "
        '(poll_interval = 5); several backends as [[backend]] tables of name = "…", url = "…"',
    )
    add_flags(parser, [s for s in SETTINGS if s.register or not register_only])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alp-gateway",
        description="A chat-llm:v1 Runner for the ALP platform: "
        "relays chat turns to a local model server.",
    )
    parser.add_argument("--version", action="version", version=f"alp-gateway {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="poll the Server and serve chat sessions")
    _add_settings(run)
    register = sub.add_parser("register", help="register this runner with the Server")
    _add_settings(register, register_only=True)
    doctor = sub.add_parser(
        "doctor", help="check config, state file, Server and backends; say how to fix"
    )
    _add_settings(doctor)
    doctor.add_argument(
        "--deep",
        action="store_true",
        help="also ask each backend for a one-token completion and time it",
    )
    demo = sub.add_parser("demo", help="hub + runner + backend in one process, one prompt")
    demo.add_argument("--prompt", default="Say hello from the edge, in one short sentence.")
    demo.add_argument("--backend", help="use this backend URL instead of looking for one")
    demo.add_argument("--model", help="model to ask (default: the backend's first)")
    demo.add_argument("--sim", action="store_true", help="always use the built-in simulator")
    from gateway.ops.status import add_arguments as add_status_arguments

    add_status_arguments(
        sub.add_parser(
            "status",
            help="health, sessions, turns and backends of a running "
            "runner (from its --metrics-listen port)",
        )
    )
    from gateway.ops.connect import add_arguments as add_connect_arguments

    add_connect_arguments(
        sub.add_parser(
            "connect",
            help="set a coding agent up for the hub: an API key, a model, its files and "
            "environment (claude-code, codex, opencode, aider, continue, open-webui)",
        )
    )
    sub.add_parser(
        "hub",
        help="run the hub: your own ALP Server, with an OpenAI/Anthropic/Responses-compatible "
        "front door (see `alp-gateway hub --help`)",
        add_help=False,
    )
    sub.add_parser(
        "sim", help="run the backend simulator (see `alp-gateway sim --help`)", add_help=False
    )
    return parser


def _config_from(args: argparse.Namespace) -> Config:
    return load_config(setting_flags(args), os.environ, args.config)


def _fail(message: str, code: int = 2) -> int:
    # escaped: a message may carry what a Server or a backend answered
    print(f"alp-gateway: {logsafe.escape(message)}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "hub":
        from gateway.hub.cli import main as hub_main

        return hub_main(argv[1:])
    if argv and argv[0] == "sim":
        from gateway.sim.cli import main as sim_main

        return sim_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "demo":
            from gateway.ops.demo import main as demo_main

            return demo_main(args)
        if args.command == "status":
            from gateway.ops.status import main as status_main

            return status_main(args)
        if args.command == "connect":
            from gateway.ops.connect import main as connect_main

            return connect_main(args)
        if args.command == "doctor":
            from gateway.ops.doctor import main as doctor_main

            return doctor_main(args)
        config = _config_from(args)
        setup_logging(config.log_level, config.log_format)
        if config.project is None:
            names = " or ".join(next(s for s in SETTINGS if s.key == "project").env)
            return _fail(
                f"no project: give --project OWNER/PROJECT, or set {names} in the environment "
                "(or project = in the config file)"
            )
        if args.command == "register":
            return _register(config)
        return _run(config)
    except (ConfigError, StateError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


def _register(config: Config) -> int:
    from gateway.runner.supervisor import Runner, RunnerExit

    if not config.user_token:
        return _fail("registering needs a user credential: --user-token or AGENTICS_USER_TOKEN")
    runner = Runner(config)
    try:
        reg = trio.run(partial(runner.register, wait_for_server=False))
    except RunnerExit as exc:
        return _fail(str(exc), exc.code)
    print(  # the runner id is the Server's: escaped as in the logs
        logsafe.escape(
            f"registered runner {reg.name} ({reg.id}) for {reg.key}; saved in {runner.store.path}"
        )
    )
    return 0


def _run(config: Config) -> int:
    from gateway.runner.supervisor import Runner, RunnerExit

    if not config.backends:
        return _fail(
            "no backend: give --backend URL (or CHAT_LLM_BACKEND_URL), e.g. "
            "http://127.0.0.1:11434/v1, or [[backend]] tables in --config; "
            "`alp-gateway doctor` looks for local model servers"
        )
    runner = Runner(config)
    runner.store.lock()  # one live runner per registration: a second one is refused here

    fatal: list[RunnerExit | StateError] = []

    async def main_task() -> int:
        async with trio.open_nursery() as nursery:
            stop = trio.CancelScope()

            async def serve() -> None:
                with stop:
                    try:
                        await runner.run()
                    except (RunnerExit, StateError) as exc:
                        fatal.append(exc)
                    finally:
                        nursery.cancel_scope.cancel()

            await nursery.start(runner.watch_signals, stop)
            nursery.start_soon(serve)
        return 130 if stop.cancel_called or runner.stopped_now else 0

    # the latency tail (issue 21, point 7): what lives as long as the process set aside, so a
    # full collection walks only the sessions and turns made since (gateway/heap.py)
    settle()
    code = trio.run(main_task)
    if fatal:
        exc = fatal[0]
        return _fail(str(exc), exc.code if isinstance(exc, RunnerExit) else 2)
    return code
