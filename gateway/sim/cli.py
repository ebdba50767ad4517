"""Parse the simulator's command line and serve until interrupted."""

from __future__ import annotations

import argparse
import sys
from functools import partial

import trio

from gateway.config import parse_listen
from gateway.signals import watch_signals
from gateway.sim.server import DIALECTS, FAULTS, WORDS, SimOptions, Simulator, serve_sim

# The simulator's own port: next to the hub's 8787, and no model server's (vLLM has 8000,
# llama.cpp 8080, LM Studio 1234, LiteLLM 4000, Ollama 11434; 8788 is `wrangler pages dev`'s), so
# doctor's look for local servers never takes the simulator for one of them.
DEFAULT_LISTEN = "127.0.0.1:8789"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alp-gateway sim",
        description="Run a simulated OpenAI-compatible model server. Each request may ask for "
        "n choices (each chunk carries all of them, each with its index) and max_tokens (the "
        'reply is cut there with finish_reason "length"), as a real server answers them.',
    )
    parser.add_argument(
        "--listen", default=DEFAULT_LISTEN, help="HOST:PORT to bind (default %(default)s)"
    )
    parser.add_argument(
        "--chunks", type=int, default=8, help="content chunks per reply (default %(default)s)"
    )
    parser.add_argument(
        "--interval", type=float, default=0.0, help="seconds between chunks (default %(default)s)"
    )
    parser.add_argument(
        "--ttft",
        type=float,
        default=0.0,
        help="seconds before the first chunk (default %(default)s)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=0,
        help="pad each token to N bytes (default %(default)s: no padding)",
    )
    parser.add_argument(
        "--models", default="sim-model", help="comma-separated model ids (default %(default)s)"
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="say each model's context length, N tokens, where the imitated server says it "
        "(/v1/models max_model_len; llama.cpp /props; Ollama /api/show num_ctx)",
    )
    parser.add_argument(
        "--key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)"
    )
    parser.add_argument(
        "--fault", choices=sorted(FAULTS), default=None, help="inject a fault (default: none)"
    )
    parser.add_argument(
        "--fault-after",
        type=int,
        default=2,
        help="chunks before the fault (default %(default)s); --fault disconnect then resets the "
        "connection: a backend that dies mid-answer",
    )
    parser.add_argument(
        "--tool-calls", action="store_true", help="stream a tool call (default: content)"
    )
    parser.add_argument(
        "--usage",
        action="store_true",
        help="always send a usage chunk (default: when the request asks)",
    )
    parser.add_argument(
        "--dialect",
        choices=sorted(DIALECTS),
        default="openai",
        help="whose streaming chunk shape to imitate (default %(default)s)",
    )
    parser.add_argument(
        "--words",
        choices=sorted(WORDS),
        default="tok",
        help="tok: tok0 tok1 …; conversation: words drawn from the messages, the same for the "
        "same conversation (default %(default)s). Either way a request ending with the start of "
        "its answer as an assistant message gets the rest of it",
    )
    return parser


async def _serve(
    host: str,
    port: int,
    options: SimOptions,
    models: list[str],
    key: str | None,
    context: int | None = None,
) -> int:
    serve = partial(
        serve_sim,
        host=host,
        port=port,
        options=options,
        models=models,
        require_key=key,
        record=False,
        context=context,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_signals, lambda _signum: nursery.cancel_scope.cancel())
        try:
            sim: Simulator = await nursery.start(serve)
        except OSError as exc:
            print(f"sim: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
            nursery.cancel_scope.cancel()
            return 1
        print(f"sim listening on {sim.url}", flush=True)
    return 0


def _only_interrupts(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_interrupts(e) for e in exc.exceptions)
    return isinstance(exc, KeyboardInterrupt)


def main(argv: list[str] | None = None) -> int:
    """Run the simulator until Ctrl-C; return the process exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        try:
            host, port = parse_listen(args.listen)
        except ValueError as exc:
            raise ValueError(f"--listen {args.listen!r}: {exc}") from None
        options = SimOptions(
            chunks=args.chunks,
            interval=args.interval,
            ttft=args.ttft,
            tool_calls=args.tool_calls,
            usage=args.usage,
            fault=args.fault,
            fault_after=args.fault_after,
            chunk_size=args.chunk_size,
            dialect=args.dialect,
            words=args.words,
        )
    except ValueError as exc:
        parser.error(str(exc))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        parser.error("--models needs at least one model id")
    try:
        if args.context is not None and args.context < 1:
            parser.error("--context must be a positive number of tokens")
        return trio.run(_serve, host, port, options, models, args.key, args.context)
    except BaseException as exc:  # a Ctrl-C that beat the signal receiver
        if _only_interrupts(exc):
            return 0
        raise
